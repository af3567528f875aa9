"""Simulate one data-parallel training step: backward, bucketed collectives, pack/unpack, optimizer.

The model of one rank (all ranks alike; the profile holds the slowest rank's times):

- Backward runs on the compute thread; gradient ``g`` becomes ready ``g.ready_s`` seconds of compute
  after backward starts (measured without communication). Each gradient is packed (copied or scaled
  into its bucket) on arrival: ``nbytes * pack_s_per_byte`` more compute, which delays all later work.
- A bucket is launched when its last gradient is packed, in bucket order (bucket k never before k-1,
  as torch's reducer and fastpar's do), and the wire carries one collective at a time: a bucket's
  collective starts when it is launched and the one before it has finished, and takes ``comm(bytes)``.
- After backward the compute thread waits for the buckets in order and unpacks each (copy back,
  average, cast) as soon as it is done: ``nbytes * unpack_s_per_byte``, overlapping later collectives.
- Contention (CPU ranks, where gloo's threads and backward share cores): while both run, compute
  advances at rate 1/(1 + compute_slowdown) and the wire at 1/(1 + wire_slowdown); alone, each at 1.
  Both are 0 on GPUs (NCCL kernels take a few SMs; not modelled).

Step time = forward + (backward and sync, simulated) + optimizer. Exposed communication = the time from
the end of backward's compute to the end of the last unpack: what the step waits for the network.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise


@dataclass(frozen=True)
class GradArrival:
    """One parameter's gradient: its index (``model.parameters()`` order), bytes, dtype and ready time."""

    index: int
    nbytes: int
    dtype: str
    ready_s: float  # seconds since backward started, measured without communication


@dataclass
class StepTimeline:
    """One rank's compute in a step, measured without communication; ``grads`` in arrival order."""

    grads: list[GradArrival]
    backward_s: float  # backward's compute, start to return
    forward_s: float = 0.0
    optimizer_s: float = 0.0  # optimizer.step() and zero_grad()

    def __post_init__(self) -> None:
        if any(b.ready_s < a.ready_s for a, b in pairwise(self.grads)):
            raise ValueError("StepTimeline.grads must be in arrival order (ready_s non-decreasing)")
        if self.grads and self.backward_s < self.grads[-1].ready_s:
            raise ValueError(
                f"backward_s ({self.backward_s:.6f} s) ends before the last gradient is ready "
                f"({self.grads[-1].ready_s:.6f} s)"
            )

    @property
    def compute_s(self) -> float:
        """The step without any communication: the floor every prediction is compared with."""
        return self.forward_s + self.backward_s + self.optimizer_s

    def scaled(self, factor: float) -> StepTimeline:
        """This timeline with every compute time multiplied by ``factor`` (a faster device, or re-measured)."""
        grads = [GradArrival(g.index, g.nbytes, g.dtype, g.ready_s * factor) for g in self.grads]
        return StepTimeline(grads, self.backward_s * factor, self.forward_s * factor, self.optimizer_s * factor)

    def by_index(self) -> dict[int, GradArrival]:
        return {g.index: g for g in self.grads}


@dataclass(frozen=True)
class SyncCosts:
    """What the reducer adds per byte of gradient, how compute and the wire slow each other, and what one FSDP
    unit adds to a step whatever its size (measured with units of ``fsdp_unit_bytes``, their wire included)."""

    pack_s_per_byte: float = 0.0  # copy/scale into the bucket on arrival (0 when gradients are bucket views)
    unpack_s_per_byte: float = 0.0  # copy back / average / cast after the collective
    comm_bytes_per_byte: float = 1.0  # bytes on the wire per gradient byte: 0.5 for fp32 reduced in bf16
    compute_slowdown: float = 0.0
    wire_slowdown: float = 0.0
    fsdp_unit_s: float = 0.0  # per unit kept gathered after forward (a gather and a reduce-scatter)
    fsdp_regather_s: float = 0.0  # per unit resharded after forward (its second gather, before backward)
    fsdp_unit_bytes: float = 0.0
    pipeline_slot_s: float = 0.0  # per slot of a pipeline schedule (a microbatch through a stage, its messages)
    pipeline_message_bytes: float = 0.0
    zero_bucket_s: float = 0.0  # per ZeRO bucket (its reduce-scatter and all-gather exchanges) beyond DDP's
    zero_bucket_bytes: float = 0.0


@dataclass
class StepPrediction:
    step_s: float
    backward_end_s: float  # end of backward's compute (packing and contention included), from backward start
    sync_end_s: float  # end of the last unpack, from backward start
    exposed_s: float  # sync_end_s - backward_end_s
    wire_busy_s: float  # total time a collective was on the wire
    buckets: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of each collective

    def efficiency(self, compute_s: float) -> float:
        """Share of the step spent on the model's own compute (1.0 = communication is free)."""
        return compute_s / self.step_s if self.step_s > 0 else 1.0


def simulate_step(
    timeline: StepTimeline,
    buckets: Sequence[Sequence[int]],
    comm: Callable[[float], float],
    costs: SyncCosts | None = None,
) -> StepPrediction:
    """Predict one step of ``timeline`` with gradients synchronised in ``buckets`` (lists of parameter
    indices, launch order); ``comm(nbytes)`` = seconds of one collective of ``nbytes`` on the wire."""
    costs = costs or SyncCosts()
    grads = timeline.by_index()
    _check_buckets(buckets, grads)
    bucket_of = {i: k for k, members in enumerate(buckets) for i in members}
    missing = [len(members) for members in buckets]  # gradients each bucket still waits for
    wire_work = [comm(sum(grads[i].nbytes for i in members) * costs.comm_bytes_per_byte) for members in buckets]

    # The compute thread's work, in order: ("work", seconds) | ("ready", bucket) | ("end",) | ("wait", bucket)
    tasks: list[tuple] = []
    previous = 0.0
    for g in timeline.grads:
        tasks.append(("work", g.ready_s - previous + g.nbytes * costs.pack_s_per_byte))
        tasks.append(("ready", bucket_of[g.index]))
        previous = g.ready_s
    tasks.append(("work", timeline.backward_s - previous))
    tasks.append(("end",))
    for k, members in enumerate(buckets):
        tasks.append(("wait", k))
        tasks.append(("work", sum(grads[i].nbytes for i in members) * costs.unpack_s_per_byte))

    now, task_at, left = 0.0, 0, None  # left: compute seconds left of the current "work" task
    launched = 0  # buckets whose last gradient is packed, in order
    ready = [False] * len(buckets)
    wire_bucket, wire_left, done = None, 0.0, 0  # the collective on the wire; buckets finished
    spans: list[tuple[float, float]] = []
    backward_end, wire_busy = None, 0.0
    while True:
        # run the instantaneous compute tasks
        while task_at < len(tasks) and left is None:
            kind = tasks[task_at][0]
            if kind == "work":
                left = tasks[task_at][1]
                if left <= 0:
                    left, task_at = None, task_at + 1
            elif kind == "ready":
                k = tasks[task_at][1]
                missing[k] -= 1
                ready[k] = missing[k] == 0
                task_at += 1
            elif kind == "end":
                backward_end, task_at = now, task_at + 1
            elif done > tasks[task_at][1]:  # "wait" for a finished bucket
                task_at += 1
            else:
                break  # waiting on the wire
        while launched < len(buckets) and ready[launched]:
            launched += 1
        if wire_bucket is None and done < launched:
            wire_bucket, wire_left = done, wire_work[done]
            spans.append((now, now))
        computing, on_wire = left is not None, wire_bucket is not None
        if not computing and not on_wire:
            if task_at < len(tasks):
                raise RuntimeError("step simulation stalled: a bucket can never launch (internal error)")
            break
        c_rate = 1.0 / (1.0 + costs.compute_slowdown) if on_wire else 1.0
        w_rate = 1.0 / (1.0 + costs.wire_slowdown) if computing else 1.0
        dt = min(left / c_rate if computing else float("inf"), wire_left / w_rate if on_wire else float("inf"))
        now += dt
        if computing:
            left -= dt * c_rate
            if left <= 1e-15:
                left, task_at = None, task_at + 1
        if on_wire:
            wire_busy += dt
            wire_left -= dt * w_rate
            if wire_left <= 1e-15:
                spans[-1] = (spans[-1][0], now)
                wire_bucket, done = None, done + 1
    sync_end = now
    assert backward_end is not None
    return StepPrediction(
        step_s=timeline.forward_s + sync_end + timeline.optimizer_s,
        backward_end_s=backward_end,
        sync_end_s=sync_end,
        exposed_s=sync_end - backward_end,
        wire_busy_s=wire_busy,
        buckets=spans,
    )


def _check_buckets(buckets: Sequence[Sequence[int]], grads: dict[int, GradArrival]) -> None:
    seen: set[int] = set()
    for k, members in enumerate(buckets):
        if not members:
            raise ValueError(f"bucket {k} is empty")
        for i in members:
            if i not in grads:
                raise ValueError(f"bucket {k} names parameter {i}, which has no gradient in the timeline")
            if i in seen:
                raise ValueError(f"parameter {i} is in more than one bucket")
            seen.add(i)
    if len(seen) != len(grads):
        absent = sorted(set(grads) - seen)[:8]
        raise ValueError(f"{len(grads) - len(seen)} gradient(s) are in no bucket, e.g. parameters {absent}")
