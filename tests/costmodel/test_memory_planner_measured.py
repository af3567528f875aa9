"""The planner's model-state bytes against the tensors each engine really holds, per rank of 2 spawned CPU
ranks (gloo, and fastpar's backend): fastpar's DDP and ZeRO-1 (and ZeRO-2 where ``ShardedOptimizer`` shards
gradients), torch's ``fully_shard`` per block with resharding on and off, and the plan's pipeline through torch's pipelining.
The claim is +-5% (docs/guide/planner.md); the counts are exact today, which the 5% does not hide: a
layout change that moves them shows here as a ratio in the failure message."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from strategy_measure import compare_state, measure_rank, spec_of  # noqa: E402

from fastpar.costmodel.memory_planner import plan  # noqa: E402
from fastpar.launcher import spawn  # noqa: E402

MODEL = dict(layers=3, hidden=64, vocab=501, seq_len=32)  # 501 rows: fully_shard pads dim 0 to 502


def _zero2_available() -> bool:
    import fastpar

    return "shard_gradients" in fastpar.ShardedOptimizer.__init__.__code__.co_varnames


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gloo", "fastpar"])
def test_model_state_bytes_match_every_engine_within_five_percent(backend):
    planned = plan(
        spec_of(MODEL), devices=2, device_memory="1GB", batch_size=4, seq_len=MODEL["seq_len"], backend=backend
    )
    strategies = {
        e.label: (e.strategy, e.options) for e in planned.estimates if e.strategy != "zero2" or _zero2_available()
    }
    config = {"model": MODEL, "batch_size": 4, "strategies": strategies, "warmup": 1, "rounds": 0}
    results = spawn(measure_rank, 2, config, backend=backend, timeout=600)
    problems = []
    for e in planned.estimates:
        if e.label not in strategies:
            continue
        predicted, measured = compare_state(e, results)  # the largest rank (pipeline stages differ)
        if abs(predicted / measured - 1) > 0.05:
            problems.append(f"{e.label}: predicted {predicted}, measured {measured} (x{predicted / measured:.3f})")
    assert not problems, "; ".join(problems)
