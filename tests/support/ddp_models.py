"""Models and a training loop shared by the fastpar DDP, ZeRO, backend and kernel tests (imported by spawned ranks).

``tests/ddp/test_ddp_models.py`` checks that the models exercise what the parity tests claim."""

from __future__ import annotations

import copy
import io

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


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


class Strided(nn.Module):
    """Parameters that are views: a transposed (dense, non-contiguous) matrix and a non-dense slice."""

    def __init__(self):
        super().__init__()
        self.wt = nn.Parameter((torch.randn(32, 16) * 0.2).t())  # (16, 32), strides (1, 16)
        self.sliced = nn.Parameter((torch.randn(32, 16) * 0.2)[:, ::2])  # (32, 8), strides (16, 2): not dense
        self.bias = nn.Parameter(torch.zeros(8))

    def forward(self, x, step=0, rank=0):
        return torch.tanh(x @ self.wt) @ self.sliced + self.bias  # (B, 8)


class Blocks(nn.Module):
    """Four residual MLP blocks; ``ckpt`` selects which block is recomputed (activation checkpointing)."""

    def __init__(self, ckpt: str = "", reentrant: bool = True):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32)) for _ in range(4))
        self.out = nn.Linear(32, 8)
        self.ckpt, self.reentrant = ckpt, reentrant

    def forward(self, x, step=0, rank=0):
        h = self.inp(x)
        chosen = {"": None, "middle": 1, "last": None, "all": "all"}[self.ckpt]
        for i, block in enumerate(self.blocks):
            if chosen == i or chosen == "all":
                h = h + checkpoint(block, h, use_reentrant=self.reentrant)
            else:
                h = h + block(h)
        if self.ckpt == "last":  # the checkpointed block is the model's output
            return checkpoint(self.out, h, use_reentrant=self.reentrant)
        return self.out(h)


class Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(16, 32)
        self.frozen.requires_grad_(False)
        self.train_me = nn.Sequential(nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8))
        self.train_me[1].bias.requires_grad_(False)

    def forward(self, x, step=0, rank=0):
        return self.train_me(self.frozen(x))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNetish(nn.Module):
    """A small ResNet: stem, two stages of basic blocks (one with a downsampling shortcut), pool, classifier."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.layer1 = nn.Sequential(BasicBlock(16, 16, 1), BasicBlock(16, 16, 1))
        self.layer2 = nn.Sequential(BasicBlock(16, 32, 2), BasicBlock(32, 32, 1))
        self.fc = nn.Linear(32, 10)

    def forward(self, x, step=0, rank=0):
        return self.fc(self.layer2(self.layer1(self.stem(x))).mean(dim=(2, 3)))


MODELS = {
    "mlp": MLP,
    "cnn": CNN,
    "unused": Unused,
    "tied": Tied,
    "strided": Strided,
    "frozen": Frozen,
    "resnet": ResNetish,
    "ckpt_middle_reentrant": lambda: Blocks("middle", True),
    "ckpt_last_reentrant": lambda: Blocks("last", True),
    "ckpt_all_reentrant": lambda: Blocks("all", True),
    "ckpt_middle": lambda: Blocks("middle", False),
    "ckpt_last": lambda: Blocks("last", False),
}
IMAGE_MODELS = {"cnn", "resnet"}


def make_input(kind: str, gen: torch.Generator, channels_last: bool = False) -> torch.Tensor:
    if kind in IMAGE_MODELS:
        x = torch.randn(4, 3, 8, 8, generator=gen)
        return x.to(memory_format=torch.channels_last) if channels_last else x
    return torch.randn(8, 16, generator=gen)


def _roundtrip(model, how: str):
    """A copy of the wrapped model made the way users make one: torch.save/load or deepcopy."""
    if how == "deepcopy":
        return copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def train(
    wrap,
    kind: str,
    rank: int,
    *,
    steps: int = 12,
    accumulate: str = "",
    set_to_none: bool = True,
    channels_last: bool = False,
    forwards: int = 1,
    clip: float | None = None,
    autocast: bool = False,
    roundtrip: str = "",
):
    """Train a freshly seeded model wrapped by ``wrap(module)``; returns its parameters and buffers.

    ``accumulate``: "" (one micro-batch per step), "no_sync" or "attr" (nanoGPT's ``require_backward_grad_sync``),
    each with two micro-batches per step. ``forwards=2``: two forwards summed into one loss. ``clip``: clip the
    gradient norm. ``autocast``: bf16 CPU autocast. ``roundtrip``: halfway, continue with a torch.save/load or
    deepcopy copy of the wrapped model (and the optimizer's state).
    """
    torch.manual_seed(0)
    module = MODELS[kind]()
    if channels_last:
        module = module.to(memory_format=torch.channels_last)
    model = wrap(module)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    gen = torch.Generator().manual_seed(100 + rank)  # inputs differ per rank
    micro = 2 if accumulate else 1
    for step in range(steps):
        if roundtrip and step == steps // 2:
            model = _roundtrip(model, roundtrip)
            state = opt.state_dict()
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
            opt.load_state_dict(state)
        opt.zero_grad(set_to_none=set_to_none)
        for m in range(micro):
            last = m == micro - 1
            if accumulate == "attr":
                model.require_backward_grad_sync = last
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = sum(
                    model(make_input(kind, gen, channels_last), step=step, rank=rank).float().square().mean()
                    for _ in range(forwards)
                )
            if accumulate == "no_sync" and not last:
                with model.no_sync():
                    loss.backward()
                continue
            loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    final = model.module
    return {k: v.detach().clone() for k, v in final.state_dict().items()}
