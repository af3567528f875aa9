"""``fastpar bench simulate``: predict step time, exposed communication and scaling efficiency for N ranks.

From a profile (``fastpar bench calibrate --profile FILE``, or ``published:NAME`` for a published
measurement rebuilt from its own inputs, see ``published``) and a fabric: ``--preset``,
``--topology FILE`` (``fastpar topo --json`` output or saved ``nvidia-smi topo -m``), or by default the
profile's own measured network (alpha/beta fitted to its all-reduce, a flat ring). Collective costs:
``fastpar.costmodel.collective_costs`` (ring and tree formulas with their sources); the step:
``fastpar.costmodel.step_simulator``. For each N and each bucket cap (torch DDP's layout at that cap; ``auto``
= ``fastpar.costmodel.bucket_optimizer.plan_buckets``) one row: step, exposed communication, efficiency =
compute-only step / predicted step (weak scaling: the same batch per rank).

Validation, in the same output: every step the profile measured (torch DDP on the calibrated ranks)
against its prediction from the profile's own measurements, with the declared goal (``validation``); for a
published case, its published efficiencies against the prediction.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from ...costmodel.bucket_optimizer import plan_buckets, torch_layout
from ...costmodel.collective_costs import Fabric, algorithm_for
from ...costmodel.fabrics import PRESETS, fabric_from_topology, load_topology, preset, with_overrides
from ...costmodel.perf_profile import REDUCERS, Profile
from ...costmodel.step_simulator import simulate_step
from ..context import BenchContext
from ..harness import BenchUsageError
from ..table import BenchReport, Column, PlotSpec
from .published import CASES, PublishedCase, case
from .validation import comm_on, step_goal, validate

DESCRIPTION = "predict step time, exposed comm and scaling efficiency for 1..1024 GPUs from a profile + fabric"
USES: set[str] = set()
DEFAULTS: dict = {}
DEFAULT_RANKS = ",".join(str(1 << k) for k in range(11))  # 1, 2, 4, ..., 1024


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("simulate")
    group.add_argument(
        "--profile",
        required=True,
        help=f"profile JSON from 'fastpar bench calibrate', or published:NAME ({', '.join(CASES)})",
    )
    where = group.add_mutually_exclusive_group()
    where.add_argument("--preset", help=f"named fabric: {', '.join(PRESETS)}")
    where.add_argument("--topology", metavar="FILE", help="fastpar topo --json output or saved nvidia-smi topo -m")
    group.add_argument(
        "--intra-gbs", type=float, help="intra-node all-reduce busbw in GB/s (measured; replaces the model)"
    )
    group.add_argument("--inter-gbps", type=float, help="network speed per node in Gb/s, all NICs together")
    group.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: the fabric's)")
    group.add_argument("--ranks", default=DEFAULT_RANKS, help=f"comma-separated N (default {DEFAULT_RANKS})")
    group.add_argument("--caps", default="1,4,25,auto", help="bucket caps in MB, and/or auto (default 1,4,25,auto)")
    group.add_argument(
        "--reducer",
        choices=list(REDUCERS),
        default="torch",
        help="how gradients move into buckets: pack/unpack costs from the profile (default torch)",
    )
    group.add_argument(
        "--compute-scale",
        type=float,
        default=1.0,
        help="multiply the profile's compute and pack/unpack times (e.g. 0.05 for a device 20x faster)",
    )


def load(spec: str) -> tuple[Profile, PublishedCase | None]:
    """The profile a ``--profile`` names: a file, or ``published:NAME`` (a profile with no measured network)."""
    if spec.startswith("published:"):
        published = case(spec.split(":", 1)[1])
        return Profile("nccl", "cuda", 1, {}, timeline=published.timeline(), model={"name": published.title}), published
    return Profile.load(spec), None


def _fabric(flags: argparse.Namespace, profile: Profile, published: PublishedCase | None) -> Fabric:
    if flags.preset:
        fabric = preset(flags.preset)
    elif flags.topology:
        fabric = fabric_from_topology(load_topology(flags.topology), inter_gbps=flags.inter_gbps)
    elif published is not None:
        fabric = published.fabric(max(published.efficiency))
    else:
        fabric = profile.fitted_fabric()
    return with_overrides(
        fabric, intra_gbs=flags.intra_gbs, inter_gbps=flags.inter_gbps, gpus_per_node=flags.gpus_per_node
    )


def _parse(flags: argparse.Namespace) -> tuple[list[int], list[float | str]]:
    try:
        ranks = [int(r) for r in flags.ranks.split(",") if r.strip()]
        caps: list[float | str] = [
            c.strip() if c.strip() == "auto" else float(c) for c in flags.caps.split(",") if c.strip()
        ]
    except ValueError:
        raise BenchUsageError(
            f"--ranks takes integers and --caps MB or auto; got {flags.ranks!r}, {flags.caps!r}"
        ) from None
    if not ranks or min(ranks) < 1:
        raise BenchUsageError(f"--ranks must be positive integers, got {flags.ranks!r}")
    if not caps or any(c != "auto" and c <= 0 for c in caps):
        raise BenchUsageError(f"--caps must be positive MB or auto, got {flags.caps!r}")
    if flags.compute_scale <= 0:
        raise BenchUsageError(f"--compute-scale must be positive, got {flags.compute_scale}")
    return ranks, caps


def run(ctx: BenchContext) -> BenchReport:
    flags = ctx.flags
    ranks, caps = _parse(flags)
    try:
        profile, published = load(flags.profile)
        fabric = _fabric(flags, profile, published)
        if profile.timeline is None:
            raise ValueError(f"{flags.profile} has no gradient timeline; calibrate with a model")
        timeline = profile.timeline.scaled(flags.compute_scale)
        # the profile's contention factors describe its own CPU ranks; a named GPU fabric gets none
        own_network = not (flags.preset or flags.topology)
        costs = published.costs if published else profile.sync_costs(flags.reducer, contention=own_network)
        # packing and unpacking run on the same device as the compute: they scale with it
        costs = replace(
            costs,
            pack_s_per_byte=costs.pack_s_per_byte * flags.compute_scale,
            unpack_s_per_byte=costs.unpack_s_per_byte * flags.compute_scale,
        )
        rows, skipped = [], [n for n in ranks if n > fabric.gpus_per_node and fabric.inter is None]
        for n in (n for n in ranks if n not in skipped):
            comm, nodes = comm_on(fabric, n), fabric.nodes(n)
            for cap in caps:
                if cap == "auto":
                    plan = plan_buckets(timeline, comm, costs)
                    buckets, prediction, label, layout = plan.buckets, plan.prediction, "auto", plan.chosen
                else:
                    buckets = torch_layout(timeline, cap)
                    prediction, label, layout = simulate_step(timeline, buckets, comm, costs), f"{cap:g} MB", "torch"
                rows.append(
                    dict(
                        ranks=n,
                        nodes=nodes,
                        cap=label,
                        layout=layout,
                        buckets=len(buckets),
                        step_ms=prediction.step_s * 1e3,
                        exposed_ms=prediction.exposed_s * 1e3,
                        wire_ms=prediction.wire_busy_s * 1e3,
                        efficiency=prediction.efficiency(timeline.compute_s),
                        algorithm=algorithm_for(4 << 20, n, fabric) if n > 1 else "-",
                    )
                )
    except (ValueError, KeyError, OSError) as exc:
        raise BenchUsageError(str(exc)) from None
    if not rows:
        raise BenchUsageError(
            f"every --ranks value is above the {fabric.gpus_per_node} GPUs of one {fabric.name} node, and the fabric "
            "has no inter-node network: give --inter-gbps (Gb/s per node) or fewer ranks"
        )
    report = _report(flags, profile, published, fabric, timeline, rows)
    if skipped:
        report.notes.append(
            f"ranks {','.join(map(str, skipped))} skipped: more than one node of {fabric.gpus_per_node} and no "
            "inter-node network in this fabric (give --inter-gbps)"
        )
    return report


def _fabric_line(fabric: Fabric) -> str:
    intra = f"{fabric.intra.bus_gbs:.4g} GB/s busbw, {fabric.intra.latency_us:g} us/step"
    if fabric.inter is None and fabric.gpus_per_node >= 1 << 20:
        return f"one flat ring, {intra}, ring only"
    inter = f"{fabric.inter.bus_gbs:.4g} GB/s, {fabric.inter.latency_us:g} us/step" if fabric.inter else "none"
    return f"{fabric.gpus_per_node} per node, intra {intra}; inter {inter}; base {fabric.base_latency_us:g} us per call"


def _report(flags, profile, published, fabric, timeline, rows) -> BenchReport:
    checks = validate(profile, published)
    footer = [f"fabric: {fabric.name}: {_fabric_line(fabric)}"]
    footer += [f"  source: {s}" for s in fabric.sources]
    footer.append(
        "collectives: ring/tree formulas of fastpar.costmodel.collective_costs (Thakur et al. 2005; NCCL tuning.cc; "
        "Sanders et al. 2009); algorithm column: what a 4 MB all-reduce uses"
    )
    summary: dict = {"fabric": fabric.name, "compute_s": timeline.compute_s}
    for check in checks:
        unit = (lambda v: f"{v:.1%}") if published else (lambda v: f"{v * 1e3:.1f} ms")
        footer.append(
            f"validation {check.name}: measured {unit(check.measured)}, predicted {unit(check.predicted)} "
            f"({check.error:+.1%}; {check.detail})"
        )
    if published:
        footer.append(f"published: {published.source}")
        summary["published_errors"] = {c.name: c.error for c in checks}
    steps = [c for c in checks if c.name.startswith("torch_ddp")]
    goals = [step_goal(steps)] if steps else []
    if steps:
        summary["worst_step_error"] = goals[0].value
    notes = []
    if (
        profile.device == "cpu"
        and fabric.intra.latency_us < 50
        and flags.compute_scale == 1.0
        and (flags.preset or flags.topology)
    ):
        notes.append(
            "compute times are this profile's CPU timings; for a GPU fabric calibrate on the GPUs or use "
            "--compute-scale"
        )
    header = {
        "profile": flags.profile,
        "model": str(profile.model.get("name", "?")),
        "compute step (no communication)": f"{timeline.compute_s * 1e3:.2f} ms ({len(timeline.grads)} gradients)",
        "reducer": "as published" if published else flags.reducer,
        "contention": "none"
        if published or flags.preset or flags.topology
        else "compute x{:.2f}, wire x{:.2f} while both run (the profile's)".format(
            1 + profile.contention.get("compute_slowdown", 0.0), 1 + profile.contention.get("wire_slowdown", 0.0)
        ),
    }
    return BenchReport(
        benchmark="simulate",
        title=f"predicted scaling on {fabric.name}",
        columns=[
            Column("ranks", "ranks", 6),
            Column("nodes", "nodes", 6),
            Column("cap", "cap", 7),
            Column("layout", "layout", 14),
            Column("buckets", "buckets", 8),
            Column("step_ms", "step(ms)", 10, ".2f", "ms"),
            Column("exposed_ms", "exposed(ms)", 12, ".2f", "ms"),
            Column("wire_ms", "wire(ms)", 10, ".2f", "ms"),
            Column("efficiency", "efficiency", 11, ".1%"),
            Column("algorithm", "algo", 5),
        ],
        rows=rows,
        header=header,
        footer=footer,
        goals=goals,
        notes=notes,
        summary=summary,
        plot=PlotSpec("line", "ranks", "efficiency", series="cap", ylabel="scaling efficiency (compute / step)"),
    )
