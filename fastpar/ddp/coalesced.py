"""In-place all-reduce of many tensors through a few flat buffers, pipelined.

Used by benchmarks and by code that reduces a list of tensors outside DDP (e.g. metrics, EMA weights).
Each bucket is packed with one ``fastpar.ops.pack`` call and its collective launched at once, so packing
bucket k+1 overlaps reducing bucket k; bucket k is unpacked the moment its collective is back -- polled
between packs (``pipeline.FinishQueue``), then in order -- while later buckets are still on the wire.
On GPUs every step is stream-ordered (pack and unpack on the current stream, the collective on NCCL's),
so the host never waits. On the "fastpar" backend's shared memory a bucket needs no flat buffer at all: the
backend stages every tensor and sums into it where it lies (one list collective per bucket; at two ranks one per
run of same-dtype buckets, as the order of a two-value sum changes no bit), so the pack and unpack passes
disappear; the sums are bit for bit those of the packed path.

:class:`CoalescedAllReduce` prepares the plan and the flat buffers once for a fixed list of tensors (as
DDP builds its buckets once): a call then does no per-tensor Python work. :func:`all_reduce_coalesced`
is the one-shot form; it remembers the plans of the last few tensor signatures and, on CPU, keeps the
flat buffers between calls (:class:`_BufferCache`: a fresh 16 MB buffer costs 4000 page faults).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .. import ops
from ..comm import all_reduce_lists, all_reduce_runs, reduces_lists
from .buckets import assign_buckets, default_caps
from .finish_queue import FinishQueue

__all__ = ["CoalescedAllReduce", "all_reduce_coalesced", "plan_coalesced_buckets"]

_Bucket = tuple[list[torch.Tensor], torch.Tensor]  # (members, flat buffer)


def plan_coalesced_buckets(
    tensors: Sequence[torch.Tensor], bucket_cap_mb: float | None = None, world_size: int = 2
) -> list[list[int]]:
    """Group tensor indices into buckets of one dtype and device, with DDP's rule (``buckets.assign_buckets``):
    ``bucket_cap_mb`` per bucket, or fastpar's default caps for ``world_size`` ranks when None."""
    if bucket_cap_mb is not None and bucket_cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
    caps = [int(bucket_cap_mb * 1024 * 1024)] if bucket_cap_mb is not None else default_caps(tensors, world_size)
    return assign_buckets(tensors, range(len(tensors)), caps)


def _check_dtypes(tensors: Sequence[torch.Tensor]) -> None:
    for i, t in enumerate(tensors):
        if t.dtype not in ops.SUPPORTED_DTYPES:
            raise TypeError(f"all_reduce_coalesced: tensors[{i}] has dtype {t.dtype}; use float32/float16/bfloat16")


def reduces_in_place(group: dist.ProcessGroup | None, tensors: Sequence[torch.Tensor], scale: float) -> bool:
    """Whether ``group`` reduces a list of ``tensors`` where they lie, with nothing to pack: the "fastpar" backend on
    shared memory, CPU tensors, no scaling (a scale would be one more pass over every tensor)."""
    return scale == 1.0 and bool(tensors) and tensors[0].device.type == "cpu" and reduces_lists(group)


# Two ranks: the in-place path ignores the buckets -- one list collective per run of one dtype. A sum of two values
# has the same bits in either order (IEEE addition commutes), so the bucket boundaries, which only decide the
# summation order, change nothing, and one collective costs one start instead of one per bucket. At more ranks one
# collective per bucket keeps the packed path's summation order.


def _reduce_buckets(buckets: Sequence[_Bucket], group: dist.ProcessGroup | None, scale: float, works: list) -> None:
    """The pipelined path over prepared ``buckets``. ``works`` receives each launched collective (so a caller
    whose call failed half-way knows which buffers are still in flight)."""
    queue = FinishQueue()

    def unpack(k: int) -> None:
        works[k].wait()  # on NCCL: orders the current stream after the collective, no host sync
        members, flat = buckets[k]
        ops.unpack(flat, members, scale)

    for members, flat in buckets:
        ops.pack(members, flat)
        works.append(dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True))
        queue.poll(range(len(works)), len(works) - 1, works.__getitem__, unpack)  # the ones already back
    queue.drain(range(len(works)), unpack)


class CoalescedAllReduce:
    """A prepared in-place all-reduce (SUM, then times ``scale``) of a fixed list of tensors across ``group``.

    The bucket plan (DDP's rule, :func:`plan_coalesced_buckets`) and the flat buffers are made once; each
    call packs, reduces and unpacks through them, pipelined. Every rank must prepare tensors of the same
    shapes, dtypes (float32/float16/bfloat16; one dtype per bucket) and order. The tensors are held, not
    copied: each call reduces their current values."""

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        group: dist.ProcessGroup | None = None,
        *,
        bucket_cap_mb: float | None = None,
    ) -> None:
        tensors = list(tensors)
        _check_dtypes(tensors)
        self.group = group
        plan = plan_coalesced_buckets(tensors, bucket_cap_mb, dist.get_world_size(group)) if tensors else []
        self.lists = [[tensors[i] for i in indices] for indices in plan]
        self.in_place = reduces_in_place(group, tensors, 1.0)
        # see "Two ranks" above _reduce_buckets
        two = self.in_place and dist.get_world_size(group) == 2
        self._runs = [t for members in self.lists for t in members] if two else None
        self._flats: list[torch.Tensor] | None = None  # made on the first packed call

    @property
    def buckets(self) -> list[_Bucket]:
        """(members, flat buffer) of each bucket, for the packed path."""
        if self._flats is None:
            self._flats = [
                torch.empty(sum(t.numel() for t in members), dtype=members[0].dtype, device=members[0].device)
                for members in self.lists
            ]
        return list(zip(self.lists, self._flats, strict=True))

    def __call__(self, scale: float = 1.0) -> None:
        if self.in_place and scale == 1.0:
            if self._runs is not None:
                all_reduce_runs(self._runs, self.group)
            else:
                all_reduce_lists(self.lists, self.group)
            return
        _reduce_buckets(self.buckets, self.group, scale, [])


class _BufferCache:
    """Flat buffers kept between calls, keyed by (dtype, device, numel). A buffer is taken out while a
    call uses it, so concurrent calls (threads) never share one. Holds at most ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type != "cpu":  # the CUDA caching allocator already reuses memory, in stream order
            return torch.empty(numel, dtype=dtype, device=device)
        with self._lock:
            free = self._free.get((dtype, device, numel))
            if free:
                flat = free.pop()
                self._bytes -= flat.numel() * flat.element_size()
                return flat
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, flat: torch.Tensor) -> None:
        if flat.device.type != "cpu":
            return
        nbytes = flat.numel() * flat.element_size()
        with self._lock:
            if self._bytes + nbytes > self.max_bytes:
                self._free.clear()  # shapes changed: drop the old buffers rather than grow
                self._bytes = 0
            if nbytes <= self.max_bytes:
                self._free.setdefault((flat.dtype, flat.device, flat.numel()), []).append(flat)
                self._bytes += nbytes


class _PlanCache:
    """Bucket plans of the last ``size`` tensor signatures (every tensor's numel and dtype, the device, the
    cap, the world size): planning 4000 tensors costs more than packing them."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._plans: OrderedDict[tuple, list[list[int]]] = OrderedDict()
        self._lock = threading.Lock()

    def plan(self, tensors: list[torch.Tensor], bucket_cap_mb: float | None, world_size: int) -> list[list[int]]:
        key = (
            tuple(map(torch.Tensor.numel, tensors)),
            tuple(t.dtype for t in tensors),
            tensors[0].device,
            bucket_cap_mb,
            world_size,
        )
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
                return plan
        _check_dtypes(tensors)
        plan = plan_coalesced_buckets(tensors, bucket_cap_mb, world_size)
        with self._lock:
            self._plans[key] = plan
            while len(self._plans) > self.size:
                self._plans.popitem(last=False)
        return plan


_cache = _BufferCache(max_bytes=256 * 1024 * 1024)
_plans = _PlanCache(size=16)


def all_reduce_coalesced(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    *,
    bucket_cap_mb: float | None = None,
    scale: float = 1.0,
) -> None:
    """All-reduce (SUM) ``tensors`` in place across ``group``, then multiply by ``scale``
    (``scale=1/world_size`` averages). Tensors may have different shapes and dtypes
    (float32/float16/bfloat16); each bucket holds one dtype. Every rank must pass tensors of the
    same shapes, dtypes and order. ``bucket_cap_mb=None``: fastpar DDP's default caps. To reduce the
    same tensors many times, :class:`CoalescedAllReduce` prepares the buckets once.
    """
    tensors = list(tensors)
    if not tensors:
        return
    world_size = dist.get_world_size(group)
    if world_size == 2 and reduces_in_place(group, tensors, scale):  # no plan: see "Two ranks" above
        all_reduce_runs(tensors, group)  # checks the dtypes
        return
    plan = _plans.plan(tensors, bucket_cap_mb, world_size)
    if reduces_in_place(group, tensors, scale):
        all_reduce_lists([[tensors[i] for i in indices] for indices in plan], group)
        return
    buckets: list[_Bucket] = []
    works: list = []
    try:
        for indices in plan:
            members = [tensors[i] for i in indices]
            flat = _cache.take(sum(t.numel() for t in members), members[0].dtype, members[0].device)
            buckets.append((members, flat))
        _reduce_buckets(buckets, group, scale, works)
    finally:
        for k, (_, flat) in enumerate(buckets):
            if k >= len(works) or works[k].is_completed():  # a failed call leaves in-flight buffers to the collective
                _cache.give(flat)
