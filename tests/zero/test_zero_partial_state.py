"""ZeRO checkpoints after partial steps: a layer without a gradient in the first step (used from step 1 on,
``find_unused_parameters=True``) shares its bucket with layers that have one, so the shard's parameters step
apart. The gathered state is still the unsharded AdamW's, key for key and bit for bit (its own ``step`` for
every parameter, none for the one never used), loads back, and training continues bit-identically -- at ZeRO
stages 1 and 2."""

from __future__ import annotations

import torch

from fastpar.launcher import spawn

KIND, OPT = "used_from_step_one", "adamw"
DDP_ARGS = {"find_unused_parameters": True}


def _differences(a: dict, b: dict) -> list[str]:
    """What differs between two optimizer state_dicts: parameters with state, keys (in order), values bit for bit."""
    problems = []
    if sorted(a["state"]) != sorted(b["state"]):
        problems.append(f"parameters with state {sorted(a['state'])} != {sorted(b['state'])}")
    for index in sorted(set(a["state"]) & set(b["state"])):
        sa, sb = a["state"][index], b["state"][index]
        if list(sa) != list(sb):
            problems.append(f"param {index}: keys {list(sa)} != {list(sb)}")
            continue
        problems += [f"param {index} {key}: values differ" for key in sa if not torch.equal(sa[key], sb[key])]
    return problems


def _rank(rank: int, world_size: int) -> dict:
    import sys
    import warnings

    import torch.distributed as dist

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from zero_training import build, params_of, resume_case, train_steps

    warnings.filterwarnings("ignore")
    plain_model, plain = build("torch", KIND, OPT, ddp_args=DDP_ARGS)
    train_steps("torch", plain_model, plain, KIND, torch.Generator().manual_seed(100 + rank), rank, 3)
    reference = plain.state_dict()
    out = {}
    for stage in (1, 2):
        args = {"ddp_args": DDP_ARGS, "shard_gradients": stage == 2}
        model, sharded = build("zero", KIND, OPT, **args)
        train_steps("zero", model, sharded, KIND, torch.Generator().manual_seed(100 + rank), rank, 3)
        holder = [sharded.state_dict()]  # collective: the full state on rank 0
        dist.broadcast_object_list(holder, src=0)  # a checkpoint file every rank reads
        gathered = holder[0]
        _, reloaded = build("zero", KIND, OPT, **args)
        reloaded.load_state_dict(gathered)
        again = reloaded.state_dict()  # collective
        model_state = {k: v.clone() for k, v in params_of(model).items()}
        full_model_state = {**plain_model.module.state_dict(), **model_state}
        out[stage] = {
            "trained_alike": all(torch.equal(v, params_of(plain_model)[k]) for k, v in model_state.items()),
            "differences": _differences(gathered, reference),
            "round_trip": _differences(again, reference) if rank == 0 else [],
            "continued": {
                name: resume_case(rank, impl, KIND, OPT, full_model_state, state, steps=3, **args)
                for name, (impl, state) in {
                    "reference": ("torch", reference),
                    "plain_loads_gathered": ("torch", gathered),
                    "sharded_loads_gathered": ("zero", gathered),
                }.items()
            },
        }
    return out


def test_state_after_partial_steps_is_the_unsharded_adamws_and_continues_alike():
    results = spawn(_rank, 2, timeout=300)
    for stage in (1, 2):
        for rank, result in enumerate(results):
            got = result[stage]
            assert got["trained_alike"], f"stage {stage} rank {rank}: the parameters differ before saving"
            assert got["differences"] == [], f"stage {stage} rank {rank}: {got['differences']}"
            assert got["round_trip"] == [], f"stage {stage}: loaded and gathered again: {got['round_trip']}"
            continued = got["continued"]
            for name in ("plain_loads_gathered", "sharded_loads_gathered"):
                reference = continued["reference"]
                differ = [k for k in reference if not torch.equal(reference[k], continued[name][k])]
                assert differ == [], f"stage {stage} rank {rank}: {name} continues differently in {differ}"
