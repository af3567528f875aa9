"""Loaders for data already in Python: in-memory arrays, sized sequences and unsized streams.

Arrays and sequences follow the epoch plan (fastpar.data.sharding) exactly like the image loaders.
Unsized iterables are the external-source path for user streams:

- ``sharded=False`` (default): every rank iterates the *same* stream (same seed) and keeps its
  round-robin share: the stream is cut into global batches of ``batch_size * world_size`` items and
  rank r takes items r, r + world_size, ... of each. All ranks see the same global batches, so they
  agree on the batch count with no communication. The last, short global batch follows
  ``last_batch``: "drop" drops it; "pad" tops it up with its own items; "partial" splits it
  (dropped if it has fewer items than ranks, so no rank gets an empty batch).
- ``sharded=True``: each rank's iterable is already its own shard. Batches are ``batch_size`` items;
  when torch.distributed is initialised the ranks agree before every batch (one all_reduce of a
  flag, on a device the process group reduces on: the current GPU for NCCL) and stop together as
  soon as any rank runs out; the other ranks' leftovers are dropped.

Streams have no length and cannot skip without reading: ``load_state_dict`` resumes by reading and
discarding the items of the batches already done.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from .loader import PlannedLoader, resolve_device, resolve_rank
from .sharding import LAST_BATCH_POLICIES, ShardSpec


def _as_array(a: Any, what: str) -> torch.Tensor | np.ndarray:
    """Tensors stay tensors; CuPy arrays (any DLPack producer but numpy) become tensors sharing their memory, on
    their device; anything else becomes a numpy array, kept as is (views, memmaps, negative strides and byte orders
    included) and indexed one batch at a time, so nothing is copied up front."""
    if isinstance(a, torch.Tensor):
        return a
    if hasattr(a, "__dlpack__") and not isinstance(a, np.ndarray):
        return torch.from_dlpack(a)  # zero-copy; CuPy orders its stream with torch's current one
    array = np.asarray(a)
    try:  # a dtype torch cannot hold (object, strings) fails here, not in the middle of an epoch
        _take(array, np.zeros(min(1, len(array)), dtype=np.int64))
    except TypeError as exc:
        raise ValueError(
            f"{what} has dtype {array.dtype}, which torch tensors cannot hold ({exc}); convert it to numbers, "
            "or use fastpar.data.iterable_loader for Python objects"
        ) from None
    return array


def _take(data: torch.Tensor | np.ndarray, indices: np.ndarray) -> torch.Tensor:
    """Rows ``indices`` of ``data`` as a tensor on data's device."""
    if isinstance(data, torch.Tensor):
        return data.index_select(0, torch.from_numpy(indices).to(data.device))
    rows = data[indices]  # numpy fancy indexing: a fresh array, whatever the strides of data
    if not rows.dtype.isnative:  # big-endian data (some .npy/.mat files): torch only takes native order
        rows = rows.astype(rows.dtype.newbyteorder("="))
    return torch.from_numpy(rows)


class ArrayLoader(PlannedLoader):
    """Batches ``(x[idx], y[idx])`` (or ``x[idx]`` without y) of in-memory arrays for this rank."""

    def __init__(self, spec: ShardSpec, x: torch.Tensor | np.ndarray, y, device: torch.device):
        super().__init__(spec)
        self.x, self.y, self.device = x, y, device

    def _iterate(self, epoch: int, batches: list) -> Iterator[Any]:
        non_blocking = self.device.type == "cuda"
        for indices, _ in batches:
            xb = _take(self.x, indices).to(self.device, non_blocking=non_blocking)
            if self.y is None:
                yield xb
            else:
                yield xb, _take(self.y, indices).to(self.device, non_blocking=non_blocking)


def array_loader(
    x: Any,
    y: Any = None,
    batch_size: int = 32,
    *,
    shuffle: bool = True,
    rank: int | None = None,
    world_size: int | None = None,
    seed: int = 0,
    last_batch: str = "partial",
    device: str | torch.device | None = None,
) -> ArrayLoader:
    """A loader over numpy arrays, tensors or CuPy arrays (first dimension = samples), sharded like ``image_loader``.

    Yields ``(x_batch, y_batch)`` torch tensors (``x_batch`` alone when ``y`` is None) on ``device``
    (default: this rank's GPU if any, else CPU). No copies of the data are made up front: each batch
    is gathered from ``x``/``y`` when it is needed (numpy inputs with numpy indexing, so any strides,
    byte order or memmap work). A numpy ``uint16`` input gives ``torch.uint16`` batches, as
    ``torch.from_numpy`` does. CuPy arrays (and other DLPack producers) are shared with torch through DLPack,
    without a copy, and batches are gathered on their GPU.
    """
    x_t = _as_array(x, "x")
    y_t = None if y is None else _as_array(y, "y")
    if x_t.ndim == 0:
        raise ValueError("x must have a first (sample) dimension")
    if y_t is not None and (y_t.ndim == 0 or y_t.shape[0] != x_t.shape[0]):
        raise ValueError(f"x and y must have the same number of samples, got {x_t.shape[0]} and {tuple(y_t.shape)}")
    rank, world_size = resolve_rank(rank, world_size)
    spec = ShardSpec(x_t.shape[0], batch_size, rank, world_size, seed, shuffle, last_batch)
    return ArrayLoader(spec, x_t, y_t, resolve_device(device))


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=device.type == "cuda")
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


class SequenceLoader(PlannedLoader):
    """Batches of ``collate([seq[i] for i in batch])`` from a sized, indexable sequence."""

    def __init__(self, spec: ShardSpec, items: Sequence[Any], collate, device: torch.device):
        super().__init__(spec)
        self.items, self.collate, self.device = items, collate, device

    def _iterate(self, epoch: int, batches: list) -> Iterator[Any]:
        for indices, _ in batches:
            yield _to_device(self.collate([self.items[i] for i in indices.tolist()]), self.device)


def collective_device() -> torch.device:
    """Where a small tensor must live to be all-reduced on the default process group: CPU for gloo, this
    process's current GPU for an NCCL-only group (which rejects CPU tensors) -- torch's own rule for its
    object collectives."""
    from torch.distributed import distributed_c10d as c10d

    kind = c10d._get_object_coll_device()
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


class StreamLoader:
    """Batches from an unsized iterable, split across ranks as described in the module docstring."""

    def __init__(self, source, batch_size, rank, world_size, last_batch, sharded, collate, device):
        self.source, self.batch_size, self.rank, self.world_size = source, batch_size, rank, world_size
        self.last_batch, self.sharded, self.collate, self.device = last_batch, sharded, collate, device
        self.epoch, self.batch = 0, 0
        self._resume = False  # set by load_state_dict: the next pass skips the batches already done

    def set_epoch(self, epoch: int) -> None:
        """Start the next pass at ``epoch``; a callable source is called with it to make the stream."""
        self.epoch, self.batch, self._resume = int(epoch), 0, False

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batch": self.batch, "world_size": self.world_size, "sharded": self.sharded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("world_size", self.world_size) != self.world_size:
            raise ValueError(f"saved with world_size={state['world_size']}, now {self.world_size}: cannot resume")
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])
        self._resume = self.batch > 0

    def _stream(self) -> Iterator[Any]:
        return iter(self.source(self.epoch) if callable(self.source) else self.source)

    def __iter__(self) -> Iterator[Any]:
        epoch, skip = self.epoch, self.batch if self._resume else 0
        self.batch, self._resume = skip, False
        batches = self._sharded_batches() if self.sharded else self._round_robin_batches()
        for k, items in enumerate(batches):
            if k < skip:
                continue  # resume: streams cannot seek, so read and discard
            self.batch = k + 1
            yield _to_device(self.collate(items), self.device)
        if self.epoch == epoch:
            self.epoch, self.batch = epoch + 1, 0

    def _round_robin_batches(self) -> Iterator[list[Any]]:
        per_step = self.batch_size * self.world_size
        stream = self._stream()
        while True:
            group = list(itertools.islice(stream, per_step))
            if len(group) == per_step:
                yield group[self.rank :: self.world_size]
                continue
            if group and self.last_batch == "pad":
                group = [group[i % len(group)] for i in range(per_step)]
                yield group[self.rank :: self.world_size]
            elif len(group) >= self.world_size and self.last_batch == "partial":
                yield group[self.rank :: self.world_size]
            return

    def _sharded_batches(self) -> Iterator[list[Any]]:
        dist = torch.distributed
        agree = dist.is_available() and dist.is_initialized() and self.world_size > 1
        flag_device = collective_device() if agree else None
        stream = self._stream()
        while True:
            items = list(itertools.islice(stream, self.batch_size))
            full = len(items) == self.batch_size or (bool(items) and self.last_batch == "partial")
            if agree:  # one tiny collective per batch: every rank stops when the first one runs dry
                flag = torch.tensor([1 if full else 0], dtype=torch.int32, device=flag_device)
                dist.all_reduce(flag, op=dist.ReduceOp.MIN)
                full = bool(flag.item())  # CPU-GPU sync point on NCCL: once per batch
            if not full:
                return
            yield items


def iterable_loader(
    source: Iterable[Any] | Sequence[Any],
    batch_size: int,
    *,
    shuffle: bool = False,
    rank: int | None = None,
    world_size: int | None = None,
    seed: int = 0,
    last_batch: str = "partial",
    sharded: bool = False,
    collate=default_collate,
    device: str | torch.device | None = None,
) -> SequenceLoader | StreamLoader:
    """Batches from user Python data: a sized sequence (``len`` and ``[i]``) is planned and sharded like
    arrays (``shuffle``, ``seed``, ``last_batch``, exact resume); any other iterable -- or a callable
    ``source(epoch) -> iterable`` -- is a stream split as the module docstring describes. Items are
    combined with ``collate`` (torch's default_collate) and moved to ``device``.
    """
    if last_batch not in LAST_BATCH_POLICIES:
        raise ValueError(f"last_batch must be one of {LAST_BATCH_POLICIES}, got {last_batch!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    rank, world_size = resolve_rank(rank, world_size)
    device = resolve_device(device)
    if isinstance(source, Sequence) or (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
        spec = ShardSpec(len(source), batch_size, rank, world_size, seed, shuffle, last_batch)
        return SequenceLoader(spec, source, collate, device)
    if shuffle:
        raise ValueError("shuffle=True needs a sized sequence; shuffle the stream itself (e.g. a callable source)")
    return StreamLoader(source, batch_size, rank, world_size, last_batch, sharded, collate, device)
