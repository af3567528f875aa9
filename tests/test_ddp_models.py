"""Small models and a training loop shared by the fastpar DDP tests (imported by spawned ranks),
with checks that the models exercise what the parity tests claim."""

from __future__ import annotations

import torch
import torch.nn as nn


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8))

    def forward(self, x, step=0, rank=0):
        return self.net(x)


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8), nn.ReLU()
        )
        self.head = nn.Linear(8, 4)

    def forward(self, x, step=0, rank=0):
        return self.head(self.features(x).mean(dim=(2, 3)))


class Unused(nn.Module):
    """``sometimes`` is used on rank 0 at even steps only; ``never`` is never used."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 16)
        self.sometimes = nn.Linear(16, 8)
        self.never = nn.Linear(16, 8)
        self.out = nn.Linear(16, 8)

    def forward(self, x, step=0, rank=0):
        h = torch.tanh(self.body(x))
        y = self.out(h)
        if rank == 0 and step % 2 == 0:
            y = y + self.sometimes(h)
        return y


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(16, 24, bias=False)
        self.mid = nn.Linear(24, 24)
        self.dec = nn.Linear(24, 16, bias=False)
        self.dec.weight = nn.Parameter(self.enc.weight.t().contiguous())
        self.enc.weight = self.dec.weight  # shared: (16, 24) used both ways

    def forward(self, x, step=0, rank=0):
        h = torch.relu(x @ self.enc.weight)  # (B, 24)
        return self.mid(h) @ self.dec.weight.t()


MODELS = {"mlp": MLP, "cnn": CNN, "unused": Unused, "tied": Tied}


def make_input(kind: str, gen: torch.Generator) -> torch.Tensor:
    if kind == "cnn":
        return torch.randn(4, 3, 8, 8, generator=gen)
    return torch.randn(8, 16, generator=gen)


def train(wrap, kind: str, rank: int, *, steps: int = 20, accumulate: str = "", set_to_none: bool = True):
    """Train a freshly seeded model wrapped by ``wrap(module)``; returns its parameters and buffers.

    ``accumulate``: "" (one micro-batch per step), "no_sync" or "attr" (nanoGPT's
    ``require_backward_grad_sync``), each with two micro-batches per step.
    """
    torch.manual_seed(0)
    module = MODELS[kind]()
    model = wrap(module)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    gen = torch.Generator().manual_seed(100 + rank)  # inputs differ per rank
    micro = 2 if accumulate else 1
    for step in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        for m in range(micro):
            x = make_input(kind, gen)
            last = m == micro - 1
            if accumulate == "no_sync" and not last:
                with model.no_sync():
                    model(x, step=step, rank=rank).square().mean().backward()
                continue
            if accumulate == "attr":
                model.require_backward_grad_sync = last
            model(x, step=step, rank=rank).square().mean().backward()
        opt.step()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_tied_model_shares_one_parameter():
    model = Tied()
    assert model.enc.weight is model.dec.weight
    assert len(list(model.parameters())) == 3  # shared weight counted once, plus mid's weight and bias


def test_unused_model_leaves_parameters_without_grad():
    model = Unused()
    model(torch.randn(2, 16), step=1, rank=0).sum().backward()
    assert model.never.weight.grad is None and model.sometimes.weight.grad is None
    assert model.body.weight.grad is not None
