"""``TrainingOptions(shard_optimizer=True)``: the Trainer's 2-rank run with ZeRO-1 (AdamW, clipping, a one-cycle
schedule) ends bit-identical to the same run with the unsharded optimizer, writes checkpoints a plain optimizer
loads, and resumes exactly from a mid-run checkpoint."""

from __future__ import annotations

import functools
import shutil

import pytest
import torch
from test_train import CLASSES, STEPS, TRAIN, VAL, assert_same_parameters, make_model

from fastpar.train import Trainer, TrainingOptions
from fastpar.train.resume import single_file_state
from fastpar.user_errors import OptionError


class WithUnusedLayer(torch.nn.Module):
    """A model whose ``unused`` layer never gets a gradient (needs find_unused_parameters=True)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.unused, self.last = (
            torch.nn.Linear(8, 32),
            torch.nn.Linear(32, 32),
            torch.nn.Linear(32, CLASSES),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.relu(self.first(x)))


def make_adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.05)


def one_cycle(optimizer, total_steps: int):
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.02, total_steps=total_steps, pct_start=0.3)


def fit(tmp, model=make_model, **overrides):
    base = dict(
        max_epochs=2,
        batch_size=16,
        execution_environment="cpu",
        devices=2,
        ddp="fastpar",
        log_every=4,
        validation_data=VAL,
        output_dir=str(tmp / "out"),
        progress_bar=False,
        grad_clip_norm=0.5,
        lr_scheduler=functools.partial(one_cycle, total_steps=STEPS),
    )
    options = TrainingOptions(**{**base, **overrides})
    return Trainer(model, make_adamw, torch.nn.functional.cross_entropy, TRAIN, options=options).fit()


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero")
    return fit(tmp, shard_optimizer=True, checkpoint_dir=str(tmp / "ck"), checkpoint_every=6, keep_checkpoints=9), tmp


@pytest.mark.slow
def test_sharded_run_equals_the_unsharded_run(sharded_run, tmp_path):
    result, _ = sharded_run
    plain = fit(tmp_path)
    assert result.steps == plain.steps == STEPS
    assert_same_parameters(result.model, plain.model)
    assert [r["loss"] for r in result.history] == [r["loss"] for r in plain.history]
    assert [r["lr"] for r in result.history] == [r["lr"] for r in plain.history]


@pytest.mark.slow
def test_checkpoint_holds_the_full_state_a_plain_optimizer_loads(sharded_run):
    """ZeRO writes a sharded folder (every rank its slices); consolidated into one file it is the plain
    optimizer's state."""
    _, tmp = sharded_run
    state = single_file_state(tmp / "ck" / "ckpt-000000012")
    model = make_model()
    model.load_state_dict(state["model"])
    plain = make_adamw(model.parameters())
    plain.load_state_dict(state["optimizer"])
    assert len(plain.state) == 4
    for p in model.parameters():
        assert plain.state[p]["exp_avg"].shape == p.shape and float(plain.state[p]["step"]) == 12.0


@pytest.mark.slow
def test_resume_from_a_mid_run_checkpoint_is_exact(sharded_run, tmp_path):
    result, tmp = sharded_run
    (tmp_path / "ck").mkdir()
    shutil.copytree(tmp / "ck" / "ckpt-000000012", tmp_path / "ck" / "ckpt-000000012")
    resumed = fit(tmp_path, shard_optimizer=True, checkpoint_dir=str(tmp_path / "ck"), resume=True)
    assert resumed.start_step == 12 and resumed.steps == STEPS
    assert_same_parameters(resumed.model, result.model)
    after = [r["loss"] for r in resumed.history if r["iteration"] > 12]
    assert after == [r["loss"] for r in result.history if r["iteration"] > 12]


def test_shard_optimizer_needs_fastpars_ddp():
    with pytest.raises(OptionError, match="shard_optimizer"):
        TrainingOptions(shard_optimizer=True, ddp="torch")


@pytest.mark.slow
def test_unused_parameter_trains_and_clipping_keeps_the_used_parameters_identical(tmp_path):
    """A parameter no rank uses has no gradient: torch's clipping leaves it out of the total norm, so the sharded
    norm must too (an extra 0 among the norms changed the clip coefficient's last bit, and every used parameter
    after it). The unused layer itself is not stepped, under ZeRO as by torch's AdamW."""
    runs = [
        fit(
            tmp_path / str(shard),
            model=WithUnusedLayer,
            max_epochs=1,
            find_unused_parameters=True,
            shard_optimizer=shard,
            grad_clip_norm=0.05,
        )
        for shard in (False, True)
    ]
    plain, sharded = (run.model.state_dict() for run in runs)
    for name in plain:
        assert torch.equal(plain[name], sharded[name]), f"{name} differs"
    torch.manual_seed(0)
    assert torch.equal(plain["unused.weight"], WithUnusedLayer().unused.weight)  # torch's AdamW skipped it
