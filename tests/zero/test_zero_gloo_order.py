"""gloo's summation order (fastpar/comm/gloo_order.py), which ZeRO's point-to-point reduce-scatter follows to get
the bits of torch DDP's all-reduce: the model of gloo's ring checked against the installed gloo on 3 ranks
(fp32 and bf16, sizes from one segment to many), and the pieces of arithmetic on their own."""

from __future__ import annotations

import pytest
import torch

from fastpar.comm.gloo_order import SumRange, chunk_numel, reduce_in_ring_order, shard_sum_ranges, summation_chain
from fastpar.launcher import spawn

SIZES = [2, 7, 31, 1000, 3001, 300_001, 6_553_601]  # 300_001 fp32 is > 1 MiB: several segments per chunk


def _predicted_sum(xs: list[torch.Tensor]) -> torch.Tensor:
    """What gloo's ring all-reduce returns for per-rank inputs ``xs``, by the model."""
    world_size, n = len(xs), xs[0].numel()
    chunk = chunk_numel(n, world_size, xs[0].element_size())
    out = torch.empty_like(xs[0])
    for c in range(world_size):
        lo, hi = min(c * chunk, n), min((c + 1) * chunk, n)
        chain = summation_chain(c, world_size)
        acc = xs[chain[0]][lo:hi].clone()
        for k in chain[1:]:
            acc = xs[k][lo:hi] + acc
        out[lo:hi] = acc
    return out


def _rank(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    wrong = {}
    for dtype in (torch.float32, torch.bfloat16):
        for n in SIZES:
            xs = [(torch.rand(n, generator=torch.Generator().manual_seed(r)) + 1).to(dtype) for r in range(world_size)]
            reduced = xs[rank].clone()
            dist.all_reduce(reduced)
            wrong[(str(dtype), n)] = int((reduced != _predicted_sum(xs)).sum())
    return wrong


@pytest.mark.slow
def test_the_model_of_gloos_ring_matches_the_installed_gloo_at_three_ranks():
    results = spawn(_rank, 3, timeout=600)
    for rank, wrong in enumerate(results):
        assert all(count == 0 for count in wrong.values()), (
            f"rank {rank}: gloo summed these (dtype, size) in another order than fastpar.comm.gloo_order models "
            f"(elements differing): {wrong}. ZeRO's p2p reduce-scatter then no longer matches DDP's bits at 3+ ranks"
        )


def test_the_model_distinguishes_orders():  # the check above could not pass by accident
    xs = [(torch.rand(3001, generator=torch.Generator().manual_seed(r)) + 1) for r in range(3)]
    left_to_right = (xs[0] + xs[1]) + xs[2]
    assert (left_to_right != _predicted_sum(xs)).sum() > 200  # 319: a quarter of chunks 0 and 1


@pytest.mark.parametrize(
    "numel, itemsize, expected",
    [
        (2, 4, 2),
        (7, 4, 4),
        (31, 4, 12),
        (1000, 4, 334),
        (3001, 4, 1002),
        (6_553_601, 4, 2_184_534),
        (10_000_001, 4, 3_333_343),
    ],
)
def test_chunk_sizes_seen_from_gloo(numel, itemsize, expected):
    assert chunk_numel(numel, 3, itemsize) == expected


def test_summation_chain_ends_at_the_chunk_owner():
    assert summation_chain(0, 3) == (2, 1, 0)
    assert summation_chain(2, 3) == (1, 0, 2)
    assert summation_chain(1, 2) == (0, 1)


def test_shard_sum_ranges_split_at_chunk_boundaries_and_skip_padding():
    # a ZeRO bucket of 10 elements (+2 padding) that is elements 990..999 of torch's 1000-element bucket
    ranges = shard_sum_ranges([(0, 10, 990, 1000)], (0, 12), 3, 4)
    assert ranges == [SumRange(0, 10, summation_chain(2, 3))]
    # two parameters, swapped relative to torch's layout, crossing torch's chunk boundary at 334
    ranges = shard_sum_ranges([(0, 4, 330, 1000), (4, 4, 0, 1000)], (0, 8), 3, 4)
    assert ranges == [SumRange(0, 8, summation_chain(0, 3))]  # both in torch's chunk 0: one run
    ranges = shard_sum_ranges([(0, 8, 330, 1000)], (0, 8), 3, 4)
    assert ranges == [SumRange(0, 4, summation_chain(0, 3)), SumRange(4, 8, summation_chain(1, 3))]


@pytest.mark.parametrize("rank", [0, 1, 2])
@pytest.mark.parametrize("chunk", [0, 1, 2])
def test_reduce_in_ring_order_adds_in_the_chain_order(rank, chunk):
    xs = [torch.rand(64, generator=torch.Generator().manual_seed(r)) + 1 for r in range(3)]
    scratch = {k: xs[k].clone() for k in range(3) if k != rank}
    own = xs[rank].clone()
    chain = summation_chain(chunk, 3)
    reduce_in_ring_order(own, lambda k: scratch[k], chain, rank)
    expected = xs[chain[2]] + (xs[chain[1]] + xs[chain[0]])
    assert torch.equal(own, expected)
