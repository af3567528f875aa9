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
    assert list((tmp_path / "checkpoints").glob("ckpt-*.pt"))


@pytest.mark.slow
def test_the_lm_benchmark_prints_its_table_on_the_smallest_run():
    done = _fastpar(
        "bench", "lm", "--model", "tiny", "--steps", "4", "--grad-accum", "2", "--rounds", "1", "--sharding", "ddp"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    for text in ("fastpar bench lm", "torch_ddp", "no_comm", "curve check", "IDENTICAL", "goal: fastpar >= 1.00x"):
        assert text in out, out
