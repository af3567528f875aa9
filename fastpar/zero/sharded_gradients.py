"""ZeRO-2: ZeRO-1's exchanges, with each bucket's reduced gradient kept only as this rank's shard.

What lives where, per rank:

- ``zb.grad_shard`` (persistent, 1/N of the bucket): the reduced gradient this rank's optimizer steps.
- ``bucket.comm_flat`` (full size): lent by the pool (gradient_pool.py) when the reducer first stages a
  gradient into the bucket in a backward (a large gradient on arrival, the rest at the bucket's launch:
  layout.PooledBucket), until its reduce-scatter is complete and the shard copied out. When the pool has
  none free, the oldest bucket in flight is completed first (wait, sum, copy out) -- so at most the pool's
  capacity of buckets is staged or in flight, and backward waits only when the network falls that far
  behind (the pool grows only when every buffer is lent to a bucket still being filled).
- ``p.grad``: autograd writes a fresh gradient; the reducer copies it into ``comm_flat`` (times 1/N), and
  it is dropped (set to None) when its bucket launches, so the full-size gradients of launched buckets are
  gone before backward ends. After a synchronised backward every reduced parameter's ``.grad`` is None (as
  at stage 1). Under ``no_sync`` ``.grad`` accumulates locally, full size, as in DDP: gradients cannot be
  bucket views at stage 2 (that is a full-size buffer per bucket).

Another synchronised backward before ``zero_grad`` adds onto the reduced gradient, as autograd adds onto
DDP's ``.grad``: the shards are gathered back into temporary full-size buffers (one per bucket, the model's
gradient size in all) which ``.grad`` views while that backward runs; each is released when its bucket
launches. That is the memory DDP semantics need -- every rank adds its gradient to the whole reduced one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

import torch

from ..ddp.errors import StuckBucketDiagnoser, pg_timeout_seconds
from ..ddp.waiting import BucketWaiter
from .collectives import ZeroCollective
from .gradient_pool import BufferPool, staging_numel
from .layout import ShardedBucket, build_sharded_buckets

__all__ = ["ShardedGradientCollective"]

OWN_IN_FLIGHT = 2  # large parameters reduced at once: one on the wire while the next is staged


class ShardedGradientCollective(ZeroCollective):
    """ZeRO-2's :class:`~fastpar.ddp.bucket_collective.BucketCollective`: reduce-scatter from pooled buffers into
    persistent gradient shards."""

    description = "a ShardedOptimizer with shard_gradients=True (ZeRO-2: it reduce-scatters the gradients)"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pool: BufferPool | None = None
        self.in_flight: deque[ShardedBucket] = deque()  # launched, shard not yet copied out; in launch order
        self._works: dict[int, object] = {}  # bucket index -> the exchange's handle
        # dtype -> indices of buckets holding a pooled buffer, not yet launched (kept by _lend, start, _give_back)
        self._filling: dict[torch.dtype, set[int]] = {}
        timeout = pg_timeout_seconds(self.group, self.reducer.device)
        early = StuckBucketDiagnoser(self.group, self.diagnosis_key, self.operation)
        self._early_waiter = BucketWaiter(self.reducer.device, timeout, early.diagnose)
        self._accumulating = False  # .grad views temporary full-size buffers (another backward adds onto them)

    # ---- the reducer's interface (BucketCollective) --------------------------------------------
    def build_buckets(self, layout: Sequence[Sequence[int]]) -> list:
        reducer = self.reducer
        with_scratch = self.exchange == "p2p"
        itemsize = torch.empty((), dtype=reducer.grad_dtype or reducer.slots[0].param.dtype).element_size()
        limit = staging_numel(
            sum(slot.numel for slot in reducer.slots), itemsize, self.world_size, max(reducer.caps), with_scratch
        )
        self.sharded = build_sharded_buckets(
            reducer.slots, layout, self.group_of_slot, reducer.grad_dtype, self.rank, self.world_size, True, limit
        )
        self.pool = BufferPool(self.sharded, self.world_size, with_scratch, limit=limit)
        for zb in self.sharded:
            zb.bucket.lend = self._lend_to_bucket
            zb.bucket.early = self._may_lend_early
        return [zb.bucket for zb in self.sharded]

    def start(self, bucket) -> object:
        """Reduce-scatter the bucket's pooled ``comm_flat``; drop the gradients it was staged from."""
        zb = self.sharded[bucket.index]
        for slot in bucket.slots:
            slot.param.grad = None  # staged: the bucket's buffer holds it now
            slot.grad_view = None
        bucket.grad_flat = None  # the temporary buffer of an accumulating backward, now staged
        self._filling.get(zb.comm_dtype, set()).discard(zb.index)
        work = self._works[zb.index] = _WaitOnce(self._reduce_scatter(zb), self.reducer.device.type == "cpu")
        self.in_flight.append(zb)
        return work

    @torch.no_grad()
    def finish(self, bucket, result, globally_unused) -> None:
        """The shard is (or is now) in ``grad_shard``; it becomes the shard parameter's gradient. A parameter no rank
        used keeps the gradient it had (the reducer saved it in ``slot.saved`` before staging)."""
        zb = self.sharded[bucket.index]
        if zb.buffer is not None:
            self._complete(zb)
        for slot in bucket.slots:
            if slot.index not in globally_unused:
                self.with_grad.add(slot.index)
            elif slot.saved is not None:
                a, b = max(slot.offset, zb.start), min(slot.offset + slot.numel, zb.end)
                if a < b:
                    zb.grad_shard.narrow(0, a - zb.start, b - a).copy_(slot.saved.narrow(0, a - slot.offset, b - a))
        zb.shard_param.grad = zb.grad_shard
        zb.unused = [slot.index for slot in bucket.slots if slot.index not in self.with_grad]
        for slot in bucket.slots:
            slot.param.grad = None
        self.holding = True

    @torch.no_grad()
    def before_accumulate(self) -> None:
        """Before a backward adds onto reduced gradients: gather them back into temporary full-size buffers that
        ``.grad`` views. At the start of a synchronised backward: every buffer is back in the pool."""
        if self.holding:
            self.holding = False
            self._gather_reduced()
        if self.reducer.expect_hooks:  # a synchronised backward starts
            self._reclaim()

    def zero_grad(self, set_to_none: bool) -> None:
        super().zero_grad(set_to_none)
        self._drop_accumulation_buffers()

    # ---- lending and reclaiming the pool's buffers ----------------------------------------------
    def _lend_to_bucket(self, bucket) -> None:
        self._lend(self.sharded[bucket.index])

    def _may_lend_early(self, bucket) -> bool:
        """A gradient of ``bucket`` arrived before the bucket launches: stage it now only while a pooled buffer
        stays for the next bucket to launch (so arrival order never grows the pool); a bucket larger than the
        pool's buffers is staged at its launch, from its own gradient."""
        zb = self.sharded[bucket.index]
        if not self.pool.fits(zb):
            return False
        following = self.reducer.next_bucket
        filling = self._filling.get(zb.comm_dtype, ())
        ahead = len(filling) - (following in filling)
        return zb.index == following or self.pool.can_lend_early(zb.comm_dtype, ahead)

    def _lend(self, zb: ShardedBucket) -> None:
        if zb.buffer is not None:
            return
        if not self.pool.fits(zb):
            self._lend_own(zb)
            return
        buffer = self.pool.take(zb.comm_dtype)
        while buffer is None and self.in_flight:
            self._complete(self.in_flight[0])
            buffer = self.pool.take(zb.comm_dtype)
        if buffer is None:  # every buffer of this dtype is lent to a bucket still being filled
            buffer = self.pool.take(zb.comm_dtype, grow=True)
        zb.buffer = buffer
        self._filling.setdefault(zb.comm_dtype, set()).add(zb.index)
        comm = buffer.comm.narrow(0, 0, zb.bucket.numel)
        zb.bucket.comm_flat = comm
        for slot in zb.slots:
            slot.comm_view = slot.layout_view(comm)
        if buffer.scratch is not None:
            zb.scratch = buffer.scratch.narrow(0, 0, (self.world_size - 1) * zb.shard_numel)

    def _lend_own(self, zb: ShardedBucket) -> None:
        """A bucket larger than the pool's buffers (one large parameter): reduced in its gradient's own memory when
        that is exactly the bucket (the staging's scaling is then in place), else in a buffer made for it. At most
        ``OWN_IN_FLIGHT`` such buckets in flight: the oldest is completed first, so large parameters never add up."""
        while sum(not self.pool.fits(other) for other in self.in_flight) >= OWN_IN_FLIGHT:
            self._complete(self.in_flight[0])
        own = None
        if len(zb.slots) == 1 and zb.bucket.grad_flat is None:
            slot = zb.slots[0]
            grad = slot.param.grad
            # padded (the last rank's region runs past the parameter): the point-to-point exchange sends and sums
            # that region from a padded copy of it, 1/N of the parameter (``_reduce_scatter``)
            whole = slot.numel == zb.bucket.numel or self.exchange == "p2p"
            if grad is not None and grad.dtype == zb.comm_dtype and whole:
                flat = slot.grad_in_storage_order(grad)
                own = flat if flat is not None and flat.is_contiguous() else None
        zb.buffer = buffer = self.pool.take_for(zb, own)
        zb.bucket.comm_flat = buffer.comm
        for slot in zb.slots:
            slot.comm_view = slot.layout_view(buffer.comm)

    @torch.no_grad()
    def _reduce_scatter(self, zb: ShardedBucket) -> object:
        comm = zb.bucket.acquire_comm_flat()
        if comm.numel() == zb.bucket.numel:
            return super()._reduce_scatter(zb)
        # a padded large parameter in its own gradient's memory (``_lend_own``): the last region, padded with zeros
        start = (self.world_size - 1) * zb.shard_numel
        zb.tail = torch.zeros(zb.shard_numel, dtype=comm.dtype, device=comm.device)
        zb.tail.narrow(0, 0, comm.numel() - start).copy_(comm.narrow(0, start, comm.numel() - start))
        if zb.scratch is None:
            zb.scratch = torch.empty((self.world_size - 1) * zb.shard_numel, dtype=comm.dtype, device=comm.device)
        tag = self.tag_base + 2 * zb.bucket.index
        return self._post([(self._received(zb, q), self._region(zb, comm, q), q) for q in self.peers], tag)

    def _region(self, zb: ShardedBucket, comm: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s region of ``zb``'s staged gradients (its padded copy for the last rank, see above)."""
        if zb.tail is not None and rank == self.world_size - 1:
            return zb.tail
        return zb.region(comm, rank)

    @torch.no_grad()
    def _complete(self, zb: ShardedBucket) -> None:
        """Wait for ``zb``'s reduce-scatter, copy this rank's reduced shard out, give the buffer back."""
        work = self._works.pop(zb.index, None)
        if work is not None:
            self._early_waiter.wait(self.reducer.step + 1, zb.index, zb.bucket.names, work)
            comm = zb.bucket.comm_flat
            if zb.tail is not None and self.rank == self.world_size - 1:
                self._sum_received(zb, zb.tail, offset=zb.start)
            else:
                self._sum_received(zb, comm)
            zb.grad_shard.copy_(self._region(zb, comm, self.rank))  # widens a bf16 exchange exactly
        if zb in self.in_flight:
            self.in_flight.remove(zb)
        self._give_back(zb)

    def _give_back(self, zb: ShardedBucket) -> None:
        buffer, zb.buffer = zb.buffer, None
        self._filling.get(zb.comm_dtype, set()).discard(zb.index)
        if buffer is not None:
            self.pool.give_back(zb.comm_dtype, buffer)
        zb.bucket.comm_flat = zb.bucket.placeholder
        zb.scratch = zb.tail = None
        for slot in zb.slots:
            slot.comm_view = None

    def _reclaim(self) -> None:
        """Buffers still lent when a backward starts (an earlier backward ended in an error): wait for what was
        launched, then take everything back."""
        for zb in self.sharded:
            if zb.index in self._works:
                work = self._works.pop(zb.index)
                try:
                    work.wait()
                except Exception:  # the error that ended that backward was reported already
                    pass
            self._give_back(zb)
        self.in_flight.clear()

    # ---- accumulating onto reduced gradients ----------------------------------------------------
    def _gather_reduced(self) -> None:
        """Every rank's reduced shards into a temporary full-size buffer per bucket; ``.grad`` of each parameter
        that has a gradient views it (a gradient that arrived first is added: autograd's ``grad += new``)."""
        self.wait_all()  # the parameters' gathers use the same tags
        for zb in self.sharded:
            flat = torch.empty(zb.bucket.numel, dtype=zb.bucket.dtype, device=zb.param_flat.device)
            zb.region(flat, self.rank).copy_(zb.grad_shard)
            zb.bucket.grad_flat = flat
            self._gather(zb, flat)
        for zb in self.sharded:
            work, zb.gather = zb.gather, None
            self._grad_gather_waiter.wait(self.reducer.step, zb.index, zb.bucket.names, work)
            for slot in zb.slots:
                slot.grad_view = slot.layout_view(zb.bucket.grad_flat)
                if slot.index not in self.with_grad:
                    continue
                grad = slot.param.grad
                if grad is not None:  # arrived before the others: add it
                    slot.grad_view.add_(grad)
                slot.param.grad = slot.grad_view
        self._accumulating = True

    def _drop_accumulation_buffers(self) -> None:
        if not self._accumulating:
            return
        self._accumulating = False
        for zb in self.sharded:
            zb.bucket.grad_flat = None
            for slot in zb.slots:
                if slot.param.grad is slot.grad_view:
                    slot.param.grad = None
                slot.grad_view = None

    # ---- memory ---------------------------------------------------------------------------------
    def gradient_tensors(self) -> Iterable[torch.Tensor]:
        """Every tensor holding gradient memory of this rank: shards, pooled buffers, temporary accumulation
        buffers (the parameters' own ``.grad`` are counted by the caller)."""
        for zb in self.sharded:
            yield zb.grad_shard
            if zb.bucket.grad_flat is not None:
                yield zb.bucket.grad_flat
            for extra in (zb.scratch, zb.tail):  # a large parameter's, in flight (the pool's are views of its buffers)
                if extra is not None:
                    yield extra
        yield from self.pool.tensors()


class _WaitOnce:
    """A bucket's exchange, waited for by whoever comes first: the collective completing the bucket early to free
    its buffer, or the reducer at the end of backward. (A gloo point-to-point ``Work`` waited for a second time
    never returns.)"""

    def __init__(self, work, release: bool) -> None:
        self.work = work
        self.release = release  # drop the Work once waited for: it holds the buffer its messages were sent from
        self.done = False

    def wait(self, timeout=None) -> bool:
        if not self.done:
            self.work.wait() if timeout is None else self.work.wait(timeout)
            self.done = True
            if self.release:
                self.work = None
        return True

    def is_completed(self) -> bool:
        if self.work is None:
            return True
        return self.work.is_completed()  # not ``done``: on NCCL a wait only orders the stream, the deadline watch asks
