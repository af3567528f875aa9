"""``fastpar lm-demo``, its model and ``fastpar bench lm``: the GPT's tied weights and causal masking, the demo's
pass/fail report, and (slow) the quick demo and the smallest benchmark as a user runs them."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from fastpar.train.gpt import GPT, GPTConfig, lm_loss
from fastpar.train.lm_demo import _report, stdlib_sources, warmup_cosine

ROOT = Path(__file__).resolve().parents[2]
TINY = GPTConfig(seq_len=16, n_layer=2, n_head=2, n_embd=32)


def _fastpar(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "fastpar", *argv], capture_output=True, text=True, env=env, timeout=timeout
    )


def test_the_lm_head_is_the_token_embedding():
    model = GPT(TINY)
    assert model.lm_head.weight is model.wte.weight
    names = [name for name, _ in model.named_parameters()]
    assert "lm_head.weight" not in names  # one tensor, counted once
    assert model.num_parameters() == sum(p.numel() for p in model.parameters())
    x = torch.randint(0, TINY.vocab_size, (2, 16))
    lm_loss(model(x), x).backward()
    assert model.wte.weight.grad is not None  # the head's gradient lands on the embedding


def test_a_later_token_never_changes_earlier_logits():
    torch.manual_seed(0)
    model = GPT(TINY).eval()
    x = torch.randint(0, TINY.vocab_size, (3, 16))
    changed = x.clone()
    changed[:, 9] = (changed[:, 9] + 1) % TINY.vocab_size
    with torch.no_grad():
        before, after = model(x), model(changed)
    assert before.shape == (3, 16, TINY.vocab_size)
    assert torch.equal(before[:, :9], after[:, :9])
    assert not torch.allclose(before[:, 9:], after[:, 9:])


def test_the_initial_loss_is_near_uniform_and_long_inputs_are_refused():
    torch.manual_seed(0)
    x, y = torch.randint(0, TINY.vocab_size, (2, 4, 16))
    assert lm_loss(GPT(TINY)(x), y).item() == pytest.approx(torch.log(torch.tensor(257.0)).item(), abs=0.1)
    with pytest.raises(ValueError, match="longer than the model's seq_len"):
        GPT(TINY)(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="multiple of n_head"):
        GPTConfig(n_embd=30, n_head=4)


def test_the_text_is_the_standard_librarys_sorted_sources():
    files = stdlib_sources(0.2)
    assert [f.name for f in files] == sorted(f.name for f in files) and all(f.suffix == ".py" for f in files)
    assert sum(f.stat().st_size for f in files[:-1]) < 0.2e6 <= sum(f.stat().st_size for f in files)


def test_the_schedule_warms_up_then_decays_to_a_tenth():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    schedule = warmup_cosine(opt, total_steps=100, warmup=10)
    lrs = []
    for _ in range(100):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        schedule.step()
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0) and lrs[-1] == pytest.approx(0.1, abs=0.01)


def _result(val_loss: float | None) -> types.SimpleNamespace:
    history = [{"iteration": 10, "loss": 3.0, "tokens_per_s": 1000.0, "val_loss": val_loss}]
    return types.SimpleNamespace(
        history=history,
        sharding="ddp",
        steps=10,
        elapsed=1.0,
        plot_path="p.png",
        metrics_path="m.jsonl",
        logger_paths={"tensorboard": "tb"},
        checkpoints=[],
        last=lambda key: history[-1].get(key),
    )


def test_a_val_loss_at_or_above_the_threshold_fails_saying_so(capsys):
    assert _report(_result(2.4), steps=10, threshold=2.5, wall=1.0) == 0
    assert "PASSED" in capsys.readouterr().out
    assert _report(_result(2.5), steps=10, threshold=2.5, wall=1.0) == 1
    err = capsys.readouterr().err
    assert "FAILED: final val loss 2.500 is not below the threshold 2.5" in err and "--steps" in err
    assert _report(_result(None), steps=10, threshold=2.5, wall=1.0) == 1


@pytest.mark.slow
def test_the_quick_demo_trains_logs_and_passes(tmp_path):
    done = _fastpar("lm-demo", "--quick", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "val loss" in out and "tokens/s" in out and "PASSED" in out
    assert f"tensorboard    {tmp_path / 'output' / 'tensorboard'}" in out
    assert list((tmp_path / "output" / "tensorboard").glob("events.out.tfevents.*"))
    assert (tmp_path / "output" / "metrics.csv").is_file() and (tmp_path / "output" / "training-progress.png").is_file()
    # sharding='auto' picks ddp (single files) or zero1/zero2 (DCP folders) by the memory planner
    printed = next(line for line in out.splitlines() if line.startswith("checkpoints "))
    saved = [Path(p.strip()) for p in printed.split(None, 1)[1].split(",")]
    assert saved and all(
        p.parent == tmp_path / "checkpoints" and p.name.startswith("ckpt-") and p.exists() for p in saved
    )


@pytest.mark.slow
def test_the_lm_benchmark_prints_its_table_on_the_smallest_run():
    done = _fastpar(
        "bench", "lm", "--model", "tiny", "--steps", "4", "--grad-accum", "2", "--rounds", "1", "--sharding", "ddp"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    for text in ("fastpar bench lm", "torch_ddp", "no_comm", "curve check", "IDENTICAL", "goal: fastpar >= 1.00x"):
        assert text in out, out


def _lm_context(*argv: str):
    from fastpar.bench.cli import BENCHMARKS, prepare

    return prepare("lm", list(argv), {**BENCHMARKS, "lm": "fastpar.train.bench_lm"})


def test_the_lm_benchmark_states_its_goal_and_flags_a_run_faster_than_its_floor():
    from fastpar.train import bench_lm

    module, ctx = _lm_context("--model", "tiny", "--steps", "6")
    model = {"vocab_size": 257, "seq_len": 32, "n_layer": 1, "n_head": 2, "n_embd": 32}
    spec = bench_lm.RunSpec(model, 4, 2, 6, 3e-3, False, "unused.bin", log_every=1)

    def runs(fastpar: float) -> dict:
        speeds = {"fastpar": fastpar, "torch_ddp": 1000.0, "no_comm": 1200.0}
        return {name: [{"tokens_per_s": s, "last_loss": 3.0, "sharding": "ddp"}] for name, s in speeds.items()}

    report = bench_lm._report(ctx, spec, 2, runs(1100.0), "curve check: ... -> IDENTICAL", cpus=2)
    assert report.goals[0].line() == "goal: fastpar >= 1.00x torch_ddp: 1.10x (1100 vs 1000 tokens/s) -> MET"
    assert [row["variant"] for row in report.rows] == ["fastpar", "torch_ddp", "no_comm"]
    assert any(line.startswith("peer: torch_ddp") for line in report.footer)
    assert any(line.startswith("floor: no_comm") for line in report.footer)
    assert bench_lm._report(ctx, spec, 2, runs(900.0), "", cpus=2).goals[0].state == "NOT MET"
    assert bench_lm._report(ctx, spec, 2, runs(1300.0), "", cpus=2).goals[0].state == "IMPOSSIBLE"


def test_the_curve_check_refuses_runs_that_differ():
    from fastpar.bench.harness import WrongResultError
    from fastpar.train.bench_lm import _check_curves

    params = {"w": torch.ones(3)}
    same = _check_curves({"losses": [3.0, 2.5], "params": params}, {"losses": [3.0, 2.5], "params": params})
    assert "IDENTICAL" in same
    with pytest.raises(WrongResultError, match="largest loss difference"):
        _check_curves({"losses": [3.0, 2.5], "params": params}, {"losses": [3.0, 2.6], "params": params})
    with pytest.raises(WrongResultError, match=r"parameters that differ: \['w'\]"):
        _check_curves({"losses": [3.0], "params": params}, {"losses": [3.0], "params": {"w": torch.zeros(3)}})


def test_the_lm_benchmark_is_on_the_bench_command_line(capsys):
    from fastpar.cli import bench_main

    assert bench_main(["lm", "--help"]) == 0
    out = capsys.readouterr().out
    assert "nanoGPT-style torch DDP loop" in out and "--grad-accum" in out and "--sharding" in out
    assert bench_main(["lm", "-n", "2"]) == 2  # one call is one whole run
