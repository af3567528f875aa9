"""One training step's memory on this rank, measured: the peak over the whole step (forward, backward, optimizer)
and what the rank holds between steps (parameters, gradients, optimizer state, buffers).

The peak comes from torch's own trackers: on CPU ``torch.distributed._tools.mem_tracker.MemTracker`` (a
dispatch mode that sees every tensor the step allocates and frees, categorised as parameters, gradients,
activations, temporaries, optimizer state); on CUDA ``torch.cuda.max_memory_allocated`` after
``reset_peak_memory_stats``. The state between steps is counted from the tensors themselves, each storage
once (:func:`~fastpar.tensor_storage.storage_bytes`): the model's parameters, buffers and gradients, the
optimizer's state, and whatever else the optimizer declares it holds (``memory_tensors()``: ZeRO's flat buffers,
gradient pool and point-to-point scratch).

Hazards: MemTracker sees only tensors allocated through the dispatcher on the thread that runs the step, so
memory a backend allocates in its own threads (gloo's scratch) is not in the CPU peak; the CUDA peak counts
everything allocated on the device, the input batch and cuBLAS workspaces included.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..tensor_storage import storage_bytes, storage_key

__all__ = ["PeakTracker", "StepMemory", "held_tensors", "measure_step", "state_bytes"]

STATE_KEYS = ("parameters", "buffers", "gradients", "optimizer_state")


@dataclass(frozen=True)
class StepMemory:
    """Bytes of one rank over one step."""

    peak: int  # the most bytes live at once during the step
    state: dict[str, int]  # held between steps, by STATE_KEYS, and "total"
    peak_by_kind: dict[str, int] = field(default_factory=dict)  # at the peak (CPU: MemTracker's categories)

    @property
    def state_total(self) -> int:
        return self.state["total"]


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    inner = getattr(optimizer, "optimizer", optimizer)  # a wrapper (LR warm-up, ...) around the real one
    return [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]


def held_tensors(
    modules: nn.Module | Iterable[nn.Module], optimizer: torch.optim.Optimizer | None
) -> dict[str, list[torch.Tensor]]:
    """What a rank holds between steps, by :data:`STATE_KEYS` (a tensor may appear twice: counting keeps the
    first category). An optimizer with ``memory_tensors()`` (``fastpar.ShardedOptimizer``) names its own
    parameters, gradients and state, its buffers among the gradients."""
    modules = [modules] if isinstance(modules, nn.Module) else list(modules)
    params = [p for m in modules for p in m.parameters()]
    held = {
        "parameters": params,
        "buffers": [b for m in modules for b in m.buffers()],
        "gradients": [p.grad for p in params if p.grad is not None],
        "optimizer_state": [],
    }
    declared = getattr(optimizer, "memory_tensors", None)
    if declared is not None:
        for key, tensors in declared().items():
            held[key] = held[key] + list(tensors)
    elif optimizer is not None:
        held["optimizer_state"] = _optimizer_tensors(optimizer)
    return held


def state_bytes(modules: nn.Module | Iterable[nn.Module], optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """Bytes held now, by :data:`STATE_KEYS`, plus ``"total"``: each storage once, in the first category that
    holds it (a DTensor by its local shard)."""
    held = held_tensors(modules, optimizer)
    counted: list[torch.Tensor] = []
    result = {}
    for key in STATE_KEYS:
        before = storage_bytes(counted)
        counted += held[key]
        result[key] = storage_bytes(counted) - before
    result["total"] = sum(result.values())
    return result


def measure_step(
    step: Callable[[], Any],
    modules: nn.Module | Iterable[nn.Module],
    optimizer: torch.optim.Optimizer | None,
    device: torch.device | str = "cpu",
) -> StepMemory:
    """Run ``step()`` once and return its peak on this rank beside the state held after it. Take one step
    before (optimizer state and buffers are allocated at the first): the peak then includes last step's
    gradients as far as the step keeps them."""
    tracker = PeakTracker(modules, optimizer, device)
    with tracker:
        step()
    return tracker.result()


class PeakTracker:
    """``with PeakTracker(model, optimizer, device) as t: ...`` then ``t.result()``: the peak of what ran inside
    (one step: MemTracker slows every op down while it is on). Enter and exit may sit in different places of a
    loop (``start()`` / ``stop()``)."""

    def __init__(
        self,
        modules: nn.Module | Iterable[nn.Module],
        optimizer: torch.optim.Optimizer | None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.modules = [modules] if isinstance(modules, nn.Module) else list(modules)
        self.optimizer, self.device = optimizer, torch.device(device)
        self._tracker: Any = None
        self._peak: dict[str, int] | None = None

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        self._tracker = self._cpu_tracker()
        self._tracker.__enter__()

    def stop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # CPU-GPU sync point: the step's kernels must have run
            self._peak = {"Total": int(torch.cuda.max_memory_allocated(self.device))}
            return
        self._tracker.__exit__(None, None, None)
        peaks = self._tracker.get_tracker_snapshot("peak")
        snap = max(peaks.values(), key=lambda s: s.get("Total", 0), default={})
        self._peak = {str(getattr(k, "value", k)): int(v) for k, v in snap.items()}
        self._tracker = None

    def __enter__(self) -> PeakTracker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def result(self) -> StepMemory:
        """The peak of the tracked span, and the state held now."""
        if self._peak is None:
            raise RuntimeError("PeakTracker.result() before the tracked span ended")
        return StepMemory(self._peak.get("Total", 0), state_bytes(self.modules, self.optimizer), dict(self._peak))

    def _cpu_tracker(self):
        from torch.distributed._tools.mem_tracker import MemTracker

        modules, optimizer = self.modules, self.optimizer
        tracker = MemTracker()
        tracker.track_external(*modules)  # parameters, buffers and gradients, in their categories
        held = held_tensors(modules, optimizer)
        known: set[tuple[str, int]] = set()
        if getattr(optimizer, "memory_tensors", None) is None and optimizer is not None:
            tracker.track_external(getattr(optimizer, "optimizer", optimizer))  # its state, as optimizer state
            known |= {storage_key(t) for t in held["optimizer_state"]}
        # the rest as "Other" (ZeRO's flat buffers, pool, scratch; its state until its step names it): a storage
        # the tracker knows already would be recategorised, so it is left out
        known |= {storage_key(t) for m in modules for t in (*m.parameters(), *m.buffers())}
        known |= {storage_key(p.grad) for m in modules for p in m.parameters() if p.grad is not None}
        rest = {}
        for key in STATE_KEYS:
            for t in held[key]:
                rest.setdefault(storage_key(t), t)
        tracker.track_external(*(t for k, t in rest.items() if k not in known))
        return tracker
