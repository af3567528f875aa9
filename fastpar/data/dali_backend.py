"""The DALI backend: decode and augment in a DALI pipeline fed with file bytes by the epoch plan.

Graph (both the wrapped loader and :func:`bare_pipeline` build it with :func:`augment`):
train: ``decoders.image_random_crop`` (decodes only the crop where it can) -> ``resize`` to size x size
-> ``crop_mirror_normalize`` (random flip, CHW float); eval: ``decoders.image`` -> ``resize`` shorter
side to size/0.875 -> ``crop_mirror_normalize`` (centre crop). With a GPU the decoder runs with
``device="mixed"`` (nvJPEG) and everything after it on the rank's GPU; without one, on CPU threads
(``device_id=None``).

The wrapper feeds ``fn.external_source`` one planned batch at a time (file bytes only; labels never
enter DALI, they come from the plan), so DALI and the torch backend share the exact order and sharding.

Determinism: the order is exact for a (seed, epoch). The pipeline is rebuilt at every epoch start
with a seed derived from (seed, epoch, rank, first batch), so an epoch iterated from its start repeats
its crops and flips exactly; an epoch resumed mid-way gets the same samples in the same batches but
different (still seeded) crops and flips than the uninterrupted run would have drawn.

Epoch boundaries: when a pass has its last batch, the pipeline for the pass expected next (epoch + 1
from its start: the cursor after a full pass) is built with that pass's seed and starts prefetching,
so the next epoch's first batches decode while the caller finishes this one, as the bare pipeline's
reader does by running on. Its batches are the ones a fresh build would give; a pass that asks for
anything else (``set_epoch`` to another epoch, ``load_state_dict``, new corrupt files) drops it. The
cost: between epochs a loader holds a second pipeline with ``prefetch_queue_depth`` decoded batches.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from .._optional import available, require
from ..user_errors import redact_url
from .remote.errors import ObjectReadError, ObjectStoreError
from .remote.store import StoreOptions
from .sources import LocalFiles, ObjectFiles
from .transforms import (
    EVAL_CROP_FRACTION,
    IMAGENET_MEAN,
    IMAGENET_STD,
    RRC_RATIO,
    RRC_SCALE,
    CorruptImageError,
    decode_rgb,
)


def _dali():
    return require("nvidia.dali", purpose="backend='dali'")


def augment(encoded, *, train: bool, size: int, decoder_device: str, mean: Sequence[float], std: Sequence[float]):
    """The decode + augment graph on a DataNode of encoded images; returns (B, 3, size, size) float."""
    _dali()
    from nvidia.dali import fn, types

    if train:
        images = fn.decoders.image_random_crop(
            encoded,
            device=decoder_device,
            output_type=types.RGB,
            random_area=list(RRC_SCALE),
            random_aspect_ratio=list(RRC_RATIO),
            num_attempts=10,
        )
        images = fn.resize(images, resize_x=size, resize_y=size, antialias=False)
        mirror = fn.random.coin_flip(probability=0.5)
    else:
        images = fn.decoders.image(encoded, device=decoder_device, output_type=types.RGB)
        images = fn.resize(images, resize_shorter=size / EVAL_CROP_FRACTION, antialias=False)
        mirror = 0
    return fn.crop_mirror_normalize(
        images,
        dtype=types.FLOAT,
        output_layout="CHW",
        crop=(size, size),
        mean=[255.0 * m for m in mean],
        std=[255.0 * s for s in std],
        mirror=mirror,
    )


def bare_pipeline(
    files: Sequence[str],
    labels: Sequence[int],
    batch_size: int,
    num_threads: int,
    *,
    train: bool = True,
    size: int = 224,
    device_id: int | None = None,
    seed: int = 0,
    shuffle: bool = True,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    prefetch_queue_depth: int = 2,
):
    """A built DALI pipeline with the loader's operators and no fastpar wrapping: ``fn.readers.file``
    -> :func:`augment`. ``pipe.run()`` returns DALI (images, labels) batches of ``batch_size``
    (wrapping around at the end). The floor that ``fastpar bench data`` compares the loader with."""
    _dali()
    from nvidia.dali import fn, pipeline_def

    @pipeline_def
    def graph():
        encoded, label = fn.readers.file(files=list(files), labels=list(labels), random_shuffle=shuffle, name="files")
        decoder_device = "cpu" if device_id is None else "mixed"
        images = augment(encoded, train=train, size=size, decoder_device=decoder_device, mean=mean, std=std)
        return images, label

    pipe = graph(
        batch_size=batch_size,
        num_threads=num_threads,
        device_id=device_id,
        seed=seed,
        prefetch_queue_depth=prefetch_queue_depth,
    )
    pipe.build()
    return pipe


@functools.cache
def dali_reads_s3() -> bool:
    """Whether the installed DALI reads ``s3://`` paths itself: ``fn.io.file.read`` and its bundled AWS SDK."""
    if not available("nvidia.dali"):
        return False
    from nvidia.dali import fn

    dali_dir = Path(_dali().__file__).parent
    has_sdk = any(dali_dir.glob("**/libaws-cpp-sdk-s3*.so*"))
    return has_sdk and hasattr(fn, "io") and hasattr(fn.io, "file") and hasattr(fn.io.file, "read")


# AWS_ENDPOINT_URL when this process first built a pipeline with DALI's S3 reader: DALI makes its S3 client
# once per process, with the endpoint of that moment, and keeps it
_dali_endpoint: list[str | None] = []


def dali_should_read(source: LocalFiles | ObjectFiles, storage: StoreOptions) -> bool:
    """Whether DALI's own S3 reader fetches ``source``'s objects: only when asked (``reader="dali"``).

    "auto" is the client, which feeds the same pipeline: DALI 2.4's reader sends a HEAD and a GET per
    object, fetches at most ``num_threads`` at once, cannot fill a cache and takes its endpoint from
    ``AWS_ENDPOINT_URL`` once per process (see the README). Asked for where it cannot work, it is an error.
    """
    if not isinstance(source, ObjectFiles) or storage.reader != "dali":
        return False
    why_not = []
    if source.store.url.scheme != "s3":
        why_not.append(f"it reads s3:// only, not {source.store.url.scheme}://")
    if source.cache is not None:
        why_not.append("it cannot fill cache_dir")
    if storage.endpoint_url and storage.endpoint_url != os.environ.get("AWS_ENDPOINT_URL"):
        why_not.append("it takes the endpoint from AWS_ENDPOINT_URL only; set that instead of endpoint_url=")
    if _dali_endpoint and _dali_endpoint[0] != os.environ.get("AWS_ENDPOINT_URL"):
        why_not.append(
            redact_url(
                f"it already talks to {_dali_endpoint[0] or 'AWS'} in this process (DALI reads AWS_ENDPOINT_URL "
                f"once), and AWS_ENDPOINT_URL is now {os.environ.get('AWS_ENDPOINT_URL') or 'unset'}"
            )
        )
    if storage.anonymous:
        why_not.append("it cannot send anonymous requests")
    if not dali_reads_s3():
        why_not.append("the installed DALI has no S3 support (fn.io.file.read with its AWS SDK)")
    if why_not:
        raise ValueError("StoreOptions(reader='dali') cannot be used here: DALI's S3 reader " + "; ".join(why_not))
    return True


def _encoded_names(names: Sequence[str]) -> list[np.ndarray]:
    """Paths/URLs as the uint8 arrays ``fn.io.file.read`` takes."""
    return [np.frombuffer(name.encode(), dtype=np.uint8) for name in names]


def _pipeline_seed(seed: int, epoch: int, rank: int, first_batch: int) -> int:
    mix = np.random.SeedSequence([seed & 0xFFFFFFFF, epoch & 0xFFFFFFFF, rank, first_batch, 0xDA11])
    return int(mix.generate_state(1)[0] & 0x7FFFFFFF)


class DaliImageBackend:
    """Runs the planned batches through a DALI pipeline built for each pass over the plan."""

    name = "dali"

    def __init__(
        self,
        source: LocalFiles | ObjectFiles,
        labels: Sequence[int],
        *,
        batch_size: int,
        size: int,
        train: bool,
        seed: int,
        rank: int,
        num_threads: int,
        device: torch.device,
        mean: Sequence[float],
        std: Sequence[float],
        skip_corrupt: bool,
        prefetch_queue_depth: int = 2,
        dali_reads: bool = False,
        read_retries: int = 0,
    ):
        _dali()
        self.source, self.labels = source, np.asarray(labels, dtype=np.int64)
        self.dali_reads = dali_reads  # DALI's own S3 reader fetches the objects (fn.io.file.read on URLs)
        self.read_retries = read_retries  # passes restarted after DALI's reader fails on readable objects
        self.batch_size, self.size, self.train, self.seed, self.rank = batch_size, size, train, seed, rank
        self.num_threads, self.device, self.mean, self.std = num_threads, device, tuple(mean), tuple(std)
        self.skip_corrupt, self.prefetch_queue_depth = skip_corrupt, prefetch_queue_depth
        self.corrupt: set[int] = set()  # sample indices found undecodable, excluded from later batches
        # GPU decoding (nvJPEG) on the rank's GPU; CPU threads only when the loader outputs to CPU
        self.device_id = None if device.type != "cuda" else (device.index or 0)
        self._ahead = None  # (epoch, kept batches, started pipeline) for the pass expected next

    def _build(self, batches: list[np.ndarray], seed: int):
        from nvidia.dali import fn, pipeline_def, types

        if self.dali_reads:
            if not _dali_endpoint:
                _dali_endpoint.append(os.environ.get("AWS_ENDPOINT_URL"))
            chunks = iter([_encoded_names([self.source.names[i] for i in indices]) for indices in batches])
        else:
            chunks = self.source.batches([indices.tolist() for indices in batches])  # objects: fetched ahead

        def next_batch() -> list[np.ndarray]:
            return next(chunks)  # StopIteration ends DALI's prefetching, which runs ahead

        @pipeline_def
        def graph():
            encoded = fn.external_source(source=next_batch, batch=True, dtype=types.UINT8, ndim=1, no_copy=True)
            if self.dali_reads:
                encoded = fn.io.file.read(encoded, dont_use_mmap=True)  # DALI's S3 client: HEAD + GET per object
            decoder_device = "cpu" if self.device_id is None else "mixed"
            return augment(
                encoded, train=self.train, size=self.size, decoder_device=decoder_device, mean=self.mean, std=self.std
            )

        pipe = graph(
            batch_size=self.batch_size,
            num_threads=self.num_threads,
            device_id=self.device_id,
            seed=seed,
            prefetch_queue_depth=self.prefetch_queue_depth,
            exec_dynamic=True,  # outputs own their memory: handed to torch without a copy
        )
        pipe.build()
        return pipe

    def _to_torch(self, dali_batch) -> torch.Tensor:
        # Zero-copy: with the dynamic executor each output owns its buffer until the last reference to
        # it (this tensor) dies, so DALI never overwrites a batch the caller still holds. torch passes
        # its current stream, and DALI makes it wait for the GPU work that produced the batch.
        return torch.from_dlpack(dali_batch.as_tensor())

    def iterate(
        self,
        epoch: int,
        batches: list[tuple[np.ndarray, np.ndarray]],
        on_corrupt: Callable[[list[str]], None],
        next_pass: Callable[[], tuple[int, list[tuple[np.ndarray, np.ndarray]]]] | None = None,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield (images, labels) for ``batches`` in order; corrupt files go to ``on_corrupt(paths)``.

        ``next_pass() -> (epoch, batches)``: the pass expected after this one, if it runs to the end. Its
        pipeline is built and starts prefetching once this pass has its last batch, so the next epoch's
        first batches decode while the caller is busy between epochs (the bare pipeline's reader does the
        same by running on into the next epoch). It is the pipeline a fresh start of that pass would
        build, with the same seed, so the batches are identical; a pass that asks for anything else drops it.
        """
        done, read_failures = 0, 0
        while done < len(batches):
            try:
                yield from self._run(epoch, batches, done, next_pass)
                return
            except _DecodeFailure as failure:
                done = failure.batch
                bad = self._find_corrupt(batches[done:])
                if not bad and self.dali_reads and read_failures < self.read_retries:
                    read_failures += 1  # every object reads and decodes: DALI's S3 reader failed to fetch; go on
                    continue
                if not bad:  # DALI failed on files PIL reads: do not retry forever, report the whole batch
                    raise self._unlocated_error(set(batches[done][0].tolist()), failure.cause) from failure.cause
                if not self.skip_corrupt:
                    raise self._corrupt_error(bad, failure.cause) from failure.cause
                self.corrupt.update(bad)
                on_corrupt([self.source.names[i] for i in sorted(bad)])

    def _kept(self, batches: list[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
        """The planned sample indices without the files already found corrupt."""
        if not self.corrupt:
            return [indices for indices, _ in batches]
        corrupt = list(self.corrupt)
        return [indices[~np.isin(indices, corrupt)] for indices, _ in batches]

    def _start(self, epoch: int, kept: list[np.ndarray], start: int):
        """A pipeline for batches ``start:`` of ``kept`` that has been asked for its first batch."""
        pending = [kept[k] for k in range(start, len(kept)) if len(kept[k])]
        pipe = self._build(pending, _pipeline_seed(self.seed, epoch, self.rank, start))
        if pending:
            pipe.schedule_run()  # prefetch: the first prefetch_queue_depth batches start decoding now
        return pipe

    def _take_ahead(self, epoch: int, kept: list[np.ndarray], start: int):
        """The pipeline started ahead for this very pass, if there is one; any other is dropped."""
        ahead, self._ahead = self._ahead, None
        if ahead is None or start != 0:
            return None
        ahead_epoch, ahead_kept, pipe = ahead
        same = ahead_epoch == epoch and len(ahead_kept) == len(kept)
        if same and all(np.array_equal(a, b) for a, b in zip(ahead_kept, kept, strict=True)):
            return pipe
        return None

    def _start_ahead(self, next_pass) -> None:
        try:
            epoch, batches = next_pass()
            kept = self._kept(batches)
            self._ahead = (epoch, kept, self._start(epoch, kept, 0))
        except Exception:  # only a head start: the pass itself builds again and reports any error
            self._ahead = None

    def _run(self, epoch: int, batches: list[tuple[np.ndarray, np.ndarray]], start: int, next_pass=None):
        kept = self._kept(batches)
        pipe = self._take_ahead(epoch, kept, start)
        if pipe is None:
            pipe = self._start(epoch, kept, start)
        first = True  # the first batch was scheduled when the pipeline started
        try:
            for k in range(start, len(batches)):
                labels = torch.from_numpy(self.labels[kept[k]]).to(self.device, non_blocking=True)
                if not len(kept[k]):  # every file of this batch was corrupt: keep the batch count equal
                    images = torch.empty((0, 3, self.size, self.size), device=self.device)
                else:
                    try:
                        if not first:
                            pipe.schedule_run()
                        first = False
                        (dali_images,) = pipe.outputs()
                    except ObjectStoreError:
                        raise  # the client gave up on an object (its message names it): not a decoding problem
                    except Exception as exc:  # DALI raises RuntimeError for undecodable data
                        raise _DecodeFailure(k, exc) from exc
                    images = self._to_torch(dali_images)
                if k == len(batches) - 1 and next_pass is not None:
                    self._start_ahead(next_pass)
                yield images, labels
        finally:
            del pipe

    def _find_corrupt(self, batches: list[tuple[np.ndarray, np.ndarray]]) -> set[int]:
        """The undecodable samples among the failed batch and those DALI had prefetched after it."""
        bad = set()
        for indices, _ in batches[: self.prefetch_queue_depth + 1]:
            candidates = [i for i in indices.tolist() if i not in self.corrupt]
            # objects: read again through the client (retrying); one that cannot be read raises here, by name
            for index, data in zip(candidates, self.source.read(candidates), strict=True):
                try:
                    decode_rgb(data, self.source.names[index])
                except CorruptImageError:
                    bad.add(index)
        return bad

    def _corrupt_error(self, indices: set[int], cause: BaseException) -> CorruptImageError:
        paths = ", ".join(self.source.names[i] for i in sorted(indices))
        return CorruptImageError(
            f"cannot decode image(s) {paths} (DALI: {str(cause).splitlines()[0]}). Remove or replace them, "
            "or pass on_corrupt='skip' to skip undecodable images"
        )

    def _unlocated_error(self, indices: set[int], cause: BaseException) -> Exception:
        paths = ", ".join(self.source.names[i] for i in sorted(indices))
        if self.dali_reads:
            return ObjectReadError(
                f"DALI's S3 reader failed {self.read_retries + 1} times on a batch of these objects, which the "
                f"client reads and decodes: {paths}: {cause}. Pass StoreOptions(reader='client') to fetch with the client"
            )
        return CorruptImageError(f"DALI failed on a batch of these files: {paths}: {cause}")

    def describe(self) -> str:
        device = f"mixed, GPU {self.device_id}" if self.device_id is not None else "cpu"
        reads = "DALI's S3 reader" if self.dali_reads else self.source.describe()
        return f"dali ({device}, {reads})"


class _DecodeFailure(Exception):
    """DALI failed while producing planned batch ``batch`` (0-based within the epoch)."""

    def __init__(self, batch: int, cause: BaseException):
        super().__init__(str(cause))
        self.batch, self.cause = batch, cause
