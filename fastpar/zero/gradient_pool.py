"""ZeRO-2's full-size bucket buffers: a small pool lent to the buckets in flight, not one per bucket.

At stage 2 a bucket needs full-size memory only between staging its gradients (the reducer copies autograd's
``.grad`` into ``comm_flat``, scaled) and the end of its reduce-scatter, after which this rank keeps its
1/N shard. A :class:`BufferPool` holds at most ``capacity`` buffers per dtype, each the size of that dtype's
largest bucket (plus, for the point-to-point exchange, the scratch the peers' slices land in: ``(N - 1) / N``
of it), allocated on first use and recycled every backward -- so a rank's gradient memory is
``model / N + capacity x largest bucket`` whatever the number of buckets. Recycling, not freeing, because
large CPU allocations are returned to the OS and faulted in again page by page (and on GPUs the caching
allocator would keep them anyway).

Who may hold a buffer and when is the collective's business (sharded_gradients.py): it lends one to a bucket when
the reducer first stages a gradient into it and, when none is free, first completes the oldest bucket in flight.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from .layout import ShardedBucket

__all__ = ["BufferPool", "PooledBuffer", "POOL_CAPACITY"]

# Buffers per dtype. One bucket is being filled by backward while the one launched before it is on the wire and
# the one before that is being summed: fewer would make backward wait for every bucket's exchange in turn.
POOL_CAPACITY = 3


@dataclass(eq=False)
class PooledBuffer:
    """One lendable buffer: ``comm`` (a bucket's staged gradients, reduced in place) and ``scratch`` (the peers'
    slices in the point-to-point exchange; None for torch's reduce-scatter)."""

    comm: torch.Tensor
    scratch: torch.Tensor | None


class BufferPool:
    """Full-size buffers for ``sharded``'s buckets, at most ``capacity`` per comm dtype while any bucket of that
    dtype is in flight to be completed first (:meth:`can_grow` says when the caller must complete one)."""

    def __init__(
        self, sharded: Sequence[ShardedBucket], world_size: int, with_scratch: bool, capacity: int = POOL_CAPACITY
    ) -> None:
        if capacity < 2:
            raise ValueError(f"a gradient pool needs at least 2 buffers (one filling, one in flight), got {capacity}")
        self.capacity = capacity
        self.device = sharded[0].param_flat.device if sharded else torch.device("cpu")
        self.numel: dict[torch.dtype, int] = {}  # per dtype: the largest bucket
        for zb in sharded:
            self.numel[zb.comm_dtype] = max(self.numel.get(zb.comm_dtype, 0), zb.bucket.numel)
        self.scratch_numel = {
            dtype: (world_size - 1) * (numel // world_size) if with_scratch else 0
            for dtype, numel in self.numel.items()
        }
        self.free: dict[torch.dtype, list[PooledBuffer]] = {dtype: [] for dtype in self.numel}
        self.allocated: dict[torch.dtype, list[PooledBuffer]] = {dtype: [] for dtype in self.numel}

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
        self.free[dtype].append(buffer)

    def tensors(self) -> Iterable[torch.Tensor]:
        """Every buffer the pool allocated (for memory accounting)."""
        for buffers in self.allocated.values():
            for buffer in buffers:
                yield buffer.comm
                if buffer.scratch is not None:
                    yield buffer.scratch

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())
