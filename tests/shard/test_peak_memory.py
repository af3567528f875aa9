"""``fastpar.shard.peak_memory``: a step's peak (torch's MemTracker on CPU) is at least the state held between
steps, grows with the batch by the activations backward keeps, and the state is counted storage by storage."""

from __future__ import annotations

import torch
from torch import nn

from fastpar.shard.peak_memory import PeakTracker, measure_step, state_bytes

WIDTH, DEPTH = 64, 6


def _toy() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(DEPTH)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model, optimizer, batch: int) -> None:
    optimizer.zero_grad(set_to_none=True)
    model(torch.ones(batch, WIDTH)).square().mean().backward()
    optimizer.step()


def test_state_counts_parameters_gradients_and_adamw_moments():
    model, optimizer = _toy()
    _step(model, optimizer, 4)
    numel = sum(p.numel() for p in model.parameters())
    state = state_bytes(model, optimizer)
    assert state["parameters"] == state["gradients"] == numel * 4
    steps = 2 * DEPTH  # AdamW's step counter: one float32 scalar per parameter tensor
    assert state["optimizer_state"] == 2 * numel * 4 + steps * 4
    assert state["buffers"] == 0
    assert state["total"] == sum(state[k] for k in ("parameters", "buffers", "gradients", "optimizer_state"))


def test_peak_is_above_the_state_and_grows_with_the_batch():
    model, optimizer = _toy()
    _step(model, optimizer, 4)  # optimizer state exists before the measured step
    small = measure_step(lambda: _step(model, optimizer, 4), model, optimizer)
    large = measure_step(lambda: _step(model, optimizer, 4096), model, optimizer)
    assert small.state_total > 0 and small.state == large.state
    assert small.peak >= small.state_total
    # backward keeps each Linear's input and each Tanh's output: 2 x DEPTH tensors of (batch, WIDTH) fp32
    kept = 2 * DEPTH * (4096 - 4) * WIDTH * 4
    assert large.peak - small.peak >= kept // 2
    assert large.peak_by_kind["Activation"] >= kept // 2
    assert large.peak < large.state_total + 4 * kept  # and not wildly more


def test_buffers_are_counted_apart_from_parameters():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Flatten(), nn.LazyLinear(2))
    model(torch.ones(2, 3, 6, 6))  # materialise the lazy layer
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = PeakTracker(model, optimizer)
    with tracker:
        optimizer.zero_grad(set_to_none=True)
        model(torch.ones(2, 3, 6, 6)).sum().backward()
        optimizer.step()
    result = tracker.result()
    bn = model[1]
    assert result.state["buffers"] == sum(b.numel() * b.element_size() for b in bn.buffers())
    assert result.state["optimizer_state"] == 0  # SGD without momentum keeps nothing
    assert result.peak >= result.state_total
