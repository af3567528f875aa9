"""What fully_shard_model refuses before anything is sharded, with a message that says what to change: models
without parameters, unit classes that aren't in the model, parameters tied across units, float16 on CPU,
bad reshard and prefetch values, a model left on the meta device, no process group; and which units each
wrap policy picks."""

from __future__ import annotations

import pytest
import torch
from fsdp_training import Block, TinyTransformer, mlp_stack
from torch import nn

from fastpar.shard import WrapError, describe_units, fully_shard_model, precision_policy, select_units


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight


def test_auto_picks_repeated_blocks_and_the_root_last():
    assert select_units(TinyTransformer(), "auto") == ["layers.0", "layers.1", "layers.2", ""]
    assert select_units(mlp_stack(), "auto") == ["0", "1", "2", "3", ""]
    assert select_units(nn.Linear(4, 4), "auto") == [""]  # nothing repeats: one unit


def test_blocks_group_with_their_siblings_only():
    from fastpar.costmodel.fsdp_units import group_units

    units = ["enc.0", "enc.1", "enc.2", "dec.0", "dec.1", "dec.2", "dec.3"]
    assert group_units(units, 1) == [[u] for u in units]
    assert group_units(units, 2) == [["enc.0", "enc.1"], ["enc.2"], ["dec.0", "dec.1"], ["dec.2", "dec.3"]]
    assert group_units(units, 8) == [units[:3], units[3:]]  # never across two containers
    assert group_units(["0", "1", "2"], 2) == [["0", "1"], ["2"]]  # blocks of the root itself


def test_classes_names_sizes_and_callables_pick_units():
    model = TinyTransformer()
    assert select_units(model, [Block]) == select_units(model, "Block") == ["layers.0", "layers.1", "layers.2", ""]
    # a size threshold goes bottom-up: the head (1200) and each block's up/down Linears (1200) qualify
    assert "head" in select_units(model, 1200) and "layers.0.up" in select_units(model, 1200)
    assert select_units(model, lambda m: isinstance(m, nn.LayerNorm))[-1] == ""
    sizes = dict(describe_units(model, select_units(model, "auto")))
    assert sum(sizes.values()) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("model", "wrap", "says"),
    [
        (nn.ReLU(), "auto", "no parameters"),
        (TinyTransformer(), [nn.Conv2d], "no module of class ['Conv2d']"),
        (TinyTransformer(), "Attention", "use wrap='auto'"),
        (TinyTransformer(), [nn.GELU, Block], "no module of class ['GELU']"),
        (nn.Sequential(nn.Linear(2, 2), nn.ReLU()), [nn.ReLU], "have no parameters"),
        (TinyTransformer(), 0, "at least 1"),
        (TinyTransformer(), 3.5, "give 'auto'"),
    ],
)
def test_bad_wrap_inputs_are_refused_with_what_to_change(model, wrap, says):
    with pytest.raises(WrapError) as info:
        select_units(model, wrap)
    assert says in str(info.value)


def test_a_parameter_shared_across_units_goes_to_their_common_ancestor():
    """Not refused: the units that would split a tied parameter are left unwrapped (the root holds it), with a
    warning naming them; the other units stay."""
    with pytest.warns(UserWarning, match=r"not wrapping .*embed.* \(shares embed.weight\).*head"):
        units = select_units(Tied(), ["Linear", "Embedding"])
    assert units == ["layers.0", "layers.1", ""]
    from fsdp_training import shared_layer_stack

    with pytest.warns(UserWarning, match=r"not wrapping 1 \(shares 1.weight\); 3"):
        assert select_units(shared_layer_stack(), "auto") == ["0", "2", ""]
    # a common ancestor that is a unit itself holds the parameter: only the units below it are unwrapped
    nested = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Linear(4, 4))
    nested[0][1].weight = nested[0][0].weight
    with pytest.warns(UserWarning):
        assert select_units(nested, lambda m: isinstance(m, nn.Linear) or m is nested[0]) == ["0", "1", ""]


def test_a_tied_parameter_inside_one_unit_is_fine():
    assert select_units(Tied(), "auto") == ["layers.0", "layers.1", ""]  # embed and head both in the root


def test_precision_policies_and_float16_on_cpu():
    bf16 = precision_policy("bf16", torch.device("cpu"))
    assert (bf16.param_dtype, bf16.reduce_dtype, bf16.output_dtype) == (torch.bfloat16, torch.float32, torch.float32)
    assert precision_policy(None, torch.device("cpu")).param_dtype is None
    with pytest.raises(ValueError, match="use mixed_precision='bf16' on CPU"):
        precision_policy("fp16", torch.device("cpu"))
    with pytest.raises(ValueError, match="give None, 'bf16', 'fp16'"):
        precision_policy("int8", torch.device("cpu"))


def test_without_a_process_group_it_says_how_to_start_one():
    with pytest.raises(RuntimeError, match="init_process_group"):
        fully_shard_model(mlp_stack)


@pytest.fixture
def one_rank_group(no_process_group):
    import torch.distributed as dist

    from fastpar.launcher import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


@pytest.mark.parametrize(
    ("kwargs", "error", "says"),
    [
        ({"reshard_after_forward": 3}, ValueError, "divides the group's 1"),
        ({"reshard_after_forward": "yes"}, ValueError, "give True, False"),
        ({"prefetch": -1}, ValueError, "units to all-gather ahead"),
        ({"blocks_per_unit": 0}, ValueError, "number of blocks a unit holds"),
        ({"blocks_per_unit": True}, ValueError, "number of blocks a unit holds"),
        ({"mixed_precision": "fp16"}, ValueError, "on CPU"),
        ({"wrap": "Attention"}, WrapError, "no module of class"),
    ],
)
def test_bad_options_are_refused_before_sharding(one_rank_group, kwargs, error, says):
    model = mlp_stack()
    with pytest.raises(error, match=says):
        fully_shard_model(model, **kwargs)
    from torch.distributed.fsdp import FSDPModule

    assert not any(isinstance(m, FSDPModule) for m in model.modules())  # nothing was sharded


def test_a_model_on_meta_or_a_non_module_is_refused(one_rank_group):
    with torch.device("meta"):
        model = mlp_stack()
    with pytest.raises(ValueError, match="pass the function that builds it"):
        fully_shard_model(model)
    with pytest.raises(TypeError, match="builds one"):
        fully_shard_model(42)
    with pytest.raises(TypeError, match="not a torch.nn.Module"):
        fully_shard_model(lambda: 42)


def test_one_rank_shards_trains_and_reports_its_bytes(one_rank_group):
    from fastpar.shard import fsdp_memory_report

    model = fully_shard_model(mlp_stack, wrap="auto", prefetch=1)
    report = fsdp_memory_report(model)
    full = sum(p.numel() * 4 for p in model.parameters())
    assert report == {"parameters": full, "gradients": 0}
    model(torch.randn(3, 20)).sum().backward()
    assert fsdp_memory_report(model)["gradients"] == full
