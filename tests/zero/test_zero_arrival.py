"""``ShardedOptimizer.state_dict()`` called on one rank only (to save there) raises ``RankArrivalError`` naming
the ranks that did not call it, after ``$FASTPAR_ZERO_ARRIVAL_TIMEOUT_S``, instead of hanging in its gather;
a rank calling it after another gave up raises too; called on every rank it works. Two spawned gloo ranks."""

from __future__ import annotations

import torch

from fastpar.launcher import spawn

TIMEOUT_S = 2


def _rank(rank: int, world_size: int) -> dict:
    import os
    import time
    import warnings

    import torch.distributed as dist
    from ddp_models import make_input
    from zero_training import build

    from fastpar.zero import RankArrivalError

    warnings.filterwarnings("ignore")
    os.environ["FASTPAR_ZERO_ARRIVAL_TIMEOUT_S"] = str(TIMEOUT_S)
    gen = torch.Generator().manual_seed(rank)
    model, opt = build("zero", "mlp", "adamw", shard_gradients=True)
    model(make_input("mlp", gen)).square().mean().backward()
    opt.step()
    out: dict = {}

    def attempt(name):
        start = time.monotonic()
        try:
            opt.state_dict()
            out[name] = None
        except RankArrivalError as exc:
            out[name] = str(exc)
        out[name + "_s"] = time.monotonic() - start

    if rank == 0:
        attempt("alone")  # rank 1 never calls this one
    dist.barrier()
    if rank == 1:
        attempt("late")  # rank 0 gave up already: must not enter the gather alone
    dist.barrier()
    model, opt = build("zero", "mlp", "adamw", shard_gradients=True)
    model(make_input("mlp", gen)).square().mean().backward()
    opt.step()
    state = opt.state_dict()  # every rank: works
    out["everyone"] = sorted(state["state"]) if rank == 0 else state["state"]
    return out


def test_state_dict_on_one_rank_raises_naming_the_missing_rank():
    first, second = spawn(_rank, 2, timeout=120)
    message = first["alone"]
    assert message is not None, "rank 0's lone state_dict() returned"
    assert "rank(s) 1 of the process group did not call it within 2 s" in message
    assert "Call opt.state_dict() on every rank" in message
    assert TIMEOUT_S <= first["alone_s"] < TIMEOUT_S + 30
    assert second["late"] is not None and "this rank among them" in second["late"]
    assert second["late_s"] < TIMEOUT_S + 30
    assert first["everyone"] == list(range(6)) and second["everyone"] == {}
