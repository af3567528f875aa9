"""Resuming with another max_epochs: a finished run is extended on the re-planned LR schedule, a run that
already reaches max_epochs has nothing to do; the same through ``fastpar demo``. Plus the progress bar.

Single-process CPU runs (no worker processes), so these are quick.
"""

from __future__ import annotations

import functools
import io
import json

import pytest
import torch

from fastpar import cli
from fastpar.train import Trainer, TrainingOptions
from fastpar.train.progress import ProgressBar

N, BATCH = 96, 16
STEPS_PER_EPOCH = N // BATCH


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01)


def one_cycle(optimizer, total_steps: int):
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.01, total_steps=total_steps, pct_start=0.25)


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 6, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


def fit(tmp_path, epochs: int, resume: bool):
    opts = TrainingOptions(
        max_epochs=epochs,
        batch_size=BATCH,
        execution_environment="cpu",
        devices=1,
        log_every=1,
        progress_bar=False,
        output_dir=str(tmp_path / "out"),
        checkpoint_dir=str(tmp_path / "ckpt"),
        resume=resume,
        lr_scheduler=functools.partial(one_cycle, total_steps=epochs * STEPS_PER_EPOCH),
    )
    return Trainer(make_model, make_optimizer, torch.nn.functional.cross_entropy, data(), options=opts).fit()


def reference_lrs(total_steps: int) -> list[float]:
    """The LR after each step of a one-cycle schedule planned for ``total_steps`` from the start."""
    optimizer = make_optimizer([torch.nn.Parameter(torch.zeros(1))])
    schedule = one_cycle(optimizer, total_steps)
    lrs = []
    for _ in range(total_steps):
        optimizer.step()
        schedule.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


def test_finished_run_is_extended_on_the_replanned_schedule(tmp_path, capsys):
    first = fit(tmp_path, 3, resume=False)
    assert first.steps == 3 * STEPS_PER_EPOCH and first.start_step == 0

    extended = fit(tmp_path, 5, resume=True)  # before the fix: "Tried to step 19 times ... total steps is 18"
    out = capsys.readouterr().out
    assert "resuming from" in out and "at step 18 (3 of 5 epochs done)" in out
    assert "planned for 18 steps, now 30" in out
    assert extended.start_step == 18 and extended.steps == 30 and not extended.stopped_early
    assert extended.steps_this_call == 12 and 0 < extended.start_elapsed <= first.elapsed
    assert 0 < extended.elapsed_this_call < extended.elapsed
    lrs = reference_lrs(30)
    after = [r for r in extended.history if r["iteration"] > 18]
    assert [r["iteration"] for r in after] == list(range(19, 31))
    assert [r["lr"] for r in after] == pytest.approx([lrs[r["iteration"] - 1] for r in after], rel=1e-12)
    assert all(r["loss"] == r["loss"] for r in after)  # finite: training went on from the checkpoint
    assert [r["iteration"] for r in extended.history] == list(range(1, 31))  # metrics.jsonl kept the first 18

    again = fit(tmp_path, 5, resume=True)
    out = capsys.readouterr().out
    assert "nothing to do" in out and "already completes max_epochs=5" in out and "training on" not in out
    assert again.start_step == again.steps == 30 and len(again.history) == 30


def test_same_length_resume_restores_the_saved_schedule(tmp_path, capsys):
    fit(tmp_path, 2, resume=False)
    state = torch.load(sorted((tmp_path / "ckpt").glob("ckpt-*.pt"))[-1], weights_only=True)
    assert state["total_steps"] == 12 and state["scheduler"]["total_steps"] == 12
    shorter = fit(tmp_path, 1, resume=True)  # a run that is already past max_epochs: nothing to do either
    assert shorter.steps == shorter.start_step == 12 and "nothing to do" in capsys.readouterr().out


def test_demo_extends_a_finished_run_and_then_has_nothing_to_do(tmp_path, capsys):
    base = [
        "demo",
        "--dir",
        str(tmp_path / "demo"),
        "--environment",
        "cpu",
        "--devices",
        "1",
        "--classes",
        "2",
        "--per-class",
        "16",
        "--batch-size",
        "4",
        "--image-size",
        "16",
    ]
    assert cli.main([*base, "--epochs", "1"]) == 0
    out = capsys.readouterr().out
    assert f"to {tmp_path / 'demo'} (--dir)" in out.splitlines()[0] and "MB)" in out.splitlines()[0]
    assert "validation accuracy" in out

    assert cli.main([*base, "--epochs", "2", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "planned for 8 steps, now 16" in out and "validation accuracy" in out
    records = [json.loads(line) for line in (tmp_path / "demo" / "output" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["iteration"] == 16 and records[-1]["epoch"] == 1

    assert cli.main([*base, "--epochs", "2", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "fastpar demo: nothing to do (2 of 2 epochs done)" in out and "throughput" not in out


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


RECORD = {"epoch": 0, "iteration": 5, "loss": 0.5, "accuracy": 0.75, "samples_per_s": 100.0, "val_accuracy": 0.5}


def test_progress_bar_is_tqdm_in_a_terminal_and_plain_lines_in_a_log():
    pytest.importorskip("tqdm")
    terminal = _Terminal()
    bar = ProgressBar(10, 2, stream=terminal)
    bar.update(RECORD)
    bar.close()
    text = terminal.getvalue()
    assert "\r" in text and "5/10" in text and "epoch 1/2" in text and "acc 75.0%" in text and "val_acc 50.0%" in text

    log = io.StringIO()  # not a terminal: one complete line per update, no carriage returns
    bar = ProgressBar(10, 2, stream=log)
    bar.update(RECORD)
    bar.update({**RECORD, "iteration": 10, "epoch": 1})
    bar.close()
    lines = log.getvalue().splitlines()
    assert len(lines) == 2 and "\r" not in log.getvalue()
    assert lines[0].startswith("epoch 1/2  step 5/10 [") and "loss 0.5000  acc 75.0%" in lines[0]
    assert lines[1].startswith("epoch 2/2  step 10/10 [########################]")


def test_demo_summary_says_this_calls_numbers_apart_from_the_whole_runs():
    from fastpar.train.demo import summary_line
    from fastpar.train.trainer import TrainingResult

    fresh = TrainingResult(None, [], None, None, [], False, steps=60, elapsed=14.0)
    assert summary_line(fresh, 850.0, 2) == "throughput 850 samples/s on 2 process(es); 60 steps in 14.0 s of training"
    resumed = TrainingResult(
        None, [], None, None, [], False, steps=120, elapsed=30.0, start_step=60, start_elapsed=14.0
    )
    assert summary_line(resumed, 850.0, 2) == (
        "throughput 850 samples/s on 2 process(es); 60 steps in 16.0 s of training this time "
        "(resumed at step 60; the whole run: 120 steps in 30.0 s)"
    )
