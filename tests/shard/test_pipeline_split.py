"""Split points and the checks before the first step: the balanced split from measured costs (and under a
memory limit), explicit splits, the pipelines refused with what to change, what counts as a model's layers, and
what measuring a layer reports (without touching the user's layers or random numbers)."""

from __future__ import annotations

import pytest
import torch
from pipeline_training import Blocks, build
from torch import nn

from fastpar.launcher import spawn
from fastpar.shard import (
    LayerCost,
    PipelineConfigError,
    StageLayers,
    check_pipeline_shape,
    choose_split,
    model_layers,
    profile_layers,
)


def _costs(seconds, param_bytes=None, activation_bytes=None):
    n = len(seconds)
    param_bytes = param_bytes or [0] * n
    activation_bytes = activation_bytes or [0] * n
    return [
        LayerCost(str(i), s, p, a, (2, 4), torch.float32)
        for i, (s, p, a) in enumerate(zip(seconds, param_bytes, activation_bytes, strict=True))
    ]


def _split(costs, **kw):
    args = {"stages": 2, "microbatches": 4, "schedule": "1f1b", **kw}
    return choose_split(costs, **args)


def test_auto_split_minimises_the_slowest_stage():
    assert _split(_costs([1.0] * 8)).points == (4,)
    assert _split(_costs([1, 1, 1, 1, 4])).points == (4,)  # 4 | 4
    split = _split(_costs([3, 1, 1, 1, 1, 1]), stages=3)
    # 3 | 3 and 3 | 2 | 3 tie on the slowest stage: the earliest cut is kept, the same on every run
    assert split.points == (1, 3) and split.stage_seconds == (3, 2, 3)
    assert split.chosen == "auto" and list(split.stage_layers(2)) == [3, 4, 5]


def test_interleaved_split_has_a_stage_per_rank_and_virtual_stage():
    split = _split(_costs([1.0] * 8), virtual_stages=2, schedule="interleaved-1f1b")
    assert split.points == (2, 4, 6) and split.num_stages == 4


def test_memory_limit_moves_the_split_and_predicts_bytes():
    # layer 0 is heavy in parameters: balancing time alone puts two layers on stage 0
    costs = _costs([1, 1, 1, 1], param_bytes=[100, 10, 10, 10], activation_bytes=[5, 5, 5, 5])
    assert _split(costs).points == (2,)
    # params + grads + AdamW's two states = 4 x params, plus activations of the in-flight microbatches:
    # at rank 0 of 2 under 1F1B, 2 microbatches in flight
    assert _split(costs).stage_bytes == (4 * 110 + 2 * 10, 4 * 20 + 1 * 10)
    limited = _split(costs, memory_limit_bytes=420)
    assert limited.points == (1,) and max(limited.stage_bytes) <= 420
    # GPipe holds all four microbatches' activations
    assert _split(costs, schedule="gpipe").stage_bytes[1] == 4 * 20 + 4 * 10
    with pytest.raises(PipelineConfigError, match="no split of 4 layers into 2 stages fits"):
        _split(costs, memory_limit_bytes=300)


def test_explicit_split_is_checked_and_kept():
    costs = _costs([1.0] * 6)
    split = _split(costs, split=[1])
    assert split.points == (1,) and split.chosen == "explicit" and split.stage_seconds == (1.0, 5.0)
    for bad in ([0], [6], [2, 3], []):
        with pytest.raises(PipelineConfigError, match="increasing layer indices"):
            _split(costs, split=bad)
    with pytest.raises(PipelineConfigError, match="split must be 'auto'"):
        _split(costs, split="even")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"num_layers": 3, "stages": 4, "world_size": 4}, "fewer than the 4 stages"),
        ({"num_layers": 5, "virtual_stages": 3, "schedule": "interleaved-1f1b"}, r"2 stages x 3 virtual stages"),
        ({"microbatches": 1}, "1F1B needs at least as many microbatches as stages"),
        ({"microbatches": 5, "schedule": "interleaved-1f1b", "virtual_stages": 2}, "multiple of 2"),
        ({"world_size": 3}, "use stages that divide 3"),
        ({"virtual_stages": 2}, "needs schedule='interleaved-1f1b'"),
        ({"schedule": "zero-bubble"}, "schedule must be one of"),
    ],
)
def test_pipelines_that_cannot_run_are_refused_with_what_to_change(args, message):
    full = {
        "num_layers": 8,
        "stages": 2,
        "virtual_stages": 1,
        "microbatches": 4,
        "schedule": "1f1b",
        "world_size": 2,
        **args,
    }
    with pytest.raises(PipelineConfigError, match=message):
        check_pipeline_shape(**full)


def test_model_layers_of_a_sequential_and_of_a_module_with_a_module_list():
    assert model_layers(build("mlp")).names == tuple(str(i) for i in range(8))
    layers = model_layers(Blocks())
    assert layers.names == ("embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head")
    assert not layers.is_sequential


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x)) + x  # not its children applied in order


class _LooseParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.a = nn.Linear(4, 4)


def test_models_that_are_not_a_sequence_of_layers_are_refused():
    model = _Residual()
    with pytest.raises(PipelineConfigError, match="not its layers .a, b. applied in order.*nn.Sequential"):
        profile_layers(model, model_layers(model), torch.randn(2, 4), torch.device("cpu"))
    with pytest.raises(PipelineConfigError, match="parameters outside its child modules .scale."):
        model_layers(_LooseParameter())
    with pytest.raises(PipelineConfigError, match="no child modules"):
        model_layers(nn.Linear(2, 2))


def test_profile_measures_copies_and_leaves_random_numbers_alone():
    model = Blocks()
    layers = model_layers(model)
    tokens = torch.randint(0, 32, (2, 5))
    rng = torch.get_rng_state()
    costs = profile_layers(model, layers, tokens, torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    assert [c.name for c in costs] == list(layers.names)
    assert costs[0].param_bytes == 32 * 24 * 4 and costs[-1].output_shape == (2, 5, 6)
    assert all(c.seconds > 0 for c in costs)
    # a block saves its LayerNorm/Linear/GELU inputs for backward: at least its input, (2, 5, 24) fp32
    assert all(c.activation_bytes >= 2 * 5 * 24 * 4 for c in costs[1:5])


def test_stage_layers_keep_the_state_dict_names_of_the_model():
    model = Blocks()
    layers = model_layers(model)
    stage = StageLayers(list(zip(layers.names, layers.modules, strict=True))[2:])
    original = model.state_dict()
    assert set(stage.state_dict()) < set(original)
    assert all(torch.equal(v, original[k]) for k, v in stage.state_dict().items())
    x = torch.randn(2, 5, 24)
    assert torch.equal(stage(x), model.head(model.blocks[3](model.blocks[2](model.blocks[1](x)))))


def _bad_split_rank(rank: int, world: int) -> str:
    import fastpar.shard as shard

    try:
        shard.pipeline_model(
            build("mlp"),
            stages=2,
            loss_fn=nn.functional.mse_loss,
            microbatches=2,
            example_input=torch.randn(4, 12),
            split=[9],
        )
    except PipelineConfigError as exc:
        return str(exc)
    return "built"


@pytest.mark.slow
def test_a_bad_split_is_refused_on_every_rank_before_the_first_step():
    messages = spawn(_bad_split_rank, 2, timeout=300)
    assert all("increasing layer indices" in m for m in messages), messages


@pytest.fixture
def one_rank_group(no_process_group):
    import torch.distributed as dist

    from fastpar.launcher import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield


def test_a_step_batch_the_stages_were_not_built_for_is_refused(one_rank_group):
    import fastpar.shard as shard

    x, y = torch.randn(8, 12), torch.randn(8, 6)
    model = build("mlp")
    pipelined = shard.pipeline_model(model, stages=1, loss_fn=nn.functional.mse_loss, microbatches=4, example_input=x)
    with pytest.raises(PipelineConfigError, match="do not split into 4 equal microbatches.*drop_last=True"):
        pipelined.step(torch.randn(6, 12), torch.randn(6, 6))
    with pytest.raises(PipelineConfigError, match=r"built for batches of shape \[8, 12\].*got \[12, 12\]"):
        pipelined.step(torch.randn(12, 12), torch.randn(12, 6))
    # one stage is the one-process loop itself: same loss and gradients, bit for bit
    loss = pipelined.step(x, y)
    reference = build("mlp")
    total = None
    for xm, ym in zip(x.tensor_split(4), y.tensor_split(4), strict=True):
        part = nn.functional.mse_loss(reference(xm), ym) / 4
        part.backward()
        total = part.detach() if total is None else total + part.detach()
    assert torch.equal(loss, total)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(pipelined.parameters(), reference.parameters(), strict=True))
    nbytes = 4 * sum(p.numel() for p in model.parameters())
    assert shard.pipeline_memory_report(pipelined) == {"parameters": nbytes, "gradients": nbytes}
