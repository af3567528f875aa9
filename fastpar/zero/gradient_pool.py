"""ZeRO-2's full-size bucket buffers: a small pool lent to the buckets in flight, not one per bucket.

At stage 2 a bucket needs full-size memory only between staging its gradients (the reducer copies autograd's
``.grad`` into ``comm_flat``, scaled) and the end of its reduce-scatter, after which this rank keeps its
1/N shard. A :class:`BufferPool` holds at most ``capacity`` buffers per dtype of ``staging_numel`` elements
(plus, for the point-to-point exchange, the scratch the peers' slices land in: ``(N - 1) / N`` of it),
allocated on first use and recycled every backward. Recycling, not freeing, because large CPU allocations are
returned to the OS and faulted in again page by page (and on GPUs the caching allocator would keep them anyway).

The staging does not depend on where parameter boundaries fall or on the order gradients arrive in:

- :func:`staging_numel` sizes a buffer so that the whole pool stays within ``min(2 x the bucket cap, half of
  G (N - 1) / N)`` (G: the gradient bytes), and ZeRO-2 splits its buckets to fit (:func:`split_to_fit`);
- a bucket larger than a buffer (one parameter larger than it) is reduced from its own gradient's memory
  when it can be (same dtype, storage order, no padding), else from a buffer made for it and freed as soon
  as its shard is copied out (:meth:`BufferPool.take_for`);
- a bucket is lent a buffer early (a gradient staged on arrival) only while one stays for the next bucket to
  launch (:meth:`BufferPool.can_lend_early`), so the pool never grows past ``capacity``.

Who may hold a buffer and when is the collective's business (sharded_gradients.py): it lends one to a bucket when
the reducer first stages a gradient into it and, when none is free, first completes the oldest bucket in flight.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..costmodel.zero_staging import MIN_STAGING_NUMEL, POOL_CAPACITY, split_to_fit, staging_numel
from ..tensor_storage import storage_bytes

if TYPE_CHECKING:  # layout.py splits buckets with this module's rule
    from .layout import ShardedBucket

__all__ = ["BufferPool", "PooledBuffer", "POOL_CAPACITY", "MIN_STAGING_NUMEL", "split_to_fit", "staging_numel"]


@dataclass(eq=False)
class PooledBuffer:
    """One lendable buffer: ``comm`` (a bucket's staged gradients, reduced in place) and ``scratch`` (the peers'
    slices in the point-to-point exchange; None for torch's reduce-scatter)."""

    comm: torch.Tensor
    scratch: torch.Tensor | None


class BufferPool:
    """Full-size buffers for ``sharded``'s buckets, at most ``capacity`` per comm dtype (the caller completes a
    bucket in flight when none is free), each of the largest bucket within ``limit`` elements; larger buckets get
    buffers of their own for the time they are in flight (:meth:`take_for`)."""

    def __init__(
        self,
        sharded: Sequence[ShardedBucket],
        world_size: int,
        with_scratch: bool,
        capacity: int = POOL_CAPACITY,
        limit: int | None = None,
    ) -> None:
        if capacity < 2:
            raise ValueError(f"a gradient pool needs at least 2 buffers (one filling, one in flight), got {capacity}")
        self.capacity = capacity
        self.world_size, self.with_scratch = world_size, with_scratch
        self.device = sharded[0].param_flat.device if sharded else torch.device("cpu")
        self.numel: dict[torch.dtype, int] = {zb.comm_dtype: 0 for zb in sharded}  # the largest that fits a buffer
        for zb in sharded:
            if limit is None or zb.bucket.numel <= limit:
                self.numel[zb.comm_dtype] = max(self.numel.get(zb.comm_dtype, 0), zb.bucket.numel)
        self.scratch_numel = {dtype: self._scratch(numel) for dtype, numel in self.numel.items()}
        self.free: dict[torch.dtype, list[PooledBuffer]] = {dtype: [] for dtype in self.numel}
        self.allocated: dict[torch.dtype, list[PooledBuffer]] = {dtype: [] for dtype in self.numel}
        self.own: list[PooledBuffer] = []  # buffers of buckets larger than the pool's, while in flight

    def _scratch(self, numel: int) -> int:
        return (self.world_size - 1) * (numel // self.world_size) if self.with_scratch else 0

    def fits(self, zb: ShardedBucket) -> bool:
        """Whether ``zb`` is staged in a pooled buffer (else in one of its own, :meth:`take_for`)."""
        return zb.bucket.numel <= self.numel.get(zb.comm_dtype, 0)

    def can_lend_early(self, dtype: torch.dtype, lent_ahead: int) -> bool:
        """Whether a bucket that will not launch next may take a buffer now, ``lent_ahead`` buckets that will not
        launch next holding one already: only while a buffer stays for the next bucket to launch."""
        return lent_ahead + 1 < self.capacity and (bool(self.free[dtype]) or len(self.allocated[dtype]) < self.capacity)

    def take_for(self, zb: ShardedBucket, own: torch.Tensor | None = None) -> PooledBuffer:
        """A buffer for a bucket larger than the pool's: ``own`` (its gradient's memory, already its storage
        order) or a new one. Its scratch is made at its launch, once autograd's gradient is dropped (the
        exchange's ``_reduce_scatter``), so the gradient, a copy of it and the scratch never coexist. Freed by
        :meth:`give_back`."""
        numel = zb.bucket.numel
        buffer = PooledBuffer(
            own if own is not None else torch.empty(numel, dtype=zb.comm_dtype, device=self.device), None
        )
        self.own.append(buffer)
        return buffer

    def take(self, dtype: torch.dtype, *, grow: bool = False) -> PooledBuffer | None:
        """A free buffer of ``dtype``; a new one while fewer than ``capacity`` exist (or ``grow``); else None."""
        if self.free[dtype]:
            return self.free[dtype].pop()
        if len(self.allocated[dtype]) >= self.capacity and not grow:
            return None
        scratch = self.scratch_numel[dtype]
        buffer = PooledBuffer(
            torch.empty(self.numel[dtype], dtype=dtype, device=self.device),
            torch.empty(scratch, dtype=dtype, device=self.device) if scratch else None,
        )
        self.allocated[dtype].append(buffer)
        return buffer

    def give_back(self, dtype: torch.dtype, buffer: PooledBuffer) -> None:
        if any(buffer is own for own in self.own):
            self.own = [own for own in self.own if own is not buffer]  # freed once the caller drops it
        else:
            self.free[dtype].append(buffer)

    def tensors(self) -> Iterable[torch.Tensor]:
        """Every buffer the pool allocated, and the own buffers in flight (for memory accounting)."""
        for buffers in [*self.allocated.values(), self.own]:
            for buffer in buffers:
                yield buffer.comm
                if buffer.scratch is not None:
                    yield buffer.scratch

    @property
    def nbytes(self) -> int:
        return storage_bytes(self.tensors())
