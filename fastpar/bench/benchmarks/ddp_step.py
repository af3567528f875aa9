"""``fastpar bench ddp``: training-step time of fastpar's DDP against stock torch DDP, on the same wire, and
against no communication at all.

One step = ``zero_grad(set_to_none=True)`` + forward + backward + SGD step, loss ``out.square().mean()``.
Models: ``mlp`` ("wide") = 16 x (Linear(1024, 1024) + GELU) on (64, 1024); ``blocks`` ("deep") = 96 x
(Linear(256, 256) + LayerNorm(256) + GELU) on (64, 256). The variants (``ddp_variants``) run interleaved in rounds
on the same ranks; with ``--backend fastpar`` the wrappers also run on a gloo group over the same ranks
(suffix ``_gloo``), so torch's DDP on fastpar's backend is timed beside fastpar's DDP on it, and both beside
their gloo twins and the no-overlap reference on each wire.

Before timing, every variant takes one step on the same batch on every rank; its parameters must then equal stock
DDP's: bit for bit in fp32 (two ranks: every wrapper's sum is the same pair of adds), within a tolerance for the
fp16/bf16 reductions and for other summation orders on more ranks.

Every row also shows the CPU time the rank's process spent per step (all its threads: compute, the backend's
worker, gloo's), the median over the timed steps: on a loaded machine wall time counts other jobs' time slices,
CPU time counts what the step itself burned.

Goals (declared below): fastpar_fp32 <= 0.95x the best fp32 torch variant on the same wire; on the fastpar backend
also fastpar_fp32_gloo <= 0.95x the best fp32 torch variant on gloo, fastpar_fp32 <= 1.15x no_comm and <= 0.80x
ddp_gloo; fastpar_bf16 <= 0.85x ddp_fp16_hook (on each wire); fastpar_auto <= the best of fastpar_cap_1/4/25. A variant faster
than no_comm is flagged, and a goal that compares it is IMPOSSIBLE.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import launch
from ..context import BenchContext
from ..goals import AT_MOST, Goal, Verdict
from ..harness import BenchUsageError, median
from ..table import BenchReport, Column, PlotSpec
from .ddp_variants import (
    FIXED_CAPS,
    GLOO,
    LOW_PRECISION,
    MODELS,
    NICKNAMES,
    TWINNED,
    VARIANTS,
    Trainee,
    available_variants,
    base_of,
    fastpar_cap_mb,
    on_gloo_twin,
    step_call,
)
from .training_step import build_model, check_one_step, floor_flags, pair_flag, parse_models, step_columns, step_header

__all__ = ["VARIANTS", "available_variants", "build_model", "step_call", "step_goals"]

DESCRIPTION = "DDP step time: fastpar vs torch DDP variants on the same wire vs a no-communication step"
USES = {"nproc"}
DEFAULTS = {"iters": 2, "warmup": 1, "rounds": 5}
PEER_VARIANT = "ddp" + GLOO  # stock torch DDP on gloo (--backend fastpar only)
FP32_VS_BEST_TORCH = Goal("fastpar_fp32 step", "the best fp32 torch variant", 0.95, AT_MOST)
FP32_GLOO_VS_BEST_TORCH_GLOO = Goal("fastpar_fp32_gloo step", "the best fp32 torch variant on gloo", 0.95, AT_MOST)
FP32_VS_NO_COMM = Goal("fastpar_fp32 step", "no_comm", 1.15, AT_MOST)  # on the fastpar backend
BF16_VS_FP16_HOOK = Goal("fastpar_bf16 step", "ddp_fp16_hook", 0.85, AT_MOST)
BF16_GLOO_VS_FP16_HOOK_GLOO = Goal("fastpar_bf16_gloo step", "ddp_fp16_hook_gloo", 0.85, AT_MOST)
FP32_VS_GLOO = Goal("fastpar_fp32 step", PEER_VARIANT, 0.80, AT_MOST)  # on the fastpar backend
AUTO_VS_BEST_CAP = Goal("fastpar_auto step", "the best fixed cap", 1.0, AT_MOST)


@dataclass(frozen=True)
class DdpSettings:
    """What ``run`` derived from the ddp flags, for every rank."""

    models: list[str]
    variants: list[str]
    skip_notes: list[str]
    batch: int
    lr: float


class CpuClock:
    """Wraps each variant's step to record the process CPU time (every thread) each call took."""

    def __init__(self) -> None:
        self.calls: dict[str, list[float]] = {}

    def wrap(self, name: str, step: Callable[[], None]) -> Callable[[], None]:
        spent = self.calls.setdefault(name, [])

        def timed() -> None:
            start = time.process_time()
            step()
            spent.append(time.process_time() - start)

        return timed

    def medians(self, timed_calls: int, device: torch.device) -> dict[str, float]:
        """Median CPU seconds of each variant's last ``timed_calls`` calls, the largest over the ranks."""
        names = list(self.calls)
        values = [median(self.calls[n][-timed_calls:]) for n in names]
        return dict(zip(names, launch.slowest(values, device), strict=True))


def _tolerance(variant: str, world_size: int) -> dict:
    base = base_of(variant)
    if base in LOW_PRECISION or base == "no_comm":
        return {"rtol": 1e-3, "atol": 1e-5 if base == "no_comm" else 1e-4}
    if world_size > 2 and (base in FIXED_CAPS or base == "no_overlap"):  # another layout, another summation order
        return {"rtol": 1e-5, "atol": 1e-7}
    return {}


def wires(variants: list[str], twins: bool) -> list[str]:
    """The variants to build: each selected one, then (``twins``: on the fastpar backend) the gloo twin of each
    selected fp32 wrapper."""
    return [*variants, *(v + GLOO for v in variants if twins and v in TWINNED)]


def _rank_main(rank: int, world_size: int, ctx: BenchContext, settings: DdpSettings) -> BenchReport | None:
    device = launch.rank_device(ctx.backend)
    peer_group = launch.gloo_peer(ctx.backend)
    variants = wires(settings.variants, peer_group is not None)
    results: dict[str, dict[str, float]] = {}
    cpu: dict[str, dict[str, float]] = {}
    fastpar_caps: dict[str, str] = {}
    auto_notes: list[str] = []
    for model_name in settings.models:
        width = MODELS[model_name][0]
        caps = f"{fastpar_cap_mb(build_model(model_name)):g}"
        if peer_group is not None:  # the gloo twins get fastpar's cap on gloo
            caps += f" ({fastpar_cap_mb(build_model(model_name), peer_group):g} on gloo)"
        fastpar_caps[model_name] = caps
        trainees = {v: Trainee(v, model_name, device, settings.lr, peer_group) for v in variants}
        check_batch = torch.randn(settings.batch, width, generator=torch.Generator().manual_seed(1)).to(device)
        check_one_step(trainees, check_batch, lambda v: _tolerance(v, world_size), model_name)
        batch = torch.randn(settings.batch, width, generator=torch.Generator().manual_seed(100 + rank)).to(device)
        for variant, trainee in trainees.items():
            if trainee.settle(batch):
                auto_notes.append(f"{model_name} {variant}: {_auto_note(trainee.model.comm_stats()['auto'])}")
        clock = CpuClock()
        steps = {v: clock.wrap(v, lambda t=t, x=batch: t.step(x)) for v, t in trainees.items()}
        results[model_name] = launch.time_on_all_ranks(steps, ctx.plan, device)
        cpu[model_name] = clock.medians(ctx.rounds * ctx.iters, device)
        del trainees
    if rank != 0:
        return None
    return _report(ctx, settings, world_size, results, cpu, fastpar_caps, auto_notes)


def _auto_note(summary: dict) -> str:
    measured = summary.get("measured_step_ms", {})
    steps = ", ".join(f"{k} {v:.1f} ms" for k, v in measured.items())
    return f"chose {summary.get('chosen')}, kept {summary.get('kept')} ({summary.get('buckets')} buckets; {steps})"


def _fp32_torch(seconds: dict[str, float], gloo: bool) -> dict[str, float]:
    """The fp32 torch DDP variants on one wire (the gloo twins, or the main wire)."""
    return {
        v: t
        for v, t in seconds.items()
        if base_of(v).startswith("ddp") and base_of(v) not in LOW_PRECISION and on_gloo_twin(v) == gloo
    }


def step_goals(model_name: str, seconds: dict[str, float], backend: str = "gloo") -> list[Verdict]:
    """The declared goals checked for one model's step times (seconds per variant) on ``backend`` (the main wire;
    the ``_gloo`` twins run on gloo)."""
    flags = floor_flags(model_name, seconds)
    goals = []

    def check(goal: Goal, ours: str, theirs: str, named: bool = False) -> None:
        reference = f"{goal.reference} ({theirs})" if named else None  # name the variant that turned out best
        ratio = seconds[ours] / seconds[theirs]
        goals.append(goal.check(ratio, scope=model_name, reference=reference, flag=pair_flag(flags, ours, theirs)))

    same_wire = _fp32_torch(seconds, gloo=False)
    if "fastpar_fp32" in seconds and same_wire:
        check(FP32_VS_BEST_TORCH, "fastpar_fp32", min(same_wire, key=same_wire.get), named=True)
    on_gloo = _fp32_torch(seconds, gloo=True)
    if "fastpar_fp32" + GLOO in seconds and on_gloo:
        check(FP32_GLOO_VS_BEST_TORCH_GLOO, "fastpar_fp32" + GLOO, min(on_gloo, key=on_gloo.get), named=True)
    if "fastpar_fp32" in seconds and backend == "fastpar":
        check(FP32_VS_NO_COMM, "fastpar_fp32", "no_comm")
    if "fastpar_bf16" in seconds and "ddp_fp16_hook" in seconds:
        check(BF16_VS_FP16_HOOK, "fastpar_bf16", "ddp_fp16_hook")
    if "fastpar_bf16" + GLOO in seconds and "ddp_fp16_hook" + GLOO in seconds:
        check(BF16_GLOO_VS_FP16_HOOK_GLOO, "fastpar_bf16" + GLOO, "ddp_fp16_hook" + GLOO)
    if "fastpar_fp32" in seconds and PEER_VARIANT in seconds:
        check(FP32_VS_GLOO, "fastpar_fp32", PEER_VARIANT)
    fixed = {v: seconds[v] for v in FIXED_CAPS if v in seconds}
    if "fastpar_auto" in seconds and fixed:
        check(AUTO_VS_BEST_CAP, "fastpar_auto", min(fixed, key=fixed.get), named=True)
    return goals


def _report(
    ctx: BenchContext,
    settings: DdpSettings,
    world_size: int,
    results: dict[str, dict[str, float]],
    cpu: dict[str, dict[str, float]],
    fastpar_caps: dict[str, str],
    auto_notes: list[str],
) -> BenchReport:
    rows, footer, goals = [], [], []
    for model_name, seconds in results.items():
        floor, peer = seconds["no_comm"], seconds["ddp"]
        cpu_floor = cpu[model_name]["no_comm"]
        for variant, t in seconds.items():
            spent = cpu[model_name][variant]
            rows.append(
                dict(
                    model=model_name,
                    variant=variant,
                    step_ms=t * 1e3,
                    x_floor=t / floor,
                    x_ddp=t / peer,
                    cpu_ms=spent * 1e3,
                    cpu_x_floor=spent / cpu_floor if cpu_floor > 0 else None,
                )
            )
        footer += [f"beyond a bound: {flag}" for flag in floor_flags(model_name, seconds).values()]
        goals += step_goals(model_name, seconds, ctx.backend)
    caps = ", ".join(f"{m} bucket_cap_mb={c}" for m, c in fastpar_caps.items())
    models = ", ".join(f"{m} ({NICKNAMES[m]})" for m in results)
    twins = any(on_gloo_twin(v) for seconds in results.values() for v in seconds)
    wire = f"{ctx.backend}; variants ending in {GLOO}: a gloo group over the same ranks" if twins else None
    header = step_header(ctx, world_size, settings.batch, models=models, ddp_fastpar_cap=caps)
    if wire:
        header = {"backend": wire, **{k: v for k, v in header.items() if k != "backend"}}
    columns = [
        *step_columns(21),
        Column("cpu_ms", "cpu(ms)", 9, ".1f", "ms"),
        Column("cpu_x_floor", "cpu x no_comm", 14, ".2f", "x"),
    ]
    return BenchReport(
        benchmark="ddp",
        title=f"training step time, {world_size} ranks",
        columns=columns,
        rows=rows,
        header=header,
        footer=footer
        + [f"auto: {note}" for note in auto_notes]
        + ["cpu(ms): CPU time of the rank's process (all threads) per step, median of the timed steps, slowest rank"],
        goals=goals,
        notes=list(settings.skip_notes),
        summary={
            "step_ms": {m: {v: t * 1e3 for v, t in s.items()} for m, s in results.items()},
            "cpu_ms": {m: {v: t * 1e3 for v, t in s.items()} for m, s in cpu.items()},
        },
        plot=PlotSpec("bar", "variant", "x_floor", series="model", ylabel="step time / no-communication step"),
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("ddp")
    group.add_argument("--models", default="mlp,blocks", help="comma-separated of mlp (wide), blocks (deep); both")
    group.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="comma-separated subset (no_comm and ddp always run; with --backend fastpar the wrappers also "
        "run on gloo, as <variant>_gloo)",
    )
    group.add_argument("--batch", type=int, default=64, help="rows per step per rank (default 64)")
    group.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (default 0.01)")


def run(ctx: BenchContext) -> BenchReport | None:
    flags = ctx.flags
    models = parse_models(flags.models, MODELS, flags.batch)
    wanted = {v.strip() for v in flags.variants.split(",") if v.strip()} | {"no_comm", "ddp"}
    if wanted - set(VARIANTS):
        raise BenchUsageError(f"unknown variant(s) {sorted(wanted - set(VARIANTS))}; choose from {', '.join(VARIANTS)}")
    possible, skip_notes = available_variants()
    variants = [v for v in possible if v in wanted]
    settings = DdpSettings(models, variants, skip_notes, flags.batch, flags.lr)
    return launch.run_distributed(_rank_main, ctx, settings)
