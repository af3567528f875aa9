"""``bucket_cap_mb="auto"``: bucket boundaries chosen from this run's own measurements; every rank agrees.

fastpar predicts, then verifies. Counted in synchronised backwards (the same count on every rank):

1. settle: torch's rebuild (buckets in gradient arrival order at fastpar's default caps), then
   ``WARMUP_STEPS`` steps (new bucket buffers are first touched: page faults).
2. measure ``MEASURE_STEPS`` steps with the reducer's own hooks (``step_recorder``): when each gradient is
   ready, backward's compute, the reducer's own packing and finishing per byte, the end of the sync, the
   step.
3. decide, at the next forward (in ``_rebuild_buckets``, where torch rebuilds its buckets, so every rank
   is at the same point): a quick all-reduce sweep on the live group (:func:`measure_allreduce`: a few
   sizes up to all the gradients' bytes); every measured time maxed over the ranks (a bucket waits for
   the slowest); on rank 0 the step simulator -- with a wire slowdown fitted so that the current layout's
   predicted end of the sync matches the measured one (:func:`fit_wire`) -- prices the current layout, the
   optimal split (exact without contention, and again with the wire slowed as fitted throughout) and
   torch-style caps of 1..100 MB (``bucket_optimizer.plan_buckets``); rank 0 broadcasts a short list
   (:func:`shortlist`): the predicted best, if predicted at least ``KEEP_MARGIN`` faster than the current
   layout, and the best predicted with at most half as many buckets.
4. verify: each listed layout is built on every rank and measured for ``MEASURE_STEPS`` steps (after
   ``WARMUP_STEPS``); at the next forward the ranks take its median step (maxed over the ranks, so every
   rank decides alike). When all are measured, the fastest measured layout -- the current one included --
   is kept.

Inside ``join()`` (uneven inputs) the joined ranks stop counting steps, so "auto" stops where it is.
A comm hook registered with ``register_comm_hook`` also stops it where it is, keeping the layout then in use
(usually fastpar's default, as hooks are registered before training): stateful hooks such as PowerSGD key
their state by bucket index, so the buckets must not change under them. torch's own rebuild after the first
step still happens, as with torch's DDP. torch's stateless default hooks (all-reduce, fp16/bf16 compression)
let "auto" go on.
At world size > 2 a layout change changes the all-reduce's summation order: the results are no longer
torch DDP's bits (every rank still holds the same values).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Protocol

import torch
import torch.distributed as dist

from ..costmodel.bucket_optimizer import broadcast_decision, optimal_buckets, plan_buckets
from ..costmodel.perf_profile import CollectiveTable
from ..costmodel.step_simulator import GradArrival, StepTimeline, SyncCosts, simulate_step
from .step_recorder import StepRecorder

__all__ = ["AutoBuckets", "AutoBucketsHost", "fit_wire", "measure_allreduce", "shortlist", "sweep_sizes"]

WARMUP_STEPS = 2
MEASURE_STEPS = 5
KEEP_MARGIN = 0.02  # predicted gains below 2% are within the model's error: not worth a rebuild
SWEEP_START_BYTES = 64 * 1024
SWEEP_MAX_BYTES = 256 * 1024 * 1024
SWEEP_REPEATS = 3
MAX_WIRE_SLOWDOWN = 10.0

_log = logging.getLogger(__name__)


def sweep_sizes(total_bytes: int) -> list[int]:
    """All-reduce sizes to measure: 64 KiB, x4, ... below ``total_bytes``, then ``total_bytes`` (at most 256 MiB)."""
    total = max(8, min(int(total_bytes), SWEEP_MAX_BYTES)) // 4 * 4
    sizes, n = [], SWEEP_START_BYTES
    while n < total:
        sizes.append(n)
        n *= 4
    return (sizes or [max(4, total // 4 // 4 * 4)]) + [total]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # CPU-GPU sync point: timing the sweep, once per decision


def measure_allreduce(group, device: torch.device, sizes: list[int], repeats: int = SWEEP_REPEATS) -> CollectiveTable:
    """Seconds of one all-reduce of each size on ``group`` (float32 zeros; median of ``repeats`` after a
    warm-up, the slowest rank's). Call on every rank of the group."""
    seconds = []
    align = torch.zeros(1, device=device)
    for nbytes in sizes:
        buffer = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
        dist.all_reduce(buffer, group=group)
        samples = []
        for _ in range(repeats):
            dist.all_reduce(align, group=group)  # start together
            _synchronize(device)
            start = time.perf_counter()
            dist.all_reduce(buffer, group=group)
            _synchronize(device)
            samples.append(time.perf_counter() - start)
        seconds.append(statistics.median(samples))
    slowest = torch.tensor(seconds, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return CollectiveTable(list(sizes), monotone(slowest.tolist()))


def monotone(values: list[float]) -> list[float]:
    """The closest non-decreasing sequence (least squares, pool-adjacent-violators): a larger message is
    never cheaper, so a noisy sweep is smoothed rather than trusted point by point."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


def fit_wire(
    timeline: StepTimeline, layout: list[list[int]], comm: Callable, costs: SyncCosts, sync_end_s: float
) -> tuple[Callable, SyncCosts, dict[str, float]]:
    """``comm`` and ``costs`` adjusted so that ``layout``'s predicted end of the sync is ``sync_end_s``.

    The ready times were measured with communication running, so compute contention is already in them;
    what the idle-time sweep misses is the wire slowed by backward's compute (``wire_slowdown``, fitted in
    [0, 10]). A sync that ends sooner than even the uncontended prediction scales the sweep's times down."""

    def sync_end(scale: float, slowdown: float) -> float:
        scaled = (lambda n: comm(n) * scale) if scale != 1.0 else comm
        return simulate_step(timeline, layout, scaled, replace(costs, wire_slowdown=slowdown)).sync_end_s

    def bisect(f: Callable[[float], float], low: float, high: float) -> float:
        for _ in range(30):
            mid = 0.5 * (low + high)
            low, high = (mid, high) if f(mid) < sync_end_s else (low, mid)
        return 0.5 * (low + high)

    scale, slowdown = 1.0, 0.0
    if sync_end(1.0, 0.0) > sync_end_s:
        scale = bisect(lambda s: sync_end(s, 0.0), 0.05, 1.0)
    else:
        slowdown = bisect(lambda k: sync_end(1.0, k), 0.0, MAX_WIRE_SLOWDOWN)
    fitted = (lambda n: comm(n) * scale) if scale != 1.0 else comm
    return fitted, replace(costs, wire_slowdown=slowdown), {"comm_scale": scale, "wire_slowdown": slowdown}


class AutoBucketsHost(Protocol):
    """What ``bucket_cap_mb="auto"`` needs of the reducer it tunes (:class:`fastpar.ddp.reducer.Reducer`)."""

    group: dist.ProcessGroup
    device: torch.device
    slots: Sequence  # ParamSlot per parameter: index, numel, param
    buckets: Sequence  # Bucket per launch: nbytes

    @property
    def rebuild_pending(self) -> bool:
        """torch's one rebuild (buckets in gradient arrival order) is still to come."""
        ...

    def layout(self) -> list[list[int]]:
        """The buckets as lists of parameter indices, in launch order."""
        ...

    def apply_layout(self, assignment: list[list[int]]) -> None:
        """Re-bucket between steps (the same ``assignment`` on every rank)."""
        ...

    def stop_recording(self) -> None:
        """Measure no more steps (the recorder handed out by :meth:`AutoBuckets.forward_started` is dropped)."""
        ...


class AutoBuckets:
    """The phases of ``bucket_cap_mb="auto"`` for one reducer (which calls the hooks marked below), driven
    through the :class:`AutoBucketsHost` interface only."""

    def __init__(self, device: torch.device) -> None:
        self.phase = "settle"  # settle -> measure -> decide -> verify -> judge -> done (or off)
        self.recorder = StepRecorder(device)
        self._warm = 0
        self._trials: list[tuple[str, list[list[int]]]] = []  # layouts still to measure
        self._trying: tuple[str, list[list[int]]] | None = None
        self._measured: dict[str, tuple[float, list[list[int]]]] = {}  # name -> (median step s, buckets)
        self.report: dict = {}

    @property
    def due(self) -> bool:
        """A decision is due at this forward (on every rank alike)."""
        return self.phase in ("decide", "judge")

    def summary(self) -> dict:
        return {"phase": self.phase, **self.report}

    # ---- called by the reducer ------------------------------------------------------------------
    def forward_started(self) -> StepRecorder | None:
        """The recorder when this synchronised step is measured, else None."""
        if self.phase in ("measure", "verify") and self._warm >= WARMUP_STEPS:
            self.recorder.forward()
            return self.recorder
        return None

    def step_done(self, reducer: AutoBucketsHost) -> None:
        """A synchronised backward finished."""
        if self.phase == "settle":
            self._warm = 0 if reducer.rebuild_pending else self._warm + 1  # torch's rebuild comes first
            if self._warm >= WARMUP_STEPS:
                self.phase = "measure"
            return
        if self.phase in ("measure", "verify"):
            if self._warm < WARMUP_STEPS:  # the first steps on a new layout
                self._warm += 1
                return
            self.recorder.end()
            if len(self.recorder.steps) >= MEASURE_STEPS:
                self.phase = "decide" if self.phase == "measure" else "judge"
                reducer.stop_recording()

    def freeze(self, reducer: AutoBucketsHost, reason: str) -> None:
        if self.phase not in ("done", "off"):
            self.phase, self.report["stopped"] = "off", reason
            reducer.stop_recording()
            self.recorder.reset()

    def decide(self, reducer: AutoBucketsHost) -> None:
        """Every rank, at the same forward: the decision (rank 0's, broadcast) or the verification."""
        if self.phase == "judge":
            self._judge(reducer)
        else:
            self._decide(reducer)

    # ---- the decision ---------------------------------------------------------------------------
    def _decide(self, reducer: AutoBucketsHost) -> None:
        group, device = reducer.group, reducer.device
        slots = reducer.slots
        local = self.recorder.summary(len(slots))
        maxed = torch.tensor(local, dtype=torch.float64, device=device)
        dist.all_reduce(maxed, op=dist.ReduceOp.MAX, group=group)
        *ready, backward_s, sync_s, step_s, pack, finish = maxed.tolist()
        comm_bytes = sum(b.nbytes for b in reducer.buckets)
        table = measure_allreduce(group, device, sweep_sizes(comm_bytes))
        current = reducer.layout()
        decision = None
        if dist.get_rank(group) == 0:
            try:
                decision = _plan(slots, ready, backward_s, sync_s, pack, finish, comm_bytes, table, current)
            except Exception as exc:  # never leave the other ranks waiting in the broadcast
                _log.warning("fastpar DDP bucket_cap_mb='auto': planning failed, keeping the layout: %r", exc)
                decision = {"trials": [], "chosen": "current layout", "error": repr(exc)}
        decision = broadcast_decision(decision, group)
        self._trials = decision.pop("trials")
        self._measured = {"current layout": (step_s, current)}
        self.report.update(decision, measured_step_ms={"current layout": step_s * 1e3})
        self._next_trial(reducer)

    def _next_trial(self, reducer: AutoBucketsHost) -> None:
        """Build the next layout to measure, or, when all are measured, the fastest one measured."""
        self.recorder.reset()
        if self._trials:
            self._trying = self._trials.pop(0)
            reducer.apply_layout(self._trying[1])
            self.phase, self._warm = "verify", 0
            return
        kept = min(self._measured, key=lambda name: self._measured[name][0])
        reducer.apply_layout(self._measured[kept][1])
        self.phase = "done"
        self.report.update(kept=kept, buckets=len(reducer.buckets))
        _log.info("fastpar DDP bucket_cap_mb='auto': %s", self.report)

    def _judge(self, reducer: AutoBucketsHost) -> None:
        median = torch.tensor([self.recorder.median_step_s()], dtype=torch.float64, device=reducer.device)
        dist.all_reduce(median, op=dist.ReduceOp.MAX, group=reducer.group)  # every rank decides alike
        name, buckets = self._trying
        self._measured[name] = (median.item(), buckets)
        self.report["measured_step_ms"][name] = median.item() * 1e3
        self._next_trial(reducer)


def _plan(slots, ready, backward_s, sync_s, pack, finish, comm_bytes, table, current) -> dict:
    """Rank 0's decision from the slowest ranks' measurements: the short list, and what it was based on."""
    grads = sorted(
        (
            GradArrival(
                s.index, s.numel * s.param.element_size(), str(s.param.dtype).removeprefix("torch."), ready[s.index]
            )
            for s in slots
        ),
        key=lambda g: (g.ready_s, g.index),
    )
    timeline = StepTimeline(grads, max(backward_s, grads[-1].ready_s))
    grad_bytes = sum(g.nbytes for g in grads)
    costs = SyncCosts(pack_s_per_byte=pack, unpack_s_per_byte=finish, comm_bytes_per_byte=comm_bytes / grad_bytes)
    comm, costs, fit = fit_wire(timeline, current, table.seconds_at, costs, sync_s)
    slowed = 1.0 + costs.wire_slowdown
    contended = optimal_buckets(timeline, lambda n: comm(n) * slowed, replace(costs, wire_slowdown=0.0))
    plan = plan_buckets(
        timeline, comm, costs, extra={"current layout": current, "optimal split, wire contended": contended}
    )
    return {
        "trials": shortlist(plan, current),
        "chosen": plan.chosen,
        "predicted_ms": {k: v * 1e3 for k, v in plan.candidates.items()},
        "fit": fit,
        "sweep_ms": {n: t * 1e3 for n, t in zip(table.nbytes, table.seconds, strict=True)},
    }


def shortlist(plan, current: list[list[int]]) -> list[tuple[str, list[list[int]]]]:
    """The layouts to measure besides the current one: the predicted best, if predicted at least ``KEEP_MARGIN``
    faster than the current layout, and the predicted best of those with at most half its buckets -- the
    simulator does not see what each collective costs the compute of CPU ranks (gloo's threads share the
    cores), so fewer, larger buckets are measured too. Layouts equal to one already listed are left out."""
    ranked = sorted(plan.candidates, key=plan.candidates.get)
    best = ranked[0]
    picks = [best] if plan.candidates[best] < plan.candidates["current layout"] * (1.0 - KEEP_MARGIN) else []
    most = max(1, len(plan.layouts[best]) // 2)
    picks += [name for name in ranked if len(plan.layouts[name]) <= most][:1]
    trials, seen = [], [current]
    for name in picks:
        if plan.layouts[name] not in seen:
            trials.append((name, plan.layouts[name]))
            seen.append(plan.layouts[name])
    return trials
