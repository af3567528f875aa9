"""Where to cut a model into pipeline stages: the checks that a pipeline can be built, and the split points.

A split is ``stages * virtual_stages - 1`` increasing layer indices: stage ``k`` runs layers
``points[k-1]:points[k]`` (``points = (4,)`` puts layers 0-3 on stage 0 and 4.. on stage 1). With
``virtual_stages = V`` (interleaved 1F1B) there are ``stages * V`` stages and rank ``r`` of the pipeline holds
stages ``r, r + stages, r + 2 * stages, ...`` (torch's loop placement).

:func:`choose_split` picks contiguous stages from measured :class:`~fastpar.shard.pipeline_profile.LayerCost`:
the split whose slowest stage (forward + backward of one microbatch) is fastest, among the splits whose every
stage fits ``memory_limit_bytes``. A stage's bytes are predicted as parameters + gradients (the same bytes) +
optimizer state (``optimizer_state_factor`` x the parameter bytes: 2 for Adam/AdamW, 1 for SGD with momentum) +
the saved activations of the microbatches it holds at once: all of them under GPipe; ``min(microbatches,
stages - r)`` at rank ``r`` under 1F1B; under interleaved 1F1B the rank's warm-up forwards (torch's formula)
shared among its ``V`` stages, each held to ``memory_limit_bytes / V`` (a sufficient condition for the rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..costmodel.pipeline_split import SCHEDULES, balanced_split, in_flight
from .pipeline_profile import LayerCost, PipelineConfigError


@dataclass(frozen=True)
class PipelineSplit:
    """The split points of a pipeline and what they were chosen from (the same object on every rank)."""

    points: tuple[int, ...]  # stage k starts at layer points[k - 1]
    chosen: str  # "auto" (balanced from the measurements) or "explicit" (given)
    layers: tuple[LayerCost, ...]  # every layer measured on one microbatch
    stage_seconds: tuple[float, ...]  # measured forward + backward of one microbatch, per stage
    stage_bytes: tuple[int, ...]  # predicted peak bytes per stage (module docstring)

    @property
    def num_stages(self) -> int:
        return len(self.points) + 1

    def stage_layers(self, stage: int) -> range:
        """Indices of the layers stage ``stage`` runs."""
        bounds = (0, *self.points, len(self.layers))
        return range(bounds[stage], bounds[stage + 1])

    def describe(self) -> str:
        """One line per stage: layers, measured time, predicted bytes."""
        lines = []
        for k in range(self.num_stages):
            names = [self.layers[i].name for i in self.stage_layers(k)]
            lines.append(
                f"stage {k}: layers {names[0]}..{names[-1]} ({len(names)}), "
                f"{self.stage_seconds[k] * 1e3:.2f} ms/microbatch, {self.stage_bytes[k] / 2**20:.1f} MiB"
            )
        return "\n".join(lines)


def check_pipeline_shape(
    *, num_layers: int, stages: int, virtual_stages: int, microbatches: int, schedule: str, world_size: int
) -> None:
    """Refuse a pipeline that cannot run, with what to change (before anything is built or measured)."""
    if schedule not in SCHEDULES:
        raise PipelineConfigError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if stages < 1 or virtual_stages < 1 or microbatches < 1:
        raise PipelineConfigError(
            f"stages, virtual_stages and microbatches must be at least 1, got {stages}, {virtual_stages}, "
            f"{microbatches}"
        )
    if world_size % stages:
        raise PipelineConfigError(
            f"{world_size} ranks cannot hold {stages}-stage pipelines: the world size must be stages x data-parallel "
            f"replicas; use stages that divide {world_size}, or {stages * max(1, round(world_size / stages))} ranks"
        )
    if virtual_stages > 1 and schedule != "interleaved-1f1b":
        raise PipelineConfigError(
            f"virtual_stages={virtual_stages} needs schedule='interleaved-1f1b' ({schedule!r} runs one stage per rank)"
        )
    total = stages * virtual_stages
    if num_layers < total:
        what = f"{stages} stages x {virtual_stages} virtual stages" if virtual_stages > 1 else f"{stages} stages"
        raise PipelineConfigError(
            f"the model has {num_layers} layers, fewer than the {total} stages of {what}: every stage needs a layer; "
            f"use at most {num_layers} stages in all, or split the model into more layers"
        )
    if schedule == "1f1b" and microbatches < stages:
        raise PipelineConfigError(
            f"1F1B needs at least as many microbatches as stages ({stages}), got {microbatches}: use "
            f"microbatches >= {stages}, or schedule='gpipe'"
        )
    if schedule == "interleaved-1f1b":
        rounds = max(1, microbatches // stages)
        if microbatches % rounds:
            raise PipelineConfigError(
                f"interleaved 1F1B runs microbatches in rounds of {stages} (the pipeline's ranks): {microbatches} "
                f"microbatches is not a whole number of rounds; use a multiple of {stages} (or fewer than {stages})"
            )


def check_batch(batch_size: int, microbatches: int, what: str) -> None:
    """The pipeline splits the batch into equal microbatches (so the mean of their losses is the batch's)."""
    if batch_size % microbatches:
        raise PipelineConfigError(
            f"{what} has {batch_size} samples, which do not split into {microbatches} equal microbatches; use a batch "
            f"size that is a multiple of {microbatches} (with a DataLoader: drop_last=True)"
        )


def _stage_bytes(costs, lo, hi, in_flight: float, optimizer_state_factor: float) -> int:
    params = sum(c.param_bytes for c in costs[lo:hi])
    activations = sum(c.activation_bytes for c in costs[lo:hi])
    return int(params * (2 + optimizer_state_factor) + in_flight * activations)


def _summary(costs, points, chosen, flights, optimizer_state_factor) -> PipelineSplit:
    bounds = (0, *points, len(costs))
    seconds = tuple(sum(c.seconds for c in costs[a:b]) for a, b in zip(bounds, bounds[1:], strict=False))
    nbytes = tuple(
        _stage_bytes(costs, a, b, flights[k], optimizer_state_factor)
        for k, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))
    )
    return PipelineSplit(tuple(points), chosen, tuple(costs), seconds, nbytes)


def choose_split(
    costs: Sequence[LayerCost],
    *,
    stages: int,
    virtual_stages: int = 1,
    microbatches: int,
    schedule: str,
    split: str | Sequence[int] = "auto",
    memory_limit_bytes: int | None = None,
    optimizer_state_factor: float = 2.0,
) -> PipelineSplit:
    """The split points (module docstring): balanced from ``costs`` when ``split="auto"``, else ``split`` checked.
    Raises :class:`PipelineConfigError` when no split fits ``memory_limit_bytes`` or the given points are invalid."""
    total = stages * virtual_stages
    n = len(costs)
    flights = [in_flight(schedule, k, stages, virtual_stages, microbatches) for k in range(total)]
    limit = None if memory_limit_bytes is None else memory_limit_bytes / virtual_stages
    if not isinstance(split, str):
        points = [int(p) for p in split]
        if len(points) != total - 1 or any(b <= a for a, b in zip([0, *points], [*points, n], strict=True)):
            raise PipelineConfigError(
                f"split={list(split)} is not {total - 1} increasing layer indices between 1 and {n - 1} "
                f"({total} stages of {n} layers; stage k starts at layer split[k-1]), e.g. "
                f"{[round(n * k / total) for k in range(1, total)]}"
            )
        return _summary(costs, points, "explicit", flights, optimizer_state_factor)
    if split != "auto":
        raise PipelineConfigError(f"split must be 'auto' or a list of {total - 1} layer indices, got {split!r}")

    def fits(k: int, lo: int, hi: int) -> bool:
        return limit is None or _stage_bytes(costs, lo, hi, flights[k], optimizer_state_factor) <= limit

    if not 1 <= total <= n:
        raise PipelineConfigError(f"cannot cut {n} layers into {total} stages; use at most {n} stages in all")
    starts = balanced_split([c.seconds for c in costs], total, fits)  # the planner's rule, with the memory check
    if starts is None:
        smallest = max(_stage_bytes(costs, i, i + 1, flights[0], optimizer_state_factor) for i in range(n))
        raise PipelineConfigError(
            f"no split of {n} layers into {total} stages fits {memory_limit_bytes / 2**20:.1f} MiB per rank "
            f"(the largest layer alone needs {smallest / 2**20:.1f} MiB with its gradients, optimizer state and "
            f"{flights[0]:g} microbatches of activations); use more stages, fewer microbatches in flight "
            f"(1F1B instead of GPipe), smaller microbatches, or more memory"
        )
    return _summary(costs, starts[1:], "auto", flights, optimizer_state_factor)
