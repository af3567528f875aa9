"""The planner's peak is the largest of a step's moments (backward's start, the largest gradient's arrival, the
optimizer step), not the sum of everything; FSDP2's units are priced as ``fully_shard_model`` picks them."""

from __future__ import annotations

import pytest
from torch import nn

from fastpar.costmodel.fsdp_units import unit_numels
from fastpar.costmodel.model_spec import Layer
from fastpar.costmodel.strategy_memory import (
    DtypeSizes,
    StepMoments,
    bucket_members,
    optimizer_temporaries,
    step_peak,
    strategy_memory,
)
from fastpar.shard.wrap_policy import select_units


def test_the_peak_is_the_largest_moment_not_the_sum():
    acts, outputs = [10.0, 20.0, 30.0], [5.0, 5.0, 8.0]
    start = 60 + 2 * 8 + 5  # every activation, the loss's gradient (2 x the last output) and the one leaving it
    assert step_peak(StepMoments(100, 100, 100), acts, outputs, 0) == (100 + start, "backward's start")
    # a large gradient arriving late in backward (first layer): only layer 0's activations remain
    assert step_peak(StepMoments(100, 200, 100), acts, outputs, 0) == (200, "the largest gradient in backward")
    assert step_peak(StepMoments(100, 200, 100), acts, outputs, 1) == (210, "the largest gradient in backward")
    assert step_peak(StepMoments(100, 100, 300), acts, outputs, 0) == (300, "the optimizer step")


def test_the_gradient_curve_can_exceed_backward_start():
    # a wide middle layer: its output's gradient and its input's meet while the layers before it still hold theirs
    acts, outputs = [1.0, 1.0, 1.0], [1.0, 50.0, 1.0]
    value, where = step_peak(StepMoments(0, 0, 0), acts, outputs, 0)
    assert where == "backward's start" and value == 3 + 2 * 1 + 50  # the last layer's input gradient is the wide one


def test_adam_temporaries_and_sgd_in_place():
    assert optimizer_temporaries("adamw", 100, 60, 4, cpu=True) == 480  # sqrt and its quotient, per tensor
    assert optimizer_temporaries("adamw", 100, 60, 4, cpu=False) == 400
    assert optimizer_temporaries("sgd-momentum", 100, 60, 4, cpu=True) == 0


def _layers():
    return [
        Layer("embed", 1000 * 16, False, ((1000, 16),)),
        *(Layer(f"blocks.{i}", 16 * 16, True, ((16, 16),)) for i in range(4)),
    ]


@pytest.mark.parametrize(
    "strategy, moment",
    [
        ("ddp", "the optimizer step"),  # AdamW's temporaries over the whole model
        ("zero1", "the largest gradient in backward"),  # autograd's embedding gradient beside its scratch
        ("zero2", "the largest gradient in backward"),
        ("fsdp", "the largest gradient in backward"),  # the gathered embedding and its unsharded gradient
    ],
)
def test_an_embedding_model_peaks_after_backward_start(strategy, moment):
    """A large embedding and tiny activations: the peak comes after backward's start, where the sum of the parts
    put it (measured on the bench's embedding model: DDP in AdamW's step, ZeRO and FSDP at the embedding's
    gradient)."""
    layers = _layers()
    kwargs = dict(
        devices=2,
        optimizer="adamw",
        sizes=DtypeSizes(),
        buckets=bucket_members(layers, 25 * 2**20, 2**20, 4),
        cpu_exchange=True,
        options={},
    )
    acts, outputs = [64.0] * 5, [32.0] * 5
    plain = strategy_memory(strategy, layers, acts, **kwargs)
    by_moment = strategy_memory(strategy, layers, acts, outputs=outputs, **kwargs)
    assert plain.peak is None and by_moment.peak is not None
    assert by_moment.peak_at == moment
    assert f"peak at {by_moment.peak_at}" in by_moment.notes
    assert by_moment.total == by_moment.peak


def test_fsdp_units_are_the_blocks_fully_shard_model_wraps():
    """nn.Transformer has its own forward, so the planner's layers see it as one; its encoder and decoder layers
    are the units fully_shard_model makes, and the planner prices those."""
    model = nn.Transformer(d_model=32, nhead=2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=64)
    model = nn.ModuleDict({"embed": nn.Embedding(100, 32), "transformer": model})
    root, units = unit_numels(model)
    chosen = [name for name in select_units(model) if name]
    assert len(units) == len(chosen) == 4
    sizes = [sum(p.numel() for p in model.get_submodule(name).parameters()) for name in chosen]
    assert sorted(units) == sorted(sizes)
    assert root + sum(units) == sum(p.numel() for p in model.parameters())


def test_a_tied_parameter_is_counted_once():
    emb = nn.Embedding(10, 4)
    model = nn.Sequential(emb, nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Linear(4, 10, bias=False))
    model[2].weight = emb.weight
    root, units = unit_numels(model)
    assert units == [20, 20] and root == 40
    assert root + sum(units) == sum(p.numel() for p in model.parameters())
