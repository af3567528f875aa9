"""``fastpar bench zero`` end to end on a tiny model: every variant (ZeRO-1 and ZeRO-2 among them) checked against
torch DDP before timing, optimizer state and gradient bytes measured per rank, goal lines printed. No timing is
asserted."""

from __future__ import annotations

import json

import pytest

from fastpar.bench.cli import main


@pytest.mark.slow
def test_zero_benchmark_reports_state_per_rank_and_goals(tmp_path, capsys):
    out = tmp_path / "zero.json"
    argv = ["zero", "--models", "tiny", "--nproc", "2", "-n", "1", "-w", "1", "--rounds", "1", "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "goal: tiny: zero_fastpar optimizer state per rank <= 1.00x (1/N of unsharded + one bucket)" in printed
    assert "zero_fastpar step <= 1.05x ddp_fastpar" in printed and "zero_fastpar step <= 0.90x zero_torch" in printed
    assert "zero2_fastpar step <= 1.05x zero_fastpar" in printed
    data = json.loads(out.read_text())
    assert [r["variant"] for r in data["rows"]] == [
        "no_comm",
        "ddp",
        "ddp_fastpar",
        "zero_torch",
        "zero_fastpar",
        "zero2_fastpar",
    ]
    assert all(r["step_ms"] > 0 for r in data["rows"])
    state = data["summary"]["state_bytes_per_rank"]["tiny"]
    unsharded, sharded = state["ddp_fastpar"], state["zero_fastpar"]
    assert len(sharded) == 2 and unsharded[0] == unsharded[1]
    # 4 x Linear(64, 64): 16,640 parameters, AdamW's two fp32 moments + a step per tensor
    assert unsharded[0] == 16_640 * 8 + 8 * 4
    assert all(s < unsharded[0] / 2 + 1024 for s in sharded)  # half, plus padding and one step per bucket
    # ZeRO-2 shards the same optimizer state, in smaller buckets (split to fit its staging): a step count and a
    # padding element more per extra bucket
    assert all(0 <= two - one <= 256 for two, one in zip(state["zero2_fastpar"], sharded, strict=True))
    grads = data["summary"]["grad_bytes_per_rank"]["tiny"]
    pool = data["summary"]["zero2_pool_bytes_per_rank"]["tiny"]
    assert grads["ddp_fastpar"] == [16_640 * 4] * 2  # every .grad, in its bucket
    assert all(g >= 16_640 * 4 for g in grads["zero_fastpar"])  # ZeRO-1: the whole gradient buckets (+ scratch)
    assert all(0 < g - p <= 16_640 * 4 / 2 + 1024 for g, p in zip(grads["zero2_fastpar"], pool, strict=True))
    goals = {g["name"]: g for g in data["summary"]["goals"]}
    state = goals["tiny: zero_fastpar optimizer state per rank <= 1.00x (1/N of unsharded + one bucket)"]
    assert state["met"] is True and state["value"] <= 1.0 and state["flagged"] is False
    grad_goal = goals[
        "tiny: zero2_fastpar gradients per rank <= 1.00x (1/N of the model's + the pool of buckets in flight)"
    ]
    assert grad_goal["met"] is True and grad_goal["flagged"] is False
    assert len(goals) == 5 and data["summary"]["goals_met"] == all(g["met"] for g in goals.values())


@pytest.mark.parametrize(
    "argv, message",
    [
        (["zero", "--nproc", "1"], "--nproc must be at least 2"),
        (["zero", "--models", "gpt"], "unknown model(s) ['gpt']"),
        (["zero", "--batch", "0"], "--batch must be at least 1"),
    ],
)
def test_zero_benchmark_refuses_what_cannot_run(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
