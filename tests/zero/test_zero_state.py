"""ZeRO checkpoints: the full optimizer state gathered on rank 0 is the plain optimizer's state (same keys,
values and strides, bit for bit); a plain optimizer loads it; the sharded optimizer loads a plain
optimizer's state; a state gathered on 2 ranks continues on 3. Every continuation equals the unsharded run.
At ZeRO stages 1 and 2 (``shard_gradients=True``)."""

from __future__ import annotations

import pytest
import torch

from fastpar.launcher import spawn

pytestmark = pytest.mark.slow  # spawned ranks save, reload and continue on 2 and 3 ranks: run with --full

KIND, OPT = "cnn", "adamw"
BUILD = {"groups": "no_decay_bias", "channels_last": True}  # two param groups; channels_last (strided) state


def _differences(a: dict, b: dict) -> list[str]:
    """What differs between two optimizer state_dicts (values bit for bit, and tensor strides)."""
    problems = []
    if a["param_groups"] != b["param_groups"]:
        problems.append(f"param_groups {a['param_groups']} != {b['param_groups']}")
    if sorted(a["state"]) != sorted(b["state"]):
        problems.append(f"state keys {sorted(a['state'])} != {sorted(b['state'])}")
    for index in a["state"]:
        sa, sb = a["state"][index], b["state"].get(index, {})
        if list(sa) != list(sb):
            problems.append(f"param {index}: keys {list(sa)} != {list(sb)}")
            continue
        for key in sa:
            x, y = sa[key], sb[key]
            if not torch.equal(x, y) or x.stride() != y.stride() or x.dtype != y.dtype:
                problems.append(f"param {index} {key}: values/strides differ {x.stride()} vs {y.stride()}")
    return problems


def _two_ranks(rank: int, world_size: int, stage: int) -> dict:
    import sys
    import warnings

    import torch.distributed as dist

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from zero_training import build, resume_case, train_steps

    warnings.filterwarnings("ignore")
    build_args = {**BUILD, "shard_gradients": stage == 2}  # torch's runs leave it aside
    plain_model, plain = build("torch", KIND, OPT, **build_args)
    train_steps(
        "torch", plain_model, plain, KIND, torch.Generator().manual_seed(100 + rank), rank, 10, channels_last=True
    )
    model, sharded = build("zero", KIND, OPT, **build_args)
    train_steps("zero", model, sharded, KIND, torch.Generator().manual_seed(100 + rank), rank, 10, channels_last=True)

    gathered = sharded.state_dict()  # collective: the full state lands on rank 0
    out = {"placeholder_error": None, "differences": None}
    if rank == 0:
        out["differences"] = _differences(gathered, plain.state_dict())
    else:
        try:
            sharded.load_state_dict(gathered)
        except ValueError as exc:
            out["placeholder_error"] = str(exc)
    holder = [gathered]
    dist.broadcast_object_list(holder, src=0)  # a checkpoint file every rank reads
    full = holder[0]
    model_state = {k: v.clone() for k, v in model.module.state_dict().items()}
    runs = {
        "reference": ("torch", plain.state_dict()),
        "plain_loads_gathered": ("torch", full),
        "sharded_loads_plain": ("zero", plain.state_dict()),
        "sharded_loads_gathered": ("zero", full),
    }
    out["continued"] = {
        name: resume_case(rank, impl, KIND, OPT, model_state, state, **build_args)
        for name, (impl, state) in runs.items()
    }
    out["full"], out["model"] = full, model_state
    return out


def _three_ranks(rank: int, world_size: int, model_state: dict, full: dict, stage: int) -> dict:
    import sys
    import warnings

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from zero_training import resume_case

    warnings.filterwarnings("ignore")
    build_args = {**BUILD, "shard_gradients": stage == 2}
    return {impl: resume_case(rank, impl, KIND, OPT, model_state, full, **build_args) for impl in ("torch", "zero")}


@pytest.fixture(scope="module", params=[1, 2], ids=["zero1", "zero2"])
def saved_on_two_ranks(request):
    results = spawn(_two_ranks, 2, request.param, timeout=900)
    for result in results:
        result["stage"] = request.param
    return results


def _equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def test_gathered_state_is_the_plain_optimizers_state_bit_for_bit(saved_on_two_ranks):
    assert saved_on_two_ranks[0]["differences"] == []


def test_other_ranks_get_a_placeholder_that_refuses_to_load(saved_on_two_ranks):
    assert "load the one rank 0 saved" in saved_on_two_ranks[1]["placeholder_error"]


@pytest.mark.parametrize("run", ["plain_loads_gathered", "sharded_loads_plain", "sharded_loads_gathered"])
def test_every_continuation_equals_the_unsharded_run(saved_on_two_ranks, run):
    for rank, result in enumerate(saved_on_two_ranks):
        continued = result["continued"]
        assert _equal(continued["reference"], continued[run]), f"rank {rank}: {run} differs"


def test_state_saved_on_two_ranks_continues_on_three(saved_on_two_ranks):
    saved = saved_on_two_ranks[0]
    results = spawn(_three_ranks, 3, saved["model"], saved["full"], saved["stage"], timeout=900)
    for rank, result in enumerate(results):
        assert _equal(result["torch"], result["zero"]), f"rank {rank}: the 3-rank continuation differs"
        assert _equal(results[0]["zero"], result["zero"])
