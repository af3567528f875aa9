"""ZeRO's communication per bucket: reduce-scatter the gradients (in backward, in place of DDP's
all-reduce) and all-gather the updated parameter shards (after the step, waited for before use).

Two exchanges, one contract (this rank's shard of ``comm_flat`` ends up holding the sum over ranks, and
each rank's ``param_flat`` slice reaches every rank):

- ``"collective"``: torch's ``reduce_scatter`` / ``all_gather`` in place on the flat buffers -- one call
  per bucket; what NCCL runs best.
- ``"p2p"``: point-to-point sends of each peer's slice, and this rank's own additions of what it
  received, in gloo's ring order (fastpar/comm/gloo_order.py) -- so the sums have the bits of torch DDP's all-reduce.
  gloo's own reduce-scatter is several times slower than its all-reduce (measured: 155 vs 33 ms for 24 MB
  at 2 ranks); the exchange moves the same bytes as half an all-reduce. The peers' slices land in a
  scratch buffer of ``(p - 1) / p`` of the bucket, made at its launch and freed once the slices are summed
  (buckets are in flight together; at stage 2 lent with the bucket's buffer by the pool instead,
  sharded_gradients.py) -- so between steps no rank holds it.
  On CPU the messages are posted by a background thread (fastpar/comm/p2p_posting.py says why).

``"auto"``: p2p on gloo and on fastpar's shared-memory backend (whose all-reduce sums in gloo's ring order, so
the same model gives the same bits; its reduce-scatter sums in another order), collectives otherwise (NCCL).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from ..comm.gloo_order import reduce_in_ring_order
from ..comm.p2p_posting import PostingThread, post_inline
from ..ddp.errors import StuckBucketDiagnoser, pg_timeout_seconds
from ..ddp.waiting import BucketWaiter
from .layout import ShardedBucket, build_sharded_buckets, reference_positions

__all__ = ["EXCHANGES", "ZeroCollective", "resolve_exchange"]

EXCHANGES = ("auto", "collective", "p2p")
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def resolve_exchange(exchange: str, group: dist.ProcessGroup) -> str:
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    if exchange != "auto":
        return exchange
    return "p2p" if dist.get_backend(group) in ("gloo", "fastpar") else "collective"


class ZeroCollective:
    """ZeRO's :class:`~fastpar.ddp.bucket_collective.BucketCollective` (installed in the reducer by the optimizer),
    and the all-gather after each step."""

    description = "a ShardedOptimizer (its optimizer is sharded: ZeRO reduce-scatters the gradients)"
    operation = "reduce-scatter of gradient bucket"

    def __init__(self, reducer, group_of_slot: Mapping[int, int], exchange: str, tag_base: int, instance: int) -> None:
        """``group_of_slot``: slot index -> the optimizer's param group (a bucket holds one group's parameters).
        ``tag_base``: this optimizer's point-to-point tags are ``tag_base + 2 * bucket index (+ 1: gather)``,
        apart from other optimizers' and user sends (tag 0). ``instance``: the same number on every rank."""
        self.reducer = reducer
        self.group = reducer.group
        self.rank, self.world_size = self.group.rank(), self.group.size()
        self.group_of_slot = group_of_slot
        self.sharded: list[ShardedBucket] = []  # built at installation (build_buckets)
        self.exchange = resolve_exchange(exchange, self.group)
        self.peers = [q for q in range(self.world_size) if q != self.rank]
        self.tag_base = tag_base
        self.diagnosis_key = f"zero{instance}/rs"
        timeout = pg_timeout_seconds(self.group, reducer.device)
        params = StuckBucketDiagnoser(
            self.group, f"zero{instance}/ag", "all-gather of the updated parameters of bucket"
        )
        grads = StuckBucketDiagnoser(self.group, f"zero{instance}/gg", "all-gather of the reduced gradients of bucket")
        self.gather_waiter = BucketWaiter(reducer.device, timeout, params.diagnose)
        self._grad_gather_waiter = BucketWaiter(reducer.device, timeout, grads.diagnose)
        self.with_grad: set[int] = set()  # slot indices some rank used since zero_grad: they have a gradient
        self.holding = False  # the shards hold reduced gradients that .grad would hold in DDP (until zero_grad)
        self._poster = PostingThread() if reducer.device.type == "cpu" else None
        if self._poster is not None:
            weakref.finalize(self, self._poster.close)  # the thread ends with the model

    # ---- the reducer's interface (BucketCollective) --------------------------------------------
    def build_buckets(self, layout: Sequence[Sequence[int]]) -> list:
        """The padded buckets of ``layout`` split by param group, the parameters moved into their flat buffers."""
        reducer = self.reducer
        self.sharded = build_sharded_buckets(
            reducer.slots, layout, self.group_of_slot, reducer.grad_dtype, self.rank, self.world_size
        )
        return [zb.bucket for zb in self.sharded]

    def start(self, bucket) -> object:
        """Reduce-scatter one bucket's ``comm_flat`` (staged and scaled by the reducer, as for DDP)."""
        return self._reduce_scatter(self.sharded[bucket.index])

    def _reduce_scatter(self, zb: ShardedBucket) -> object:
        bucket = zb.bucket
        comm = bucket.acquire_comm_flat()  # lent when the first gradient was staged; a bucket with none staged now
        if zb.padding:  # zeros, also after a step scaled the shard by a non-finite factor (clipping an overflow)
            comm.narrow(0, bucket.numel - zb.padding, zb.padding).zero_()
        if self.exchange == "collective":
            return _reduce_scatter(zb.region(comm, self.rank), comm, group=self.group, async_op=True)
        if zb.scratch is None:
            zb.scratch = torch.empty((self.world_size - 1) * zb.shard_numel, dtype=comm.dtype, device=comm.device)
        tag = self.tag_base + 2 * bucket.index
        return self._post([(self._received(zb, q), zb.region(comm, q), q) for q in self.peers], tag)

    @torch.no_grad()
    def finish(self, bucket, result, globally_unused) -> None:
        """The reduced shard becomes the gradient of this rank's shard parameter; the parameters' ``.grad``
        are cleared (the full reduced gradient exists only as shards). A parameter no rank used keeps the
        gradient it had (none, or what earlier backwards left: torch leaves its ``.grad`` alone)."""
        zb = self.sharded[bucket.index]
        comm = bucket.comm_flat
        self._sum_received(zb, comm)
        zb.scratch = None  # summed: not kept to the next backward
        if comm is not bucket.grad_flat:  # reduced in bf16/fp16: widen into the fp32 gradient shard, exactly
            zb.grad_shard.copy_(zb.region(comm, self.rank))
        for slot in bucket.slots:
            if slot.index not in globally_unused:
                self.with_grad.add(slot.index)
            elif slot.saved is not None:  # its earlier gradient, saved by the reducer before staging
                a, b = max(slot.offset, zb.start), min(slot.offset + slot.numel, zb.end)
                if a < b:
                    bucket.grad_flat.narrow(0, a, b - a).copy_(slot.saved.narrow(0, a - slot.offset, b - a))
        zb.shard_param.grad = zb.grad_shard
        zb.unused = [slot.index for slot in bucket.slots if slot.index not in self.with_grad]  # clipping skips them
        for slot in bucket.slots:
            slot.param.grad = None
        self.holding = True

    @torch.no_grad()
    def before_accumulate(self) -> None:
        """Another backward before ``zero_grad``: every rank's reduced shards are gathered back into the gradient
        buckets and ``.grad`` points at them again, so this backward adds onto the reduced gradient -- as autograd
        does onto DDP's ``.grad`` -- before its sum is scaled and reduce-scattered (torch DDP's arithmetic)."""
        if not self.holding:
            return
        self.holding = False
        self.wait_all()  # the parameters' gathers use the same tags
        for zb in self.sharded:
            self._gather(zb, zb.bucket.grad_flat)
        for zb in self.sharded:
            work, zb.gather = zb.gather, None
            self._grad_gather_waiter.wait(self.reducer.step, zb.index, zb.bucket.names, work)
            for slot in zb.slots:
                if slot.index not in self.with_grad:
                    continue
                grad = slot.param.grad
                if grad is not None and grad is not slot.grad_view:  # arrived before the others: add it
                    slot.grad_view.add_(grad)
                slot.param.grad = slot.grad_view

    def zero_grad(self, set_to_none: bool) -> None:
        """The optimizer's ``zero_grad``: the shards hold nothing to add onto; without ``.grad``, nothing was used."""
        self.holding = False
        if set_to_none:
            self.with_grad.clear()

    def follow_layout(self, assignment: Sequence[Sequence[int]]) -> None:
        reference = reference_positions(assignment, self.reducer.slots)
        for zb in self.sharded:
            zb.follow_reference(reference)

    # ---- after the step: the updated shards to every rank --------------------------------------
    def start_gather(self, zb: ShardedBucket) -> None:
        self._gather(zb, zb.param_flat)

    def _gather(self, zb: ShardedBucket, flat: torch.Tensor) -> None:
        """Every rank's shard of ``flat`` (one of the bucket's flat buffers) to every rank, as ``zb.gather``."""
        if self.exchange == "collective":
            zb.gather = _all_gather(flat, zb.region(flat, self.rank), group=self.group, async_op=True)
            return
        mine = zb.region(flat, self.rank)
        zb.gather = self._post([(zb.region(flat, q), mine, q) for q in self.peers], self.tag_base + 2 * zb.index + 1)

    def wait_gather(self, zb: ShardedBucket) -> None:
        work, zb.gather = zb.gather, None
        if work is not None:
            self.gather_waiter.wait(self.reducer.step, zb.index, zb.bucket.names, work)

    def wait_all(self) -> None:
        for zb in self.sharded:
            if zb.gather is not None:
                self.wait_gather(zb)

    def _post(self, exchanges: list[tuple[torch.Tensor, torch.Tensor, int]], tag: int):
        """Receive into the first tensor from, and send the second to, each peer."""
        ops = []
        for into, send, q in exchanges:
            ops.append((dist.irecv, (into,), {"group": self.group, "group_src": q, "tag": tag}))
            ops.append((dist.isend, (send,), {"group": self.group, "group_dst": q, "tag": tag}))
        return self._poster.submit(ops) if self._poster is not None else post_inline(ops)

    def _sum_received(self, zb: ShardedBucket, comm: torch.Tensor, offset: int = 0) -> None:
        """The point-to-point exchange's additions (its messages have arrived); nothing for torch's reduce-scatter.
        ``comm`` holds the bucket's elements from ``offset`` on (this rank's shard at least)."""
        if self.exchange != "p2p":
            return
        for run in zb.sum_ranges:
            n = run.end - run.start

            def received(k: int, first=run.start - zb.start, n=n) -> torch.Tensor:
                return self._received(zb, k).narrow(0, first, n)

            reduce_in_ring_order(comm.narrow(0, run.start - offset, n), received, run.chain, self.rank)

    def _received(self, zb: ShardedBucket, q: int) -> torch.Tensor:
        slot = q if q < self.rank else q - 1
        return zb.scratch.narrow(0, slot * zb.shard_numel, zb.shard_numel)
