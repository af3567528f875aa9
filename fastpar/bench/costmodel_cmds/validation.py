"""A profile's own measurements against the cost model's predictions of them: what ``fastpar bench calibrate``
and ``fastpar bench simulate`` both report, with the declared goal on predicted DDP steps.

For a calibrated profile: the measured no-communication step against the profile's timeline, and each torch DDP
step it measured against the step simulated with torch's bucket layout at that cap. For a published case: its
published scaling efficiencies against the prediction.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...costmodel.bucket_optimizer import size_capped_buckets, torch_layout
from ...costmodel.collective_costs import Fabric, collective_seconds
from ...costmodel.perf_profile import Profile
from ...costmodel.step_simulator import simulate_step
from ..goals import AT_MOST, Goal, Verdict
from .published import PublishedCase

STEP_ERROR = Goal("predicted step error", "of measured", 0.15, AT_MOST, unit="%")


@dataclass
class Check:
    """One measured number against its prediction: a step time (seconds) or a scaling efficiency."""

    name: str
    measured: float
    predicted: float
    detail: str = ""

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1.0


def comm_on(fabric: Fabric, ranks: int):
    return lambda nbytes: collective_seconds("allreduce", nbytes, ranks, fabric)


def validate(profile: Profile, published: PublishedCase | None = None) -> list[Check]:
    """Each measurement the profile (or published case) carries, against the model's prediction of it."""
    timeline = profile.timeline
    checks = []
    if published is not None:
        for ranks, measured in published.efficiency.items():
            grads = timeline.grads
            if published.caps_bytes:
                buckets = size_capped_buckets(grads, published.caps_bytes, fit=published.fit)
            else:
                buckets = [[g.index] for g in grads]
            fabric = published.fabric(ranks)
            predicted = simulate_step(timeline, buckets, comm_on(fabric, ranks), published.costs)
            checks.append(
                Check(
                    f"efficiency, {ranks} GPUs",
                    measured,
                    predicted.efficiency(timeline.compute_s),
                    f"{len(buckets)} collectives, exposed {predicted.exposed_s * 1e3:.1f} ms",
                )
            )
        return checks
    for entry in profile.measured:
        if entry.get("world_size") != profile.world_size or "step_s" not in entry:
            continue
        if entry["variant"] == "no_comm":
            checks.append(Check("no_comm (compute only)", entry["step_s"], timeline.compute_s, "profile's timeline"))
        elif entry["variant"] == "torch_ddp":
            cap = entry["bucket_cap_mb"]
            buckets = torch_layout(timeline, cap)
            predicted = simulate_step(timeline, buckets, profile.comm(), profile.sync_costs("torch"))
            checks.append(
                Check(
                    f"torch_ddp cap {cap:g} MB",
                    entry["step_s"],
                    predicted.step_s,
                    f"{len(buckets)} buckets, exposed {predicted.exposed_s * 1e3:.1f} ms",
                )
            )
    return checks


def step_goal(steps: list[Check]) -> Verdict:
    """The goal on predicted DDP steps: the worst error within the threshold, each step's error listed."""
    worst = max(abs(c.error) for c in steps)
    listing = ", ".join(f"{c.name} {c.error:+.1%}" for c in steps)
    return STEP_ERROR.check(worst, detail=f"worst of {listing}")
