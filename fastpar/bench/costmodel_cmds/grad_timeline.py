"""When each gradient becomes ready in backward, measured with post-accumulate-grad hooks on a bare model.

:class:`GradTimer` trains ``model`` (no DDP, no communication) one step per call and records, per
parameter, the seconds from the start of ``loss.backward()`` to the moment autograd has accumulated that
parameter's gradient (``Tensor.register_post_accumulate_grad_hook``), plus the forward, backward and
optimizer times; :meth:`GradTimer.timeline` gives the medians over the recorded steps and
:func:`slowest_ranks` every entry's maximum over the ranks, because a collective waits for the slowest rank.
On CUDA the hook synchronises (a CPU-GPU sync point), so a timestamp is taken after the accumulation ran,
not when it was queued; this serialises backward slightly and is why the timer is for calibration only.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ...costmodel.step_simulator import GradArrival, StepTimeline


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # CPU-GPU sync point: the timestamps must cover the kernels


class GradTimer:
    """A bare training step (zero_grad, forward, backward, optimizer.step) that times itself."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.params = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no parameters that require gradients; nothing to time")
        self.device = self.params[0].device
        index_of = {id(p): i for i, p in enumerate(self.params)}
        self._stamps: dict[int, float] = {}
        self._start = 0.0
        self.records: list[tuple[float, float, float, dict[int, float]]] = []  # forward, backward, optimizer, stamps

        def hook(param: torch.Tensor) -> None:
            _sync(self.device)  # the accumulation has run, not just been queued
            self._stamps[index_of[id(param)]] = time.perf_counter() - self._start

        self._handles = [p.register_post_accumulate_grad_hook(hook) for p in self.params]

    def step(self, batch: torch.Tensor) -> None:
        self._stamps = {}
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        loss = self.loss_fn(self.model(batch))
        _sync(self.device)
        self._start = t2 = time.perf_counter()
        loss.backward()
        _sync(self.device)
        t3 = time.perf_counter()
        self.optimizer.step()
        _sync(self.device)
        self.records.append((t2 - t1, t3 - t2, (t1 - t0) + (time.perf_counter() - t3), self._stamps))

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()

    def timeline(self, skip: int = 0) -> StepTimeline:
        """Medians of the steps recorded after the first ``skip`` (warm-up), gradients in arrival order."""
        records = self.records[skip:]
        if not records:
            raise ValueError(f"no timed steps: {len(self.records)} recorded, {skip} skipped as warm-up")
        unused = [i for i in range(len(self.params)) if i not in records[0][3]]
        if unused:
            raise ValueError(
                f"parameters {unused[:8]} got no gradient in backward; the timeline needs every parameter used "
                "(leave unused ones out of the model, or freeze them with requires_grad=False)"
            )
        ready = {i: statistics.median(r[3][i] for r in records) for i in range(len(self.params))}
        grads = [_arrival(i, self.params[i], ready[i]) for i in sorted(ready, key=lambda i: (ready[i], i))]
        return StepTimeline(
            grads=grads,
            backward_s=max(statistics.median(r[1] for r in records), grads[-1].ready_s),
            forward_s=statistics.median(r[0] for r in records),
            optimizer_s=statistics.median(r[2] for r in records),
        )


def _arrival(index: int, param: torch.Tensor, ready_s: float) -> GradArrival:
    dtype = str(param.dtype).removeprefix("torch.")
    return GradArrival(index, param.numel() * param.element_size(), dtype, ready_s)


def slowest_ranks(timeline: StepTimeline, device: torch.device, group=None) -> StepTimeline:
    """Every time in ``timeline`` replaced by its maximum over the ranks (same model on every rank)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return timeline
    by_index = sorted(timeline.grads, key=lambda g: g.index)
    values = [timeline.forward_s, timeline.backward_s, timeline.optimizer_s] + [g.ready_s for g in by_index]
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    forward, backward, optimizer, *ready = tensor.tolist()
    grads = sorted(
        (GradArrival(g.index, g.nbytes, g.dtype, t) for g, t in zip(by_index, ready, strict=True)),
        key=lambda g: (g.ready_s, g.index),
    )
    return StepTimeline(grads, max(backward, grads[-1].ready_s), forward, optimizer)
