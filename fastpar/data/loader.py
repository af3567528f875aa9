"""The public loader objects: a cursor over the epoch plan with set_epoch, len and exact resume.

Cursor semantics (the same for every loader in fastpar.data): the loader remembers (epoch, batch),
how far the data has been consumed; ``state_dict()`` saves it. A pass (``for ... in loader``) yields
the whole of the current epoch, then moves the cursor to (epoch + 1, 0), so successive passes reshuffle
even without ``set_epoch``. ``set_epoch(e)`` moves it to (e, 0). ``load_state_dict`` restores a saved
cursor, and the *next* pass starts at that batch without decoding the ones before it. A pass abandoned
part-way (``break``) leaves the cursor where it stopped, for a checkpoint; the next pass starts that
epoch again from its first batch, like a DataLoader. So every pass yields ``len(loader)`` batches,
except the one right after ``load_state_dict``.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from .._optional import available
from ..host import usable_cpu_count
from ..user_errors import redact_url
from .remote.store import StoreOptions
from .sharding import ShardSpec, rank_batches
from .sources import open_image_source
from .transforms import IMAGENET_MEAN, IMAGENET_STD

ON_CORRUPT = ("raise", "skip")
BACKENDS = ("auto", "dali", "torch")
GPU_DECODING = "mixed"  # image_loader's device for DALI's GPU decoder; the batches arrive on this rank's GPU


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Rank and world size, defaulting to the initialised torch.distributed group, else (0, 1)."""
    dist = torch.distributed
    initialised = dist.is_available() and dist.is_initialized()
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    if world_size is None:
        world_size = dist.get_world_size() if initialised else 1
    return rank, world_size


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The given device, else this rank's current GPU when there is one, else CPU."""
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gpu_decoding(backend: str) -> str:
    """``device="mixed"``: decode on this rank's GPU with DALI's "mixed" decoder (nvJPEG) and deliver the batches
    there; the backend that does it, or why it can't be done here."""
    if backend == "torch":
        raise ValueError(
            'device="mixed" decodes on the GPU with DALI; the torch backend decodes on CPU workers: use '
            'backend="dali" (or "auto" with DALI installed), or device="cuda" to decode on CPU and deliver to the GPU'
        )
    if backend == "auto" and not available("nvidia.dali"):
        raise ValueError(
            'device="mixed" decodes on the GPU with NVIDIA DALI, which is not installed: '
            "pip install --no-build-isolation -e '.[dali]', or use device=\"cuda\" (decoded on CPU, delivered to the GPU)"
        )
    if not torch.cuda.is_available():
        raise ValueError('device="mixed" decodes on a GPU, but torch sees none here; use device="cpu"')
    return "dali"


class PlannedLoader:
    """Base of fastpar's loaders: iterates this rank's planned batches from a resumable cursor.

    Subclasses implement ``_iterate(epoch, batches)`` yielding one output per planned batch.
    """

    def __init__(self, spec: ShardSpec):
        self.spec = spec
        self.epoch = 0
        self.batch = 0
        self._resume = False  # set by load_state_dict: the next pass starts at self.batch, not at 0

    def __len__(self) -> int:
        return len(self.spec)

    @property
    def rank(self) -> int:
        return self.spec.rank

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    def set_epoch(self, epoch: int) -> None:
        """Start the next pass at the beginning of ``epoch`` (its own shuffle)."""
        self.epoch, self.batch, self._resume = int(epoch), 0, False

    def state_dict(self) -> dict[str, Any]:
        """Where the next pass starts, plus the plan it refers to (checked on load)."""
        s = self.spec
        return {
            "epoch": self.epoch,
            "batch": self.batch,
            "seed": s.seed,
            "num_samples": s.num_samples,
            "batch_size": s.batch_size,
            "world_size": s.world_size,
            "last_batch": s.last_batch,
            "shuffle": s.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state["batch"]`` of ``state["epoch"]``; the plan must match the saved one."""
        s = self.spec
        current = {"seed": s.seed, "num_samples": s.num_samples, "batch_size": s.batch_size}
        current.update(world_size=s.world_size, last_batch=s.last_batch, shuffle=s.shuffle)
        differ = {k: (state[k], v) for k, v in current.items() if k in state and state[k] != v}
        if differ:
            detail = ", ".join(f"{k}: saved {old!r}, now {new!r}" for k, (old, new) in differ.items())
            raise ValueError(
                f"cannot resume exactly: the saved loader state refers to another plan ({detail}). "
                "Use the same data, batch size, world size, seed and policy, or call set_epoch() to start an epoch"
            )
        epoch, batch = int(state["epoch"]), int(state["batch"])
        if not 0 <= batch <= len(self):
            raise ValueError(f"saved batch {batch} is outside this epoch's 0..{len(self)} batches")
        self.epoch, self.batch = (epoch + 1, 0) if batch == len(self) else (epoch, batch)
        self._resume = self.batch > 0

    def __iter__(self) -> Iterator[Any]:
        epoch, start = self.epoch, self.batch if self._resume else 0
        self.batch, self._resume = start, False
        batches = rank_batches(self.spec, epoch)[start:]
        for output in self._iterate(epoch, batches):
            self.batch += 1  # before yielding: a state_dict taken inside the loop body resumes after this batch
            yield output
        if self.epoch == epoch and self.batch == len(self):
            self.epoch, self.batch = epoch + 1, 0

    def _iterate(self, epoch: int, batches: list) -> Iterator[Any]:
        raise NotImplementedError


def default_num_threads() -> int:
    """CPU threads (DALI) or worker processes (torch) per rank: the rank's share of the cores, 1..8."""
    cores = usable_cpu_count()
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, min(8, cores // max(1, local_ranks)))


class ImageBackend(Protocol):
    """What decodes an image loader's batches: DALI (``dali_backend``) or a torch DataLoader (``torch_backend``)."""

    name: str

    def iterate(
        self,
        epoch: int,
        batches: list,
        on_corrupt: Callable[[list[str]], None],
        next_pass: Callable[[], tuple[int, list]] | None = None,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(images, labels) for each planned batch in order; undecodable files go to ``on_corrupt(paths)``;
        ``next_pass()`` names the pass expected after this one, which a backend may start prefetching."""
        ...


class ImageLoader(PlannedLoader):
    """Image-classification batches ``(images, labels)``: float32 (B, 3, size, size) normalised, int64 (B,)."""

    def __init__(self, spec: ShardSpec, backend: ImageBackend, folder, on_corrupt: str):
        super().__init__(spec)
        self.backend, self.folder, self.on_corrupt = backend, folder, on_corrupt
        self.corrupt_files: list[str] = []  # every file skipped as undecodable so far
        self._warned = 0

    @property
    def classes(self) -> list[str]:
        return self.folder.classes

    def _record_corrupt(self, paths: list[str]) -> None:
        self.corrupt_files.extend(p for p in paths if p not in self.corrupt_files)

    def _iterate(self, epoch: int, batches: list) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        def next_pass() -> tuple[int, list]:  # a pass run to its end leaves the cursor at (epoch + 1, 0)
            return epoch + 1, rank_batches(self.spec, epoch + 1)

        yield from self.backend.iterate(epoch, batches, self._record_corrupt, next_pass)
        if len(self.corrupt_files) > self._warned:  # warn once per newly found set, with count and paths
            new = self.corrupt_files[self._warned :]
            self._warned = len(self.corrupt_files)
            warnings.warn(
                redact_url(
                    f"skipped {len(new)} undecodable image(s) in epoch {epoch} (on_corrupt='skip'): "
                    + ", ".join(new[:10])
                    + (f" and {len(new) - 10} more" if len(new) > 10 else "")
                    + "; their batches were smaller. loader.corrupt_files lists them all."
                ),
                stacklevel=3,
            )

    def __repr__(self) -> str:
        return (
            f"ImageLoader({self.folder.root}, {len(self.folder)} images, {len(self.classes)} classes, "
            f"backend={self.backend.name}, rank {self.rank}/{self.world_size}, {len(self)} batches/epoch)"
        )


def image_loader(
    root: str | Path,
    batch_size: int,
    *,
    train: bool = True,
    size: int = 224,
    rank: int | None = None,
    world_size: int | None = None,
    backend: str = "auto",
    num_threads: int | None = None,
    seed: int = 0,
    last_batch: str = "partial",
    shuffle: bool | None = None,
    device: str | torch.device | None = None,
    on_corrupt: str = "raise",
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    strict: bool = True,
    cache_dir: str | Path | None = None,
    cache_max_bytes: int | str | None = None,
    endpoint_url: str | None = None,
    storage: StoreOptions | None = None,
) -> ImageLoader:
    """A loader over ``root/<class>/<image>`` (JPEG/PNG) for this rank of a data-parallel job.

    ``root`` is a local folder or an object-store URL: ``s3://bucket/prefix`` (boto3; credentials from
    the standard AWS chain; endpoint ``endpoint_url`` or ``AWS_ENDPOINT_URL`` for MinIO/Ceph/...) or
    another fsspec URL. The bucket is listed once (rank 0, broadcast) and each rank fetches only its
    shard, many requests at once, with retries. ``cache_dir``: keep fetched objects on local disk (shared
    by the ranks; at most ``cache_max_bytes``, e.g. "50G"), so later epochs read from disk. ``storage``:
    the rest (retries, requests in flight, which reader DALI uses): see ``fastpar.data.StoreOptions``.

    Yields ``(images, labels)``: float32 ``(B, 3, size, size)`` normalised with ``mean``/``std`` and int64
    ``(B,)``, on ``device`` (default: this rank's current GPU if any, else CPU; ``"mixed"``: decoded on this
    rank's GPU by DALI's "mixed" decoder and delivered there, an error without DALI or a GPU). ``train=True``: random
    resized crop + horizontal flip, shuffled; ``train=False``: shorter side to size/0.875 + centre crop,
    in file order. ``backend``: "dali" (DALI pipeline; GPU decoding when the device is a GPU), "torch"
    (DataLoader + PIL), "auto" (DALI when installed). ``num_threads``: DALI threads or DataLoader workers
    (0 decodes in this process). ``last_batch``: "partial" | "drop" | "pad" (see fastpar.data.sharding).
    ``on_corrupt``: "raise" a CorruptImageError naming the file, or "skip" it (its batch is one smaller;
    one warning per epoch with the paths; ``loader.corrupt_files``). ``strict=False`` skips files that are
    not JPEG/PNG instead of raising.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if on_corrupt not in ON_CORRUPT:
        raise ValueError(f"on_corrupt must be one of {ON_CORRUPT}, got {on_corrupt!r}")
    if size < 1:
        raise ValueError(f"size must be a positive number of pixels, got {size}")
    if isinstance(device, str) and device == GPU_DECODING:
        backend, device = _gpu_decoding(backend), "cuda"
    rank, world_size = resolve_rank(rank, world_size)
    storage = dataclasses.replace(storage or StoreOptions(), **({"endpoint_url": endpoint_url} if endpoint_url else {}))
    folder, source = open_image_source(
        root,
        strict=strict,
        world_size=world_size,
        cache_dir=cache_dir,
        cache_max_bytes=cache_max_bytes,
        storage=storage,
    )
    spec = ShardSpec(len(folder), batch_size, rank, world_size, seed, train if shuffle is None else shuffle, last_batch)
    device = resolve_device(device)
    threads = default_num_threads() if num_threads is None else num_threads
    if backend == "auto":
        backend = "dali" if available("nvidia.dali") else "torch"
    common = dict(size=size, train=train, seed=seed, device=device, mean=tuple(mean), std=tuple(std))
    if backend == "dali":
        from .dali_backend import DaliImageBackend, dali_should_read

        impl = DaliImageBackend(
            source,
            folder.labels,
            batch_size=batch_size,
            rank=rank,
            num_threads=max(1, threads),
            skip_corrupt=on_corrupt == "skip",
            dali_reads=dali_should_read(source, storage),
            read_retries=storage.retries,
            **common,
        )
    else:
        from .torch_backend import TorchImageBackend

        impl = TorchImageBackend(
            source, folder.labels, num_workers=threads, skip_corrupt=on_corrupt == "skip", **common
        )
    return ImageLoader(spec, impl, folder, on_corrupt)
