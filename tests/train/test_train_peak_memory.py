"""``TrainingOptions(measure_peak_memory=True)``: the Trainer measures its first step's peak on every process
(torch's MemTracker on CPU) and reports the highest in ``TrainingResult.peak_memory_bytes``."""

from __future__ import annotations

import pytest
import torch
from test_train import TRAIN

from fastpar.train import Trainer, TrainingOptions


def make_wide_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 256), torch.nn.ReLU(), torch.nn.Linear(256, 3))


def make_adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01)


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["ddp", "zero2", "fsdp"])
def test_trainer_reports_the_first_steps_peak_per_process(sharding, tmp_path):
    options = TrainingOptions(
        max_epochs=1,
        batch_size=16,
        execution_environment="cpu",
        devices=2,
        ddp="fastpar",
        sharding=sharding,
        measure_peak_memory=True,
        log_every=100,
        output_dir=str(tmp_path / "out"),
        progress_bar=False,
    )
    result = Trainer(make_wide_model, make_adamw, torch.nn.functional.cross_entropy, TRAIN, options=options).fit()
    peak = result.peak_memory_bytes
    assert set(peak) == {"total", "state", "rank"} and peak["rank"] in (0, 1)
    param_bytes = sum(p.numel() for p in make_wide_model().parameters()) * 4
    # the step holds at least this rank's parameters, their gradients and AdamW's two moments at its end: all of
    # them under DDP, the gradients and moments halved under ZeRO-2 (P + 3P/2), everything halved under FSDP
    least = {"ddp": 4 * param_bytes, "zero2": param_bytes + 3 * param_bytes // 2, "fsdp": 2 * param_bytes}[sharding]
    assert peak["total"] >= peak["state"] >= least > 0
    assert peak["total"] >= result.model_state_bytes["total"], (peak, result.model_state_bytes)
    # and not much more: the activations of 16 samples and the optimizer's temporaries
    assert peak["total"] < peak["state"] + 4 * param_bytes + (1 << 20), (peak, param_bytes)


def test_peak_memory_is_not_measured_unless_asked(tmp_path):
    options = TrainingOptions(
        max_epochs=1, batch_size=64, execution_environment="cpu", devices=1, output_dir=str(tmp_path / "out")
    )
    options.progress_bar = False
    result = Trainer(make_wide_model, make_adamw, torch.nn.functional.cross_entropy, TRAIN, options=options).fit()
    assert result.peak_memory_bytes is None
