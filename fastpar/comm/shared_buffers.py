"""Flat buffers in shared memory that every rank of a "fastpar" group maps: where fastpar's DDP keeps its buckets.

An all-reduce of a tensor inside such a buffer (the same offset on every rank) stages nothing: rank q sums share q
of every rank's copy, in gloo's order, and writes the sums into every copy. Per rank that is one read and one write
of the bucket, where a bucket in private memory costs a copy into the segment's slots, a sum, and the reads of the
others' slots. The bits are those of any other all-reduce on the backend (gloo's).

Creation is collective -- every rank calls :func:`shared_flat` in the same order with the same sizes -- and
all-or-nothing: each rank creates its own file, the ranks agree (one all-reduce) that all did, map each other's,
agree again, and remove the names (nothing is left in /dev/shm, even after a crash). When any rank cannot (e.g.
/dev/shm full) every rank gets None and keeps its buckets in private memory.
``FASTPAR_SHM_BUCKETS=0`` turns it off.

Only an all-reduce issued inside :func:`bucket_collective` (DDP marks its bucket collectives so) takes the shared
protocol; any other tensor, even one inside a shared buffer (a user's own ``all_reduce(p.grad)``), is staged as
usual, so two ranks that disagree about such a tensor are not mismatched by protocol.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os

import torch

from ..ops import loader
from .backend import _shm_backend

_log = logging.getLogger(__name__)
_ALIGN = 64  # bytes: every carved buffer starts on its own cache line


def enabled() -> bool:
    return os.environ.get("FASTPAR_SHM_BUCKETS", "1").strip() not in ("0", "false", "no", "off")


def available(group) -> bool:
    """Whether :func:`shared_flat` can make buffers for ``group``: fastpar's backend on shared memory."""
    ext = loader.extension()
    return enabled() and ext is not None and hasattr(ext, "shm_shared_create") and _shm_backend(group) is not None


@contextlib.contextmanager
def bucket_collective():
    """On this thread, the all-reduces issued inside are DDP bucket collectives: a tensor in a shared buffer takes the
    shared protocol (every rank must issue the same one, at the same offset of its buffer)."""
    ext = loader.extension()
    mark = getattr(ext, "shm_mark_bucket_collective", None)
    if mark is None:
        yield
        return
    previous = mark(True)
    try:
        yield
    finally:
        mark(previous)


def _all_succeeded(ok: bool, group) -> bool:
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def shared_flat(numel: int, dtype: torch.dtype, group=None) -> torch.Tensor | None:
    """A zeroed flat CPU tensor of ``numel`` elements in a buffer every rank of ``group`` maps, or None (on every
    rank) when that is not possible. Collective."""
    if not available(group):
        return None
    ext, backend = loader.extension(), _shm_backend(group)
    nbytes = max(1, numel * dtype.itemsize)
    buffer_id, why = -1, ""
    try:
        buffer_id = ext.shm_shared_create(backend, nbytes)
    except RuntimeError as error:
        why = str(error)
    if not _all_succeeded(buffer_id >= 0, group):
        return _give_up(ext, backend, buffer_id, why or "another rank could not create its buffer")
    try:
        ext.shm_shared_map_peers(backend, buffer_id)
    except RuntimeError as error:
        why = str(error)
    mapped = _all_succeeded(not why, group)  # past this, every rank has mapped every file it could
    ext.shm_shared_unlink(backend, buffer_id)
    if not mapped:
        return _give_up(ext, backend, buffer_id, why or "another rank could not map the buffers")
    return ext.shm_shared_tensor(backend, buffer_id, dtype, numel)  # fresh shared pages read as zeros


def _give_up(ext, backend, buffer_id: int, why: str) -> None:
    if buffer_id >= 0:
        ext.shm_shared_release(backend, buffer_id)
    _log.warning("fastpar: DDP buckets stay in private memory (all-reduces are staged): %s", why)
    return None


def carve(sizes: list[tuple[int, torch.dtype]], group=None) -> list[torch.Tensor] | None:
    """Flat tensors of the given (numel, dtype)s, all in one shared buffer (one collective creation), each on its
    own cache line; None when :func:`shared_flat` gives none."""
    offsets, end = [], 0
    for numel, dtype in sizes:
        offsets.append(end)
        end += -(-numel * dtype.itemsize // _ALIGN) * _ALIGN
    raw = shared_flat(end, torch.uint8, group) if sizes else None
    if raw is None:
        return None
    return [
        raw.narrow(0, offset, numel * dtype.itemsize).view(dtype)
        for offset, (numel, dtype) in zip(offsets, sizes, strict=True)
    ]


def bucket_allocator(group, device: torch.device):
    """How DDP's buckets on ``device`` get their communication buffers: :func:`carve` for ``group`` when its ranks
    can share memory (their all-reduce then stages nothing), else None (private memory). Calling it is collective."""
    if device.type != "cpu" or not available(group):
        return None
    return functools.partial(carve, group=group)
