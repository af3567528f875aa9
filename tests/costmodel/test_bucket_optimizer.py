"""The bucket optimiser: exact against brute force, torch's layout, the rank-0 decision broadcast."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.distributed as dist

from fastpar.costmodel.bucket_optimizer import (
    choose_buckets,
    decide_buckets,
    optimal_buckets,
    plan_buckets,
    size_capped_buckets,
    torch_layout,
)
from fastpar.costmodel.perf_profile import CollectiveTable, Profile
from fastpar.costmodel.step_simulator import GradArrival, StepTimeline, SyncCosts, simulate_step
from fastpar.launcher import spawn


def affine(alpha: float, beta: float):
    """comm(nbytes) = alpha + beta * nbytes, for numbers and numpy arrays alike."""
    return lambda nbytes: alpha + beta * np.asarray(nbytes, dtype=np.float64)


def all_splits(timeline: StepTimeline):
    m = len(timeline.grads)
    for mask in range(1 << (m - 1)):
        bounds = [0] + [i + 1 for i in range(m - 1) if mask >> i & 1] + [m]
        yield [[g.index for g in timeline.grads[i:j]] for i, j in zip(bounds, bounds[1:], strict=False)]


def test_hand_cases():
    # two gradients 1 s apart, 100 bytes each. A cheap collective: one bucket each, launched as they arrive.
    grads = [GradArrival(0, 100, "float32", 1.0), GradArrival(1, 100, "float32", 2.0)]
    timeline = StepTimeline(grads, backward_s=2.0)
    assert optimal_buckets(timeline, affine(0.0, 0.005)) == [[0], [1]]  # ends 2.5 instead of 3.0
    # a 10 s latency per collective: one bucket (12.0) beats two (1 + 10, then 11 + 10 = 21.0)
    assert optimal_buckets(timeline, affine(10.0, 0.005)) == [[0, 1]]


@pytest.mark.parametrize("seed", range(4))
def test_optimal_split_equals_brute_force(seed):
    rng = random.Random(seed)
    for _ in range(40):
        m = rng.randint(1, 8)
        ready = sorted(rng.uniform(0, 1) for _ in range(m))
        grads = [GradArrival(i, rng.randint(1, 100) * 1000, "float32", ready[i]) for i in range(m)]
        timeline = StepTimeline(grads, backward_s=ready[-1] + rng.uniform(0, 0.3))
        comm = affine(rng.uniform(0, 0.2), rng.uniform(0, 2e-5))
        costs = SyncCosts(pack_s_per_byte=rng.choice([0, 1e-6]), unpack_s_per_byte=rng.choice([0, 1e-6, 4e-6]))
        best = min(simulate_step(timeline, b, comm, costs).sync_end_s for b in all_splits(timeline))
        got = simulate_step(timeline, optimal_buckets(timeline, comm, costs), comm, costs).sync_end_s
        assert got == pytest.approx(best, rel=1e-6, abs=1e-12)


def test_mixed_dtypes_get_separate_buckets_in_arrival_order():
    dtypes = ["float32", "bfloat16", "float32", "bfloat16", "float32"]
    grads = [GradArrival(i, 1000, dtypes[i], 0.1 * i) for i in range(5)]
    timeline = StepTimeline(grads, backward_s=0.5)
    buckets = optimal_buckets(timeline, affine(1.0, 1e-9))  # latency-bound: one bucket per dtype
    assert sorted(map(sorted, buckets)) == [[0, 2, 4], [1, 3]]
    assert buckets == [[1, 3], [0, 2, 4]]  # the bf16 bucket's last gradient arrives first


def test_size_capped_buckets_match_torchs_assignment():
    rng = random.Random(0)
    for _ in range(20):
        numels = [rng.choice([10, 1000, 100_000, 400_000]) for _ in range(rng.randint(1, 30))]
        order = list(range(len(numels)))
        rng.shuffle(order)
        grads = [GradArrival(i, numels[i] * 4, "float32", float(k)) for k, i in enumerate(order)]
        caps = [1 << 20, rng.choice([1 << 20, 4 << 20, 25 << 20])]
        tensors = [torch.empty(numels[i]) for i in order]
        expected, _ = dist._compute_bucket_assignment_by_size(tensors, caps, [False] * len(order), order)
        assert size_capped_buckets(grads, caps) == [list(b) for b in expected]
        assert torch_layout(StepTimeline(grads, float(len(order))), caps[1] / (1 << 20)) == [list(b) for b in expected]


def test_fusion_style_buckets_never_pass_the_cap():
    grads = [GradArrival(i, n, "float32", float(i)) for i, n in enumerate([40, 40, 100, 10, 10])]
    assert size_capped_buckets(grads, [64], fit=True) == [[0], [1], [2], [3, 4]]
    assert size_capped_buckets(grads, [64]) == [[0, 1], [2], [3, 4]]


def small_profile(world_size: int = 2) -> Profile:
    sizes = [4096, 65536, 1 << 20, 4 << 20]
    seconds = [2e-4 + n / 1e9 for n in sizes]  # 0.2 ms + 1 GB/s
    grads = [GradArrival(i, (i + 1) * 200_000, "float32", 0.002 * (i + 1)) for i in range(12)]
    return Profile(
        backend="gloo",
        device="cpu",
        world_size=world_size,
        collectives={"allreduce": CollectiveTable(sizes, seconds)},
        moves_gbs={"torch_pack": 5.0, "torch_unpack": 5.0, "fastpar_pack": 8.0, "fastpar_unpack": 8.0},
        contention={"compute_slowdown": 0.2, "wire_slowdown": 0.5},
        timeline=StepTimeline(grads, backward_s=0.03, forward_s=0.01, optimizer_s=0.005),
    )


def test_plan_is_never_predicted_slower_than_a_fixed_cap():
    profile = small_profile()
    costs = profile.sync_costs("torch")
    plan = plan_buckets(profile.timeline, profile.comm(), costs)
    for cap in (1, 4, 25):
        fixed = simulate_step(profile.timeline, torch_layout(profile.timeline, cap), profile.comm(), costs)
        assert plan.prediction.step_s <= fixed.step_s + 1e-12
    assert sorted(i for b in plan.buckets for i in b) == list(range(12))
    assert plan.chosen in plan.candidates


def test_choose_buckets_takes_the_reducers_records():
    profile = small_profile()
    grads = list(reversed(profile.timeline.grads))  # any order: sorted by ready time inside
    plan = choose_buckets(grads, profile, reducer="fastpar_views", comm_bytes_per_byte=0.5)
    assert sorted(i for b in plan.buckets for i in b) == list(range(12))
    with pytest.raises(ValueError, match="unknown reducer"):
        choose_buckets(grads, profile, reducer="magic")


def _decide_on_rank(rank: int, world_size: int) -> list[list[int]]:
    profile = small_profile(world_size)
    # rank 1 is slower for the first gradients: the decision must use the slowest rank's times
    grads = [
        GradArrival(g.index, g.nbytes, g.dtype, g.ready_s * (3.0 if rank == 1 and g.index < 6 else 1.0))
        for g in profile.timeline.grads
    ]
    return decide_buckets(grads, profile)


@pytest.mark.slow
def test_rank0_decision_is_broadcast_to_every_rank(no_process_group):
    results = spawn(_decide_on_rank, 2, timeout=240)
    assert results[0] == results[1]
    profile = small_profile(2)
    slowest = [
        GradArrival(g.index, g.nbytes, g.dtype, g.ready_s * (3.0 if g.index < 6 else 1.0))
        for g in profile.timeline.grads
    ]
    assert results[0] == choose_buckets(slowest, profile, world_size=2).buckets


def _mismatched_counts(rank: int, world_size: int) -> str:
    grads = small_profile(world_size).timeline.grads[: 12 - rank]
    try:
        decide_buckets(grads, small_profile(world_size))
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow
def test_ranks_with_different_parameters_get_an_error_not_a_hang(no_process_group):
    messages = spawn(_mismatched_counts, 2, timeout=240)
    assert all("every rank must time the same parameters" in m for m in messages)
