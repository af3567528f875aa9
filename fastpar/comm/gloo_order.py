"""The order in which gloo's ring all-reduce adds up each element, so that ZeRO's reduce-scatter -- a
point-to-point exchange plus local additions -- gives exactly the bits of torch DDP's all-reduce.

gloo's ring all-reduce (``gloo/allreduce.cc``, as built into torch's wheels) cuts a buffer of ``B`` bytes
into ``n = roundUp(max(ceil(B / 1 MiB), 2p), p)`` segments of ``roundUp(ceil(B / n), itemsize)`` bytes;
chunk ``c`` is the c-th run of ``n / p`` consecutive segments. A chunk's partial sums travel the ring from
rank ``c - 1`` down to rank ``c``, each rank adding its own value to what it received, so every element
of chunk ``c`` ends up as

    x[c] + (x[c+1] + (... + (x[c+p-2] + x[c+p-1])))        (rank indices mod p)

Floating-point addition is commutative but not associative: at p = 2 the order cannot matter (one
addition); at p >= 3 an element's bits depend on its chunk, i.e. on the size of the bucket torch's DDP
would reduce and the element's position in it. ``tests/zero/test_zero_gloo_order.py`` checks this model
against the installed gloo, so a gloo that sums differently is caught there, by name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

GLOO_MAX_SEGMENT_BYTES = 1 << 20  # gloo's default AllreduceOptions max segment size

__all__ = ["SumRange", "chunk_numel", "reduce_in_ring_order", "shard_sum_ranges", "summation_chain"]


def chunk_numel(numel: int, world_size: int, itemsize: int) -> int:
    """Elements per rank chunk of gloo's ring all-reduce of ``numel`` elements of ``itemsize`` bytes."""
    total = numel * itemsize
    segments = max(-(-total // GLOO_MAX_SEGMENT_BYTES), 2 * world_size)
    segments = -(-segments // world_size) * world_size
    segment_bytes = -(-total // segments)
    segment_bytes = -(-segment_bytes // itemsize) * itemsize
    return segments // world_size * segment_bytes // itemsize


def summation_chain(chunk: int, world_size: int) -> tuple[int, ...]:
    """The ranks whose values gloo adds for ``chunk``, innermost first: ``(c+p-1, c+p-2, ..., c)``."""
    return tuple((chunk + k) % world_size for k in range(world_size - 1, -1, -1))


@dataclass(frozen=True)
class SumRange:
    """Elements ``[start, end)`` of a ZeRO bucket, summed over the ranks in ``chain`` order."""

    start: int
    end: int
    chain: tuple[int, ...]


def shard_sum_ranges(
    pieces: Sequence[tuple[int, int, int, int]], shard: tuple[int, int], world_size: int, itemsize: int
) -> list[SumRange]:
    """The summation order of every element of a shard, as runs.

    ``pieces``: ``(start, length, reference_start, reference_numel)`` -- elements ``[start, start + length)``
    of a ZeRO bucket sit at ``reference_start...`` in a bucket of ``reference_numel`` elements that torch's
    DDP would all-reduce. ``shard``: ``[start, end)`` of this rank's shard; padding outside every piece is
    left out (it holds zeros on every rank).
    """
    first, last = shard
    ranges: list[SumRange] = []
    for start, length, ref_start, ref_numel in pieces:
        chunk = chunk_numel(ref_numel, world_size, itemsize)
        a, b = max(start, first), min(start + length, last)
        ref = ref_start + (a - start)
        while a < b:
            c = ref // chunk
            take = min(b - a, (c + 1) * chunk - ref)
            chain = summation_chain(c, world_size)
            if ranges and ranges[-1].end == a and ranges[-1].chain == chain:
                ranges[-1] = SumRange(ranges[-1].start, a + take, chain)
            else:
                ranges.append(SumRange(a, a + take, chain))
            a, ref = a + take, ref + take
    return ranges


def reduce_in_ring_order(
    own: torch.Tensor, received: Callable[[int], torch.Tensor], chain: tuple[int, ...], rank: int
) -> None:
    """Sum ``chain``'s values into ``own`` (this rank's values, overwritten), one addition at a time in
    gloo's order. ``received(k)``: rank k's values for the same elements (scratch: may be overwritten)."""
    if len(chain) == 1:
        return  # one rank: nothing to add
    acc = own if chain[0] == rank else received(chain[0])
    for k in chain[1:-1]:
        if k == rank:  # acc is a scratch buffer here (this rank is not first in the chain)
            acc.add_(own)
        else:
            acc = received(k).add_(acc)
    if chain[-1] == rank:
        own.add_(acc)
    else:
        torch.add(received(chain[-1]), acc, out=own)
