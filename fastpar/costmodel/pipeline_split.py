"""Pipeline stages for the planner: where to cut the layers, and which schedule and microbatch count to run.

A pipeline of S stages takes S devices; ``N / S`` such pipelines run data-parallel. Each pipeline trains on
the batch its S devices would have had under data parallelism (``batch_size * S``), split into M
microbatches. The cut points balance the measured forward + backward time per layer (contiguous
stages, the largest stage time minimised by dynamic programming, exact); the schedule and M are those
with the fastest predicted step that fits, per stage count. An option's ``split`` lists the layer indices
where stages 1.. begin (as ``fastpar.shard.pipeline_model(split=...)`` takes them); interleaved 1F1B cuts
``stages x virtual_stages`` stages, rank ``r`` holding stages ``r, r + stages, ...`` (torch's loop placement).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Any

__all__ = ["SCHEDULES", "balanced_split", "in_flight", "pipeline_options", "stage_internals"]

# torch.distributed.pipelining's schedules fastpar runs (the runtime, the Trainer's options and the planner)
SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b")
INTERLEAVED_VIRTUAL_STAGES = 2  # the stages per rank the planner prices for interleaved 1F1B


def balanced_split(
    costs: Sequence[float], stages: int, fits: Callable[[int, int, int], bool] | None = None
) -> list[int] | None:
    """The first layer index of each of ``stages`` contiguous stages minimising the largest stage's cost, among the
    splits whose every stage ``k`` running layers ``lo:hi`` has ``fits(k, lo, hi)`` (None: any); None when no split
    fits. Ties keep the earliest cut, so equal costs give the same split on every rank and every run. The one split
    rule: the planner's and the runtime's (``fastpar.shard.pipeline_split.choose_split``)."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} layers into {stages} stages; choose 1..{n} stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][j]: the least largest-stage cost of the first j layers in s stages; cut[s][j]: where the last begins
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for j in range(s, n + 1):
            for i in range(s - 1, j):
                if best[s - 1][i] == inf or (fits is not None and not fits(s - 1, i, j)):
                    continue
                value = max(best[s - 1][i], prefix[j] - prefix[i])
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    if best[stages][n] == inf:
        return None
    starts, j = [], n
    for s in range(stages, 0, -1):
        j = cut[s][j]
        starts.append(j)
    return starts[::-1]


def in_flight(schedule: str, stage: int, stages: int, virtual_stages: int, microbatches: int) -> float:
    """Microbatches whose activations stage ``stage`` (of ``stages * virtual_stages``; rank ``stage % stages``)
    holds at once: all of them under GPipe; ``min(microbatches, stages - rank)`` under 1F1B; under interleaved
    1F1B the rank's warm-up forwards (torch's formula) shared among its ``virtual_stages`` stages."""
    rank = stage % stages
    if schedule == "gpipe":
        return microbatches
    if schedule == "1f1b":
        return min(microbatches, stages - rank)
    rounds = max(1, microbatches // stages)
    warmup = min(
        (virtual_stages - 1) * (microbatches // rounds) + 2 * (stages - 1 - rank), microbatches * virtual_stages
    )
    return min(microbatches, math.ceil((warmup + 1) / virtual_stages))


def stage_internals(context: Any, options: dict, batch_size: int) -> dict:
    """What the memory and time models need for one pipeline option at ``batch_size`` per device."""
    stages, m = options["stages"], options["microbatches"]
    starts = [0, *options["split"], len(context.layers)]  # split: where stages 1.. begin (stages x virtual stages)
    members = [list(range(a, b)) for a, b in pairwise(starts)]
    micro = batch_size * stages / m
    acts = context.activations(micro)
    outputs = context.measured.output_bytes(micro, context.seq_len)
    boundary = max((outputs[ms[-1]] for ms in members[:-1]), default=0.0) * context.sizes.activation_scale
    return {
        "stage_layers": members,
        "stage_activations": [sum(acts[i] for i in ms) for ms in members],
        "stage_transients": [context.transient(micro, ms) for ms in members],
        "boundary_bytes": boundary,
        "stage_batch_scale": micro / batch_size,
    }


def pipeline_options(
    context: Any,
    batch_size: int,
    stages: Sequence[int] | None,
    schedules: Sequence[str],
    microbatches: Sequence[int] | None,
) -> list[dict]:
    """One option per stage count: the schedule and microbatch count with the fastest step that fits (else
    the smallest memory)."""
    n, layers = context.devices, context.layers
    candidates = stages or [s for s in range(2, n + 1) if n % s == 0 and s <= len(layers)]
    bad = [s for s in candidates if s < 1 or n % s or s > len(layers)]
    if bad:
        raise ValueError(
            f"pipeline stages {bad} must divide the {n} devices and be at most the model's {len(layers)} layers"
        )
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown:
        raise ValueError(f"unknown pipeline schedules {unknown}; choose from {', '.join(SCHEDULES)}")
    forward, backward = context.measured.seconds(batch_size, context.seq_len)
    costs = [f + b for f, b in zip(forward, backward, strict=True)]
    chosen = []
    sizes = [float(layer.numel) for layer in layers]
    for s in candidates:
        global_batch = batch_size * s
        counts = microbatches or [s * k for k in (1, 2, 4, 8)]
        counts = [m for m in counts if 1 <= m <= global_batch and global_batch % m == 0]
        rows = []
        for sched in schedules:
            virtual = INTERLEAVED_VIRTUAL_STAGES if sched == "interleaved-1f1b" else 1
            if s * virtual > len(layers):
                continue
            # the fastest cut, and the cut that balances parameters: when the fastest does not fit, the other may
            splits = {tuple(balanced_split(costs, s * virtual)), tuple(balanced_split(sizes, s * virtual))}
            for split in sorted(splits):
                for m in counts:
                    if sched == "interleaved-1f1b" and m % max(1, m // s):
                        continue  # interleaved 1F1B runs whole rounds of s microbatches
                    opts = {"stages": s, "schedule": sched, "microbatches": m, "split": list(split[1:])}
                    if virtual > 1:
                        opts["virtual_stages"] = virtual
                    rows.append(context.estimate("pipeline", opts, batch_size))
        if not rows:
            continue
        fitting = [r for r in rows if r.fits]
        best = min(fitting, key=lambda r: r.step_s) if fitting else min(rows, key=lambda r: r.memory.total)
        chosen.append(best.options)
    return chosen
