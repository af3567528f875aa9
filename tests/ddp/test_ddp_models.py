"""Checks that the shared test models (``tests/support/ddp_models.py``) exercise what the parity tests claim:
layouts, checkpointing, unused and frozen parameters."""

from __future__ import annotations

import torch
from ddp_models import Blocks, ResNetish, Strided, Tied, Unused, make_input


def test_tied_model_shares_one_parameter():
    model = Tied()
    assert model.enc.weight is model.dec.weight
    assert len(list(model.parameters())) == 3  # shared weight counted once, plus mid's weight and bias


def test_unused_model_leaves_parameters_without_grad():
    model = Unused()
    model(torch.randn(2, 16), step=1, rank=0).sum().backward()
    assert model.never.weight.grad is None and model.sometimes.weight.grad is None
    assert model.body.weight.grad is not None


def test_strided_model_has_transposed_and_non_dense_parameters():
    model = Strided()
    assert not model.wt.is_contiguous() and model.wt.stride() == (1, 16)
    assert model.sliced.stride() == (16, 2)  # gaps: not dense
    model(torch.randn(2, 16)).sum().backward()
    assert model.wt.grad.stride() == model.wt.stride()  # autograd's layout contract


def test_channels_last_cnn_gets_channels_last_gradients():
    model = ResNetish().to(memory_format=torch.channels_last)
    model(make_input("resnet", torch.Generator().manual_seed(0), channels_last=True)).sum().backward()
    conv = model.stem[0].weight
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    assert conv.grad.stride() == conv.stride()


def test_checkpointed_blocks_recompute():
    calls = []
    model = Blocks("last", True)
    model.out.register_forward_hook(lambda *a: calls.append(1))
    model(torch.randn(2, 16)).sum().backward()
    assert len(calls) == 2  # forward, then the recomputation in backward
