"""The thread model of the "fastpar" backend: waits spin only when every rank has a core to spare beside its
compute thread, reductions split over threads only when the cores outnumber the ranks; the environment overrides
both, and the group runs with what was chosen."""

from __future__ import annotations

import pytest

from fastpar.comm.threads import SPIN_US_WITH_SPARE_CORES, choose
from fastpar.launcher import spawn


@pytest.fixture(autouse=True)
def _no_overrides(monkeypatch):
    monkeypatch.delenv("FASTPAR_SHM_SPIN_US", raising=False)
    monkeypatch.delenv("FASTPAR_SHM_THREADS", raising=False)


@pytest.mark.parametrize(
    ("ranks", "cores", "spin_us", "threads"),
    [
        (2, 2, 0, 1),  # every core has a compute thread: sleep at once, sum inline
        (2, 3, 0, 1),
        (2, 4, SPIN_US_WITH_SPARE_CORES, 2),
        (4, 2, 0, 1),  # more ranks than cores
        (1, 8, SPIN_US_WITH_SPARE_CORES, 8),
    ],
)
def test_policy_follows_cores_per_rank(ranks, cores, spin_us, threads):
    policy = choose(ranks, cores)
    assert (policy.spin_us, policy.summation_threads) == (spin_us, threads)
    assert f"{ranks} ranks on {cores} cores" in policy.why


def test_environment_overrides_and_is_checked(monkeypatch):
    monkeypatch.setenv("FASTPAR_SHM_SPIN_US", "7")
    monkeypatch.setenv("FASTPAR_SHM_THREADS", "3")
    assert (choose(2, 2).spin_us, choose(2, 2).summation_threads) == (7, 3)
    monkeypatch.setenv("FASTPAR_SHM_THREADS", "many")
    with pytest.raises(ValueError, match="FASTPAR_SHM_THREADS must be a whole number"):
        choose(2, 2)


def _policy_rank(rank: int, world: int) -> tuple:
    import torch
    import torch.distributed as dist

    import fastpar

    t = torch.full((100_000,), float(rank + 1))
    dist.all_reduce(t)
    return fastpar.comm.thread_policy(), choose(world).spin_us, choose(world).summation_threads, t[0].item()


def test_group_runs_with_the_chosen_policy():
    for policy, spin_us, threads, value in spawn(_policy_rank, 2, backend="fastpar", timeout=120):
        assert policy == {"spin_us": spin_us, "summation_threads": threads} and value == 3.0
