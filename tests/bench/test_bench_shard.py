"""``fastpar bench shard`` end to end on a small model: every strategy checked against fastpar DDP before timing,
model-state bytes measured per rank beside the plan's, goal lines printed. No timing is asserted."""

from __future__ import annotations

import json

import pytest

from fastpar.bench.cli import main

STRATEGIES = ["ddp", "zero1", "zero2", "fsdp_reshard", "fsdp_keep", "pipeline"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gloo", "fastpar"])
def test_shard_benchmark_measures_every_strategy_beside_the_plan(backend, tmp_path, capsys):
    out = tmp_path / "shard.json"
    argv = ["shard", "--width", "64", "--depth", "4", "--batch", "8", "--nproc", "2", "--backend", backend]
    assert main([*argv, "-n", "1", "-w", "1", "--rounds", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "zero2 step <= 1.05x zero1" in printed and "fully sharded step" in printed
    data = json.loads(out.read_text())
    wires = ["gloo"] if backend == "gloo" else ["fastpar", "gloo"]
    assert [(r["wire"], r["variant"]) for r in data["rows"]] == [(w, s) for w in wires for s in STRATEGIES]
    state = data["summary"]["state_bytes_per_rank"]
    total = {s: max(sum(rank.values()) for rank in state[s]) for s in STRATEGIES}
    # 4 x Linear(64, 64): 16,640 fp32 parameters; DDP holds them, their gradients and AdamW's two moments
    assert total["ddp"] >= 16_640 * 4 * 4
    # one bucket here: ZeRO-2's pool lends it a full-size buffer, so only the optimizer state shrinks
    assert max(total["zero1"], total["zero2"]) < total["ddp"]
    assert total["fsdp_reshard"] < total["zero1"] and total["pipeline"] < total["ddp"]
    goals = {g["name"]: g for g in data["summary"]["goals"]}
    assert any(name.startswith("ddp: |predicted / measured - 1|") for name in goals)
    for wire in wires:  # each wire priced by a plan of its own backend, every strategy's step beside it
        claims = [f"{wire}: {s}: |predicted / measured - 1| of the step time <= 25%" for s in STRATEGIES]
        assert all(claim in goals for claim in claims), (wire, sorted(goals))
    assert sorted(data["summary"]["plans"]) == sorted(wires)
    assert data["summary"]["goals_met"] == all(g["met"] for g in goals.values())


@pytest.mark.slow
def test_shard_memory_benchmark_prints_peak_state_plan_paper_and_goals(tmp_path, capsys):
    out = tmp_path / "memory.json"
    # the embedding model peaks in AdamW's step (its temporaries), the others at backward's start
    argv = ["shard", "--memory", "--tiny", "--models", "decoder,cnn,embedding", "--nproc", "2", "--backend", "gloo"]
    assert main([*argv, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    for line in (
        "goal: decoder zero2: |plan / measured - 1| of the step's peak <= 10%",
        "goal: cnn fsdp: |plan / measured - 1| of state + buffers <= 5%",
        "goal: decoder: zero2 (state + buffers - staging) <= 1.10x (P + (G + S)/N)",
        "goal: cnn: zero1 (state + buffers - staging) <= 1.10x (P + G + S/N)",
        "goal: cnn: max(zero2 / zero1, zero1 / ddp) of state + buffers <= 0.999x (zero2 < zero1 < ddp)",
    ):
        assert line in printed
    assert "peak MiB" in printed and "paper MiB" in printed
    data = json.loads(out.read_text())
    strategies = ["ddp", "zero1", "zero2", "fsdp"]
    expected = [(m, s, r) for m in ("decoder", "cnn", "embedding") for s in strategies for r in (0, 1)]
    assert [(r["model"], r["strategy"], r["rank"]) for r in data["rows"]] == expected
    for name, model in data["summary"]["memory"].items():
        p = model["P"]
        by = model["strategies"]
        for strategy in strategies:
            for rank in by[strategy]["per_rank"]:
                assert rank["peak"] >= rank["total"] > 0
            assert by[strategy]["plan_peak"] > by[strategy]["plan_state"] > 0
            # the plan's peak, taken by moment of the step, within the 10% of the measured one
            measured_peak = max(rank["peak"] for rank in by[strategy]["per_rank"])
            assert abs(by[strategy]["plan_peak"] / measured_peak - 1) <= 0.10, (name, strategy, by[strategy])
        ddp = by["ddp"]["per_rank"][0]
        assert ddp["parameters"] == p and ddp["gradients"] == p and by["ddp"]["paper"] == 4 * p
        if name == "cnn":
            assert ddp["buffers"] > 0  # BatchNorm's running statistics
        assert max(r["total"] for r in by["fsdp"]["per_rank"]) < ddp["total"]
    assert len(data["summary"]["goals"]) == 3 * (2 * len(strategies) + 4)


@pytest.mark.slow
def test_shard_memory_benchmark_measures_checkpointing_beside_its_plan(tmp_path, capsys):
    """--checkpointing adds each strategy with the repeated blocks checkpointed; the plan's ckpt row predicts it."""
    out = tmp_path / "memory.json"
    argv = [
        "shard",
        "--memory",
        "--tiny",
        "--checkpointing",
        "--models",
        "decoder",
        "--nproc",
        "2",
        "--backend",
        "gloo",
    ]
    assert main([*argv, "--json", str(out)]) == 0
    assert "goal: decoder zero2+ckpt: |plan / measured - 1| of the step's peak <= 10%" in capsys.readouterr().out
    by = json.loads(out.read_text())["summary"]["memory"]["decoder"]["strategies"]
    for strategy in ("ddp", "zero1", "zero2", "fsdp"):
        plain, ckpt = by[strategy], by[f"{strategy}+ckpt"]
        peak = max(rank["peak"] for rank in ckpt["per_rank"])
        assert peak < max(rank["peak"] for rank in plain["per_rank"])  # the blocks' activations are gone
        assert abs(ckpt["plan_peak"] / peak - 1) <= 0.10, (strategy, ckpt)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["shard", "--nproc", "1"], "--nproc must be at least 2"),
        (["shard", "--depth", "0"], "--depth must be at least 1"),
        (["shard", "--device-memory", "lots"], "--device-memory"),
        (["shard", "--memory", "--models", "resnet"], "--models: unknown resnet"),
        (["shard", "--tiny"], "add --memory"),
        (["shard", "--checkpointing"], "add --memory"),
    ],
)
def test_shard_benchmark_refuses_what_cannot_run(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
