"""``sharding="auto"`` turns activation checkpointing on when that is what makes the model fit: the planner
prices each strategy with and without it (activations shrink to the blocks' inputs plus one block recomputed,
the step grows by the blocks' forward), the Trainer applies the choice, and the result is the same bits as the
same strategy without checkpointing."""

from __future__ import annotations

import re

import pytest
import torch
from test_train import CLASSES, assert_same_parameters, blobs
from torch import nn

from fastpar.costmodel.memory_planner import STRATEGIES, plan_for_module
from fastpar.train import Trainer, TrainingOptions, loss_from_batch
from fastpar.train.batches import Objective

DATA = blobs(64, seed=5)
BATCH = 16


class Block(nn.Module):
    def __init__(self, width: int = 64, hidden: int = 256) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x)))


class Tokens(nn.Module):
    """8 features -> 256 tokens of width 64 -> 4 blocks per token -> mean -> classes: activations (~38 MiB at
    16 samples) dwarf the parameters (~1 MiB)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 256 * 64)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(64, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).view(x.shape[0], 256, 64)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(1))


def make_tokens() -> nn.Module:
    return Tokens()


def _cross_entropy(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


cross_entropy = loss_from_batch(_cross_entropy)  # this loss form leaves the pipeline out of the plan


def make_adamw(params):
    return torch.optim.AdamW(params, lr=0.01)


def _fit(tmp, **overrides):
    options = TrainingOptions(
        max_epochs=1,
        batch_size=BATCH,
        execution_environment="cpu",
        devices=2,
        cpu_backend="gloo",
        output_dir=str(tmp / "out"),
        progress_bar=False,
        seed=7,
        **overrides,
    )
    return Trainer(make_tokens, make_adamw, cross_entropy, DATA, options=options).fit()


def _budget_between() -> int:
    """A memory budget that no strategy meets without checkpointing and some meet with it (the Trainer's plan:
    the same model, batch and loss form)."""
    torch.manual_seed(7)
    module = make_tokens()
    probed, inputs, loss = Objective(cross_entropy).for_planner(module, (DATA[0][:BATCH], DATA[1][:BATCH]))
    plan = plan_for_module(
        probed,
        inputs,
        loss=loss,
        devices=2,
        device_memory="1TB",
        backend="gloo",
        strategies=[s for s in STRATEGIES if s != "pipeline"],
    )
    plain = min(e.memory.total for e in plan.estimates if not e.options.get("activation_checkpointing"))
    checkpointed = min(e.memory.total for e in plan.estimates if e.options.get("activation_checkpointing"))
    assert checkpointed < 0.6 * plain  # what the planner prices: the blocks' activations mostly gone
    return int((plain + checkpointed) / 2 / 0.9)  # usable memory is 90% of the budget


@pytest.mark.slow
def test_auto_checkpoints_when_only_that_fits_and_keeps_the_bits(tmp_path, capfd):
    budget = _budget_between()
    auto = _fit(tmp_path / "auto", sharding="auto", memory_budget=budget)
    out = capfd.readouterr().out
    chosen = re.search(r"sharding='auto' chose '(\w+)' (\{.*\})", out)
    assert chosen is not None and "'activation_checkpointing': True" in chosen.group(2), out
    strategy = chosen.group(1)
    assert strategy in ("ddp", "zero1", "zero2", "fsdp")
    plain = _fit(tmp_path / "plain", sharding=strategy)
    assert auto.steps == plain.steps == 2
    assert_same_parameters(auto.model, plain.model)  # checkpointing recomputes, it does not change a bit


def test_the_planner_prices_checkpointing_only_where_it_can():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    plan = plan_for_module(
        Tokens(), x, loss=lambda out, b: out.square().mean(), devices=2, device_memory="1TB", backend="gloo"
    )
    labels = [e.label for e in plan.estimates]
    assert (
        "ddp ckpt" in labels
        and "fsdp reshard ckpt" in labels
        and not any("pipeline" in s and "ckpt" in s for s in labels)
    )
    by = {e.label: e for e in plan.estimates}
    assert by["ddp ckpt"].memory.total < by["ddp"].memory.total and by["ddp ckpt"].step_s > by["ddp"].step_s
    # a model without repeated blocks: nothing to checkpoint, nothing priced
    flat = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.LayerNorm(16))
    plan = plan_for_module(flat, x, loss=lambda out, b: out.square().mean(), devices=2, device_memory="1TB")
    assert not any(e.options.get("activation_checkpointing") for e in plan.estimates)
    only = plan_for_module(
        Tokens(), x, loss=lambda o, b: o.square().mean(), devices=2, device_memory="1TB", activation_checkpointing=True
    )
    assert all(e.options.get("activation_checkpointing") for e in only.estimates if e.strategy != "pipeline")
