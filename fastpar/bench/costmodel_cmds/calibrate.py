"""``fastpar bench calibrate``: measure the cost model on the live process group and write a JSON profile.

On every rank at once: all-reduce / reduce-scatter / all-gather per message size (``-b/-e/-f``), the
bandwidth of packing gradients into buckets and unpacking them (torch DDP's way and fastpar.ops'), when
each gradient of real training steps of ``--model`` becomes ready in backward (post-accumulate-grad
hooks on the bare model), how backward and the collectives slow each other on CPU ranks, and -- unless
``--caps ''`` -- the step time of torch DDP at each bucket cap in ``--caps``. The profile (``--profile``)
holds all of it; ``fastpar bench simulate --profile FILE`` predicts from it.

Everything a step prediction uses is measured in the same interleaved rounds as the DDP steps it is
checked against (``fastpar.bench.calibration``); the report shows, for each measured DDP step, the
step the simulator predicts from the profile (torch's bucket layout at that cap), and the error.
Models: ``mlp``, ``blocks`` (``fastpar bench ddp``'s), ``tiny`` (4 x Linear(256) + GELU, for smoke
tests), or ``package.module:function`` with ``function(batch) -> (model, example_input)``;
loss = ``output.float().square().mean()``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
from dataclasses import dataclass

import torch

from ...costmodel.collective_costs import ring_seconds
from ...costmodel.perf_profile import CollectiveTable, Profile
from .. import launch
from ..context import BenchContext
from ..harness import BenchUsageError, Plan, format_bytes
from ..table import BenchReport, Column, PlotSpec
from .calibration import (
    CONTENTION_BUCKET_BYTES,
    ContentionTrial,
    allreduce_variants,
    ddp_variants,
    fsdp_unit_variants,
    measure_collectives,
    move_variants,
    pipeline_slot_variants,
    step_overheads,
    zero_bucket_variants,
)
from .grad_timeline import GradTimer, slowest_ranks
from .validation import step_goal, validate

DESCRIPTION = "measure collectives, pack/unpack and the gradient timeline on the live group; write a profile"
USES = {"sizes", "nproc"}
DEFAULTS = {"min_bytes": "16K", "max_bytes": "16M", "factor": 4, "iters": 3, "warmup": 1, "rounds": 3}
OPS = ("allreduce", "reducescatter", "allgather")
DEFAULT_PROFILE = "fastpar-profile.json"
REDUCER_MOVES = ("torch_pack", "torch_unpack", "fastpar_pack", "fastpar_unpack")


@dataclass(frozen=True)
class CalibrateSettings:
    """What ``run`` derived from the calibrate flags, for every rank."""

    ops: list[str]
    caps: list[float]
    model: str
    batch: int
    profile: str


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("calibrate")
    group.add_argument("--profile", default=DEFAULT_PROFILE, help=f"profile JSON to write (default {DEFAULT_PROFILE})")
    group.add_argument("--model", default="mlp", help="mlp, blocks, tiny, or package.module:function (default mlp)")
    group.add_argument("--batch", type=int, default=64, help="rows per step per rank (default 64)")
    group.add_argument("--steps", type=int, default=5, help="timed steps of the gradient timeline (default 5)")
    group.add_argument("--caps", default="1,4,25", help="torch DDP bucket caps (MB) to measure and predict; '' skips")
    group.add_argument("--ops", default=",".join(OPS), help=f"collectives to measure (default {','.join(OPS)})")


def _model_factory(model: str, batch: int):
    """``(build() -> model, input shape source)`` for --model; the same weights on every call."""
    if model in ("mlp", "blocks"):
        from ..benchmarks.training_step import MODELS, build_model

        width = MODELS[model][0]
        return (lambda: build_model(model)), (lambda gen: torch.randn(batch, width, generator=gen))
    if model == "tiny":  # for smoke tests: 4 x (Linear(256, 256) + GELU)

        def tiny() -> torch.nn.Module:
            torch.manual_seed(0)
            return torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(256, 256), torch.nn.GELU())])

        return tiny, (lambda gen: torch.randn(batch, 256, generator=gen))
    module_name, _, function = model.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), function)
    except (ImportError, AttributeError, ValueError) as exc:
        raise BenchUsageError(
            f"--model {model!r}: cannot load it ({exc}); use mlp, blocks, tiny or package.module:function"
        ) from None

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return factory(batch)[0]

    example = factory(batch)[1]
    return build, (lambda gen: torch.randn(example.shape, generator=gen).to(example.dtype))


def _loss(output: torch.Tensor) -> torch.Tensor:
    return output.float().square().mean()


def _rank_main(rank: int, world_size: int, ctx: BenchContext, settings: CalibrateSettings) -> BenchReport | None:
    device = launch.rank_device(ctx.backend)
    plan = ctx.plan
    measure_collectives(["allreduce"], ctx.sizes, device, rank, world_size, plan, timed=False)  # checked only
    tables = measure_collectives(
        [op for op in settings.ops if op != "allreduce"], ctx.sizes, device, rank, world_size, plan
    )
    build, make_input = _model_factory(settings.model, settings.batch)
    batch = make_input(torch.Generator().manual_seed(100 + rank)).to(device)
    model = build().to(device)
    timer = GradTimer(model, torch.optim.SGD(model.parameters(), lr=0.01), _loss)
    for _ in range(2):  # a first estimate of backward, for the contention trial's length
        timer.step(batch)
    first = slowest_ranks(timer.timeline(skip=1), device)
    variants: dict = {"no_comm": lambda: timer.step(batch)}
    if settings.caps:
        check = make_input(torch.Generator().manual_seed(1)).to(device)
        variants |= ddp_variants(lambda: build().to(device), batch, check, _loss, settings.caps, device)
    variants |= move_variants(timer.params, device, world_size)
    allreduces = allreduce_variants(ctx.sizes, device, rank, world_size)
    variants |= allreduces
    variants |= fsdp_unit_variants(device, rank)
    variants |= pipeline_slot_variants(device, world_size)
    variants |= zero_bucket_variants(device, rank)
    trial = None
    if device.type == "cpu":  # gloo's threads and backward share the cores
        probe = allreduce_variants([CONTENTION_BUCKET_BYTES], device, rank, world_size)
        wire_4mb = launch.time_on_all_ranks(probe, Plan(1, 1, 3), device)
        trial = ContentionTrial(
            build().to(device), batch, _loss, device, first.backward_s, next(iter(wire_4mb.values()))
        )
        variants["contention"] = trial
    seconds = launch.time_on_all_ranks(variants, plan, device)
    timer.close()
    timeline = slowest_ranks(timer.timeline(skip=2 + plan.warmup), device)
    # per-part medians (slowest rank) need not add up to the median step the harness measured in the same
    # rounds; the measured compute-only step is the reference, the timeline keeps its shape
    scale = seconds["no_comm"] / timeline.compute_s
    timeline = timeline.scaled(scale)
    contention = trial.result(skip=plan.warmup) if trial else {"compute_slowdown": 0.0, "wire_slowdown": 0.0}
    if rank != 0:
        return None
    tables = {
        "allreduce": CollectiveTable([int(n.split("_")[1]) for n in allreduces], [seconds[n] for n in allreduces]),
        **tables,
    }
    grad_bytes = sum(g.nbytes for g in timeline.grads)
    steps = {"no_comm": None} | {f"ddp_cap_{cap:g}mb": cap for cap in settings.caps}
    profile = Profile(
        backend=ctx.backend,
        device=device.type,
        world_size=world_size,
        collectives=tables,
        moves_gbs={name: grad_bytes / seconds[name] / 1e9 for name in REDUCER_MOVES},
        contention=contention,
        overheads=step_overheads(seconds, world_size),
        timeline=timeline,
        model={
            "name": settings.model,
            "batch": settings.batch,
            "parameters": len(timeline.grads),
            "gradient_bytes": grad_bytes,
        },
        measured=[
            {
                "variant": "torch_ddp" if cap else "no_comm",
                "bucket_cap_mb": cap,
                "world_size": world_size,
                "step_s": seconds[name],
                "source": "measured by this calibrate run, in the same rounds as the profile",
            }
            for name, cap in steps.items()
        ],
        threads=ctx.threads,
        meta={
            "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": ctx.command,
            "timeline_scale": scale,  # hook medians (slowest rank) -> the measured no_comm step
        },
    )
    return _report(ctx, settings, profile, str(profile.save(settings.profile)))


def _report(ctx: BenchContext, settings: CalibrateSettings, profile: Profile, profile_path: str) -> BenchReport:

    rows = []
    for op, table in profile.collectives.items():
        alpha, beta = profile.fit(op)
        fitted = profile.fitted_fabric(op)
        for nbytes, seconds in zip(table.nbytes, table.seconds, strict=True):
            model = ring_seconds(op, nbytes, profile.world_size, fitted)
            rows.append(
                dict(
                    kind=op,
                    item=format_bytes(nbytes),
                    measured_ms=seconds * 1e3,
                    model_ms=model * 1e3,
                    error=model / seconds - 1,
                    detail=f"fit: alpha {alpha * 1e6:.1f} us/step, busbw {1 / beta / 1e9:.3g} GB/s",
                )
            )
    grad_bytes = profile.model["gradient_bytes"]
    for name, gbs in profile.moves_gbs.items():
        rows.append(dict(kind="move", item=name, measured_ms=grad_bytes / gbs / 1e6, detail=f"{gbs:.3g} GB/s"))
    t = profile.timeline
    for name, seconds in (("forward", t.forward_s), ("backward", t.backward_s), ("optimizer", t.optimizer_s)):
        rows.append(dict(kind="compute", item=name, measured_ms=seconds * 1e3, detail=f"{len(t.grads)} gradients"))
    for name in ("compute_slowdown", "wire_slowdown"):
        rows.append(dict(kind="contention", item=name, detail=f"{profile.contention[name]:.3f}"))
    for name, size in (
        ("fsdp_unit_s", "fsdp_unit_bytes"),
        ("fsdp_regather_s", "fsdp_unit_bytes"),
        ("pipeline_slot_s", "pipeline_message_bytes"),
        ("zero_bucket_s", "zero_bucket_bytes"),
    ):
        if name in profile.overheads:
            what = {"fsdp": "units", "pipeline": "messages", "zero": "buckets"}[size.split("_")[0]]
            detail = f"{format_bytes(profile.overheads[size])} {what}"
            rows.append(dict(kind="overhead", item=name, measured_ms=profile.overheads[name] * 1e3, detail=detail))
    checks = validate(profile)
    for check in checks:
        rows.append(
            dict(
                kind="step",
                item=check.name,
                measured_ms=check.measured * 1e3,
                model_ms=check.predicted * 1e3,
                error=check.error,
                detail=check.detail,
            )
        )
    footer = [
        f"profile: {profile_path} ({len(t.grads)} gradients, {format_bytes(grad_bytes)}; "
        f"predict with: fastpar bench simulate --profile {profile_path})",
        "model_ms of a collective: the ring formula with the fitted alpha/beta (fastpar.costmodel.collective_costs)",
        "model_ms of a step: fastpar.costmodel.step_simulator with torch's bucket layout at that cap",
        f"timeline: hook medians (slowest rank) x {profile.meta['timeline_scale']:.3f} = the no_comm step measured "
        "in the same rounds",
    ]
    summary: dict = {"profile": profile_path, "contention": profile.contention, "moves_gbs": profile.moves_gbs}
    steps = [c for c in checks if c.name.startswith("torch_ddp")]
    goals = [step_goal(steps)] if steps else []
    if steps:
        summary["worst_step_error"] = goals[0].value
    return BenchReport(
        benchmark="calibrate",
        title=f"cost model calibration, {profile.world_size} {profile.backend} ranks, model {settings.model}",
        columns=[
            Column("kind", "kind", 13),
            Column("item", "item", 20),
            Column("measured_ms", "measured(ms)", 13, ".3f", "ms"),
            Column("model_ms", "model(ms)", 10, ".3f", "ms"),
            Column("error", "error", 8, "+.1%"),
            Column("detail", "detail", 0),
        ],
        rows=rows,
        header={
            "backend": profile.backend,
            "world size": str(profile.world_size),
            "threads per rank": str(ctx.threads),
            "timing": f"median of {ctx.rounds} rounds x {ctx.iters} iters after {ctx.warmup} warm-up, slowest rank",
        },
        footer=footer,
        goals=goals,
        summary=summary,
        plot=PlotSpec("bar", "item", "error", series="kind", ylabel="model / measured - 1"),
    )


def run(ctx: BenchContext) -> BenchReport | None:
    flags = ctx.flags
    ops = [op.strip() for op in flags.ops.split(",") if op.strip()]
    unknown = sorted(set(ops) - set(OPS))
    if unknown or "allreduce" not in ops:
        raise BenchUsageError(f"--ops must include allreduce and may add reducescatter, allgather; got {flags.ops!r}")
    try:
        caps = [float(c) for c in flags.caps.split(",") if c.strip()]
    except ValueError:
        raise BenchUsageError(f"--caps takes bucket sizes in MB like 1,4,25; got {flags.caps!r}") from None
    if any(c <= 0 for c in caps):
        raise BenchUsageError(f"--caps must be positive MB, got {flags.caps!r}")
    if flags.batch < 1 or flags.steps < 1:
        raise BenchUsageError("--batch and --steps must be at least 1")
    from ..cli import check_writable

    check_writable(flags.profile, "--profile", directory=False)  # before minutes of measuring, not after
    _model_factory(flags.model, flags.batch)  # a bad --model fails here, before any rank starts
    world = launch.resolve_world(ctx.nproc, ctx.backend)
    if world.nproc < 2:
        raise BenchUsageError("calibrate needs at least 2 ranks (one rank has no collectives to measure): --nproc 2")
    ctx.backend = world.backend
    settings = CalibrateSettings(ops, caps, flags.model, flags.batch, flags.profile)
    return launch.run_ranks(_rank_main, world, ctx, settings, threads=ctx.threads)
