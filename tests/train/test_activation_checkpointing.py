"""Activation checkpointing (fastpar.shard.checkpoint_activations and TrainingOptions.activation_checkpointing):
the same bits as without it -- dropout included -- fewer bytes saved for backward, names unchanged; in the Trainer
under DDP, ZeRO-2 and FSDP2 on 2 processes, bit-identical to a torch DDP loop without it."""

from __future__ import annotations

import pytest
import test_train_batches as tb
import torch
from torch import nn

from fastpar.shard import ActivationCheckpointError, checkpoint_activations
from fastpar.train import Trainer, TrainingOptions
from fastpar.user_errors import OptionError


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.down(torch.relu(self.up(self.norm(x)))))


class Stack(nn.Module):
    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def step(model: nn.Module, x: torch.Tensor) -> tuple[dict[str, torch.Tensor], int]:
    """Gradients of one step (dropout drawn from seed 1) and the bytes autograd saved for backward."""
    saved = 0

    def pack(t):
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    torch.manual_seed(1)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).square().mean()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, saved


def test_checkpointed_blocks_give_the_same_gradients_and_save_less():
    torch.manual_seed(0)
    plain = Stack()
    checkpointed = Stack()
    checkpointed.load_state_dict(plain.state_dict())
    names = checkpoint_activations(checkpointed)
    assert names == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert list(checkpointed.state_dict()) == list(plain.state_dict())  # names unchanged
    x = torch.randn(64, 8)
    grads, saved_plain = step(plain, x)
    grads_ckpt, saved_ckpt = step(checkpointed, x)
    for name, grad in grads.items():
        assert torch.equal(grads_ckpt[name], grad), f"{name}: recomputation changed the gradient"
    # each block keeps its input only (plus the recomputation's, which exists one block at a time)
    assert saved_ckpt < 0.5 * saved_plain, (saved_ckpt, saved_plain)


def test_blocks_are_chosen_by_class_or_every_kth():
    assert checkpoint_activations(Stack(), every=2) == ["blocks.1", "blocks.3"]
    assert checkpoint_activations(Stack(), blocks="Block") == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert checkpoint_activations(Stack(), blocks=lambda m: isinstance(m, nn.LayerNorm))[0] == "blocks.0.norm"


def test_what_cannot_be_checkpointed_is_refused_with_the_fix():
    with pytest.raises(ActivationCheckpointError, match="has no repeated blocks.*name the block classes"):
        checkpoint_activations(nn.Linear(3, 3))
    with pytest.raises(ActivationCheckpointError, match=r"no module of class \['Attention'\]"):
        checkpoint_activations(Stack(), blocks="Attention")
    with pytest.raises(ActivationCheckpointError, match="every=0"):
        checkpoint_activations(Stack(), every=0)
    with pytest.raises(ActivationCheckpointError, match="leaves none of the 4 blocks"):
        checkpoint_activations(Stack(), every=5)
    model = Stack()
    checkpoint_activations(model)
    with pytest.raises(ActivationCheckpointError, match="already checkpointed"):
        checkpoint_activations(model)


def test_the_option_is_checked():
    assert TrainingOptions(activation_checkpointing=["GPT2Block"]).activation_checkpointing == ("GPT2Block",)
    with pytest.raises(OptionError, match="every k-th block needs k >= 1"):
        TrainingOptions(activation_checkpointing=0)
    with pytest.raises(OptionError, match="does not apply to pipeline stages"):
        TrainingOptions(activation_checkpointing=True, sharding="pipeline")


def _fit(tmp_path, **overrides):
    options = tb.options(tmp_path, **overrides)
    return Trainer(tb.gpt2, tb.adamw, None, tb.TokenBatches, options=options).fit()


def test_the_trainer_with_checkpointing_matches_torch_ddp_without(tmp_path, reference):
    result = _fit(tmp_path, activation_checkpointing=True)
    tb.assert_same(result.model.state_dict(), reference)


@pytest.mark.slow
def test_zero2_with_checkpointing_matches_torch_ddp_without(tmp_path, reference):
    result = _fit(tmp_path, ddp="fastpar", sharding="zero2", activation_checkpointing=1)
    tb.assert_same(result.model.state_dict(), reference)


@pytest.mark.slow
def test_fsdp_with_checkpointing_is_bit_identical_to_fsdp_without(tmp_path):
    plain = _fit(tmp_path / "plain", ddp="fastpar", sharding="fsdp")
    checkpointed = _fit(tmp_path / "ckpt", ddp="fastpar", sharding="fsdp", activation_checkpointing=("GPT2Block",))
    tb.assert_same(checkpointed.model.state_dict(), plain.model.state_dict())


@pytest.fixture(scope="module")
def reference():
    from fastpar.launcher import spawn

    return spawn(tb.torch_ddp_loop, 2)[0]


def test_the_trainer_checkpoints_the_model_it_trains(tmp_path):
    from fastpar.train.strategies import checkpointed

    built = checkpointed(Stack, TrainingOptions(activation_checkpointing=2))()  # a builder: FSDP builds on meta
    assert [getattr(b, "_fastpar_checkpointed", False) for b in built.blocks] == [False, True, False, True]
    model = Stack()
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))
    options = TrainingOptions(
        execution_environment="cpu",
        devices=1,
        max_epochs=1,
        batch_size=16,
        progress_bar=False,
        output_dir=str(tmp_path),
        activation_checkpointing=True,
    )
    Trainer(model, lambda p: torch.optim.SGD(p, lr=0.1), torch.nn.functional.cross_entropy, data, options=options).fit()
    assert all(getattr(b, "_fastpar_checkpointed", False) for b in model.blocks)  # trained in place, checkpointed
