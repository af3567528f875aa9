"""FSDP2's collectives on gloo as point-to-point exchanges: faster there, and the same bits.

gloo's ``reduce_scatter_tensor`` is slower than its ring all-reduce of the same tensor, an all-reduce moves
twice the bytes a reduce-scatter needs, and its ``all_gather_into_tensor`` is slower than one send and one
receive per peer (``fastpar bench shard`` times the step either way; ``scripts/fsdp_step_time.py`` has a
``stock_collectives`` variant). FSDP2 lets a module replace the
collectives it reduce-scatters gradients and all-gathers parameters with (``FSDPModule.set_custom_reduce_scatter``,
``set_custom_all_gather``); fastpar installs these on every unit when the group's backend is gloo. The fastpar
backend and NCCL keep their own collectives, the faster ones there.

- :class:`PointToPointReduceScatter`: rank r sends chunk k of its input to rank k and adds up the chunks r it
  receives **in gloo's ring all-reduce order** (:mod:`fastpar.comm.gloo_order`, checked against the installed
  gloo by ``tests/zero/test_zero_gloo_order.py``), so the sums have the bits of ``all_reduce(input)`` and a
  slice (what torch DDP's all-reduce of the same buffer gives). ``AVG`` is gloo's sum divided by the world size
  afterwards; any other op falls back to the all-reduce and the slice. It holds a scratch of (N-1)/N of the
  input while it sums (freed on return). FSDP2 calls it synchronously, with the input as N equal chunks.
- :class:`PointToPointAllGather`: rank r sends its shard to every peer and receives theirs into their chunks
  of the output (copies, no arithmetic). Asynchronous when FSDP2 prefetches (``async_op=True``): then a
  background thread posts the messages (:mod:`fastpar.comm.p2p_posting` says why), so the training thread
  goes on computing.

Messages to the same peer are matched in the order they are posted: FSDP2 runs its collectives in the same
order on every rank, and each kind has its own tag.

The ``ReduceScatter``/``AllGather`` interfaces are documented on ``set_custom_reduce_scatter`` and
``set_custom_all_gather`` but torch 2.13 exports them only from the private ``_fsdp_api`` module; the import
below is the one place that names it.
"""

from __future__ import annotations

import atexit
import datetime

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from ..comm.gloo_order import reduce_in_ring_order, shard_sum_ranges
from ..comm.p2p_posting import PostingThread, WorkSet, post_inline

__all__ = ["ALL_GATHER_TAG", "REDUCE_SCATTER_TAG", "PointToPointAllGather", "PointToPointReduceScatter"]

# Tags of the exchanges' messages, apart from other point-to-point traffic of the group (ZeRO's start at 1 << 20).
REDUCE_SCATTER_TAG = 0x46535250  # "FSRP"
ALL_GATHER_TAG = 0x46534147  # "FSAG"

# One thread per process posts the asynchronous gathers, in the order FSDP2 asks for them (the same on every
# rank); it is joined at exit (a daemon thread woken during interpreter shutdown aborts the process).
_POSTING = PostingThread("fastpar-fsdp-post")
atexit.register(_POSTING.close)


class _Allocate:
    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class PointToPointReduceScatter(_Allocate, ReduceScatter):
    """``reduce_scatter_tensor(output, input)`` as one send and one receive per peer, summed in gloo's order."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        if async_op:  # FSDP2 does not ask for it; refuse rather than return before the sums are made
            raise NotImplementedError("PointToPointReduceScatter runs synchronously")
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        chunks = input_tensor.view(world, -1)
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) or not output_tensor.is_contiguous():
            dist.all_reduce(input_tensor, op=op, group=group)
            output_tensor.copy_(chunks[rank].view_as(output_tensor))
            return None
        own, out = chunks[rank], output_tensor.view(-1)
        scratch = torch.empty(world - 1, chunks.size(1), dtype=chunks.dtype, device=chunks.device)
        received = dict(zip(_peers(world, rank), scratch, strict=True))
        receives = [(received[k], k) for k in received]
        sends = [(chunks[k], k) for k in received]
        post_inline(_messages(receives, sends, group, REDUCE_SCATTER_TAG)).wait()
        if world == 2:  # one addition: its order can't change the bits
            torch.add(own, received[1 - rank], out=out)
        else:
            out.copy_(own)
            n = chunks.size(1)
            for run in shard_sum_ranges(
                [(0, world * n, 0, world * n)], (rank * n, (rank + 1) * n), world, own.element_size()
            ):
                a, b = run.start - rank * n, run.end - rank * n
                reduce_in_ring_order(out[a:b], lambda k, a=a, b=b: received[k][a:b], run.chain, rank)
        if op == dist.ReduceOp.AVG:
            out.div_(world)  # gloo's AVG: the sum, then divided
        return None


class PointToPointAllGather(_Allocate, AllGather):
    """``all_gather_into_tensor(output, input)`` as one send of this rank's shard to each peer and one receive
    from each peer into its chunk of the output."""

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        chunks = output_tensor.view(world, -1)
        shard = input_tensor.reshape(-1)
        if chunks[rank].data_ptr() != shard.data_ptr():  # FSDP2 passes its input as a view of that chunk
            chunks[rank].copy_(shard)
        peers = _peers(world, rank)
        messages = _messages([(chunks[k], k) for k in peers], [(shard, k) for k in peers], group, ALL_GATHER_TAG)
        if async_op:
            return _Work(_POSTING.submit(messages))
        post_inline(messages).wait()
        return None


class _Work(dist.Work):
    """Posted point-to-point messages as the one ``Work`` FSDP2 waits for (it waits only for a ``dist.Work``)."""

    def __init__(self, works: WorkSet) -> None:
        super().__init__()
        self._works = works

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return self._works.wait(timeout)

    def is_completed(self) -> bool:
        return self._works.is_completed()


def _peers(world: int, rank: int) -> list[int]:
    return [k for k in range(world) if k != rank]


def _messages(receives, sends, group, tag: int) -> list:
    """Every receive, then every send (so no send waits for its peer to post): ``(tensor, group rank)`` each."""
    ops = [(dist.irecv, (t, dist.get_global_rank(group, k)), {"group": group, "tag": tag}) for t, k in receives]
    return ops + [(dist.isend, (t, dist.get_global_rank(group, k)), {"group": group, "tag": tag}) for t, k in sends]
