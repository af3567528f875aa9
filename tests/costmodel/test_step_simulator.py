"""The step simulator against hand-computed timelines."""

from __future__ import annotations

import pytest

from fastpar.costmodel.step_simulator import GradArrival, StepTimeline, SyncCosts, simulate_step


def one_second_per_100_bytes(nbytes: float) -> float:
    return nbytes / 100.0


def two_grads() -> StepTimeline:
    # gradient 0 ready 1 s into backward, gradient 1 at 2 s, backward returns at 3 s
    grads = [GradArrival(0, 100, "float32", 1.0), GradArrival(1, 100, "float32", 2.0)]
    return StepTimeline(grads, backward_s=3.0, forward_s=0.5, optimizer_s=0.25)


def test_two_buckets_hide_behind_backward():
    p = simulate_step(two_grads(), [[0], [1]], one_second_per_100_bytes)
    assert p.buckets == [(1.0, 2.0), (2.0, 3.0)]
    assert (p.backward_end_s, p.sync_end_s, p.exposed_s) == (3.0, 3.0, 0.0)
    assert p.step_s == pytest.approx(0.5 + 3.0 + 0.25)
    assert p.efficiency(two_grads().compute_s) == pytest.approx(1.0)


def test_one_bucket_waits_for_the_last_gradient():
    p = simulate_step(two_grads(), [[0, 1]], one_second_per_100_bytes)
    assert p.buckets == [(2.0, 4.0)]
    assert p.exposed_s == pytest.approx(1.0)
    assert p.step_s == pytest.approx(4.75)
    assert p.efficiency(3.75) == pytest.approx(3.75 / 4.75)


def test_bucket_order_is_kept_and_the_wire_takes_one_at_a_time():
    # bucket 0 holds the late gradient: bucket 1 cannot go first even though its gradient is ready at 1 s
    p = simulate_step(two_grads(), [[1], [0]], one_second_per_100_bytes)
    assert p.buckets == [(2.0, 3.0), (3.0, 4.0)]
    assert p.exposed_s == pytest.approx(1.0)


def test_pack_on_arrival_and_unpack_after_backward():
    # pack 1 ms/byte: gradient 0 packed by 1.1 s, its collective 1.1-2.1; gradient 1 at 2.0 + 0.1 + 0.1 = 2.2,
    # collective 2.2-3.2; backward's last second ends at 3.2; unpack 2 ms/byte: 3.2-3.4 and 3.4-3.6
    costs = SyncCosts(pack_s_per_byte=1e-3, unpack_s_per_byte=2e-3)
    p = simulate_step(two_grads(), [[0], [1]], one_second_per_100_bytes, costs)
    assert p.buckets == [pytest.approx((1.1, 2.1)), pytest.approx((2.2, 3.2))]
    assert p.backward_end_s == pytest.approx(3.2)
    assert p.sync_end_s == pytest.approx(3.6)
    assert p.exposed_s == pytest.approx(0.4)


def test_reduced_precision_halves_the_bytes_on_the_wire():
    p = simulate_step(two_grads(), [[0, 1]], one_second_per_100_bytes, SyncCosts(comm_bytes_per_byte=0.5))
    assert p.buckets == [(2.0, 3.0)]


def test_contention_slows_compute_and_wire_while_both_run():
    timeline = StepTimeline([GradArrival(0, 100, "float32", 1.0)], backward_s=3.0)
    # compute at half speed while the wire is busy (1-2 s): 0.5 s of backward done, 1.5 s left -> ends at 3.5
    p = simulate_step(timeline, [[0]], one_second_per_100_bytes, SyncCosts(compute_slowdown=1.0))
    assert p.buckets == [(1.0, 2.0)]
    assert p.backward_end_s == pytest.approx(3.5)
    # both at half speed: the wire's 1 s takes 2 s (1-3), compute does 1 of its 2 s by then, the rest alone -> 4 s
    p = simulate_step(timeline, [[0]], one_second_per_100_bytes, SyncCosts(compute_slowdown=1.0, wire_slowdown=1.0))
    assert p.buckets == [pytest.approx((1.0, 3.0))]
    assert p.backward_end_s == pytest.approx(4.0)
    assert p.exposed_s == pytest.approx(0.0)


def test_free_network_gives_the_compute_step():
    p = simulate_step(two_grads(), [[0], [1]], lambda nbytes: 0.0)
    assert p.step_s == pytest.approx(two_grads().compute_s)


def test_bad_buckets_and_timelines_are_refused():
    with pytest.raises(ValueError, match="in no bucket"):
        simulate_step(two_grads(), [[0]], one_second_per_100_bytes)
    with pytest.raises(ValueError, match="more than one bucket"):
        simulate_step(two_grads(), [[0, 1], [1]], one_second_per_100_bytes)
    with pytest.raises(ValueError, match="no gradient"):
        simulate_step(two_grads(), [[0, 1, 7]], one_second_per_100_bytes)
    with pytest.raises(ValueError, match="empty"):
        simulate_step(two_grads(), [[0, 1], []], one_second_per_100_bytes)
    with pytest.raises(ValueError, match="arrival order"):
        StepTimeline([GradArrival(0, 4, "float32", 2.0), GradArrival(1, 4, "float32", 1.0)], backward_s=3.0)
    with pytest.raises(ValueError, match="before the last gradient"):
        StepTimeline([GradArrival(0, 4, "float32", 2.0)], backward_s=1.0)
