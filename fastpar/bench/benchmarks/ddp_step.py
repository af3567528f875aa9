"""``fastpar bench ddp``: training-step time of fastpar's DDP against stock torch DDP and no communication.

One step = ``zero_grad(set_to_none=True)`` + forward + backward + SGD step, loss ``out.square().mean()``.
Models: ``mlp`` = 16 x (Linear(1024, 1024) + GELU) on (64, 1024); ``blocks`` = 96 x (Linear(256, 256) +
LayerNorm(256) + GELU) on (64, 256). Variants, interleaved in rounds on the same ranks:

  no_comm           the bare model, no DDP: the floor
  ddp               torch DistributedDataParallel with its defaults: the peer
  ddp_bucket_view   gradient_as_bucket_view=True
  ddp_batched_copy  batched_grad_copy=True (only when the installed torch has it)
  ddp_fastpar_cap   torch DDP with bucket_cap_mb set to the cap fastpar chooses for this model
  ddp_fp16_hook     torch DDP + fp16_compress_hook
  fastpar_fp32      fastpar.DistributedDataParallel
  fastpar_bf16      fastpar.DistributedDataParallel(grad_dtype=torch.bfloat16)
  fastpar_cap_<C>   fastpar.DistributedDataParallel(bucket_cap_mb=C), C = 1, 4, 25
  fastpar_auto      fastpar.DistributedDataParallel(bucket_cap_mb="auto"), settled before timing (the
                    steps it measures and decides in are run first, on the same batch)
  ddp_gloo          with --backend fastpar: torch DDP on a gloo group over the same ranks (stock CPU DDP)

Before timing, every variant takes one step on the same batch on every rank; its parameters must then
equal stock DDP's: bit for bit in fp32, within a tolerance for the fp16/bf16 reductions.

Goals (declared below): fastpar_fp32 <= 0.92x the best fp32 torch variant; fastpar_bf16 <= 0.85x
ddp_fp16_hook; fastpar_auto <= the best of fastpar_cap_1/4/25; on the fastpar backend fastpar_fp32 <=
0.80x ddp_gloo. A variant faster than no_comm is flagged, and a goal that compares it is IMPOSSIBLE.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .. import launch
from ..context import BenchContext
from ..goals import AT_MOST, Goal, Verdict
from ..harness import BenchUsageError
from ..table import BenchReport, PlotSpec
from .training_step import MODELS as ALL_MODELS
from .training_step import (
    build_model,
    check_one_step,
    floor_flags,
    pair_flag,
    parse_models,
    step_columns,
    step_header,
)

DESCRIPTION = "DDP step time: fastpar vs torch DDP variants vs a no-communication step"
USES = {"nproc"}
DEFAULTS = {"iters": 2, "warmup": 1, "rounds": 5}
MODELS = {name: ALL_MODELS[name] for name in ("mlp", "blocks")}
VARIANTS = (
    "no_comm",
    "ddp",
    "ddp_bucket_view",
    "ddp_batched_copy",
    "ddp_fastpar_cap",
    "ddp_fp16_hook",
    "fastpar_fp32",
    "fastpar_bf16",
    "fastpar_cap_1",
    "fastpar_cap_4",
    "fastpar_cap_25",
    "fastpar_auto",
)
LOW_PRECISION = ("ddp_fp16_hook", "fastpar_bf16")
PEER_VARIANT = "ddp_gloo"  # --backend fastpar only
FIXED_CAPS = ("fastpar_cap_1", "fastpar_cap_4", "fastpar_cap_25")
AUTO_SETTLE_MAX_STEPS = 60
FP32_VS_BEST_TORCH = Goal("fastpar_fp32 step", "the best fp32 torch variant", 0.92, AT_MOST)
BF16_VS_FP16_HOOK = Goal("fastpar_bf16 step", "ddp_fp16_hook", 0.85, AT_MOST)
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


def available_variants() -> tuple[list[str], list[str]]:
    """Variants this installation can run, and a note for each one it cannot."""
    from torch.nn.parallel import DistributedDataParallel

    names, notes = list(VARIANTS), []
    if "batched_grad_copy" not in inspect.signature(DistributedDataParallel.__init__).parameters:
        names.remove("ddp_batched_copy")
        notes.append(f"ddp_batched_copy skipped: torch {torch.__version__} DDP has no batched_grad_copy")
    try:
        importlib.import_module("fastpar.ddp").DistributedDataParallel  # noqa: B018
    except (ImportError, AttributeError) as exc:
        names = [n for n in names if not n.startswith("fastpar")]
        notes.append(f"fastpar_fp32/fastpar_bf16 skipped: fastpar.DistributedDataParallel is not available ({exc})")
    return names, notes


def wrap(variant: str, model: nn.Module, peer_group=None) -> nn.Module:
    """``model`` wrapped as ``variant`` (on CPU; a CUDA model gets its device id); ``peer_group`` is the gloo
    group of ``ddp_gloo``."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    device_ids = [next(model.parameters()).device.index] if next(model.parameters()).is_cuda else None
    if variant == "no_comm":
        return model
    if variant == "ddp":
        return TorchDDP(model, device_ids=device_ids)
    if variant == PEER_VARIANT:
        return TorchDDP(model, device_ids=device_ids, process_group=peer_group)
    if variant == "ddp_bucket_view":
        return TorchDDP(model, device_ids=device_ids, gradient_as_bucket_view=True)
    if variant == "ddp_batched_copy":
        return TorchDDP(model, device_ids=device_ids, batched_grad_copy=True)
    if variant == "ddp_fastpar_cap":
        return TorchDDP(model, device_ids=device_ids, bucket_cap_mb=fastpar_cap_mb(model))
    if variant == "ddp_fp16_hook":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

        wrapped = TorchDDP(model, device_ids=device_ids)
        wrapped.register_comm_hook(None, fp16_compress_hook)
        return wrapped
    from ...ddp import DistributedDataParallel as FastparDDP

    if variant == "fastpar_fp32":
        return FastparDDP(model, device_ids=device_ids)
    if variant == "fastpar_bf16":
        return FastparDDP(model, device_ids=device_ids, grad_dtype=torch.bfloat16)
    if variant.startswith("fastpar_cap_"):
        return FastparDDP(model, device_ids=device_ids, bucket_cap_mb=float(variant.removeprefix("fastpar_cap_")))
    if variant == "fastpar_auto":
        return FastparDDP(model, device_ids=device_ids, bucket_cap_mb="auto")
    raise ValueError(f"unknown variant {variant!r}")


def fastpar_cap_mb(model: nn.Module) -> float:
    """The bucket cap (MB) fastpar's DDP picks for ``model`` on this process group when given none."""
    import torch.distributed as dist

    from ...ddp.buckets import default_caps

    params = [p for p in model.parameters() if p.requires_grad]
    return default_caps(params, dist.get_world_size())[-1] / 2**20


class Trainee:
    """One variant's model, optimizer and step."""

    def __init__(self, variant: str, model_name: str, device: torch.device, lr: float, peer_group=None) -> None:
        self.model = wrap(variant, build_model(model_name).to(device), peer_group)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)

    def step(self, x: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.model(x).square().mean().backward()
        self.optimizer.step()

    def settle(self, x: torch.Tensor) -> int:
        """With bucket_cap_mb="auto": train on ``x`` until the layout is decided; returns the steps taken."""
        auto = getattr(getattr(self.model, "reducer", None), "auto", None)
        steps = 0
        while auto is not None and auto.phase not in ("done", "off") and steps < AUTO_SETTLE_MAX_STEPS:
            self.step(x)
            steps += 1
        return steps

    def flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])


def step_call(rank: int, world_size: int, variant: str, model_name: str, batch: int = 64) -> Callable[[], None]:
    """One rank's training step of ``variant`` on CPU (for ``fastpar.bench.peers``)."""
    trainee = Trainee(variant, model_name, torch.device("cpu"), lr=0.01)
    x = torch.randn(batch, MODELS[model_name][0], generator=torch.Generator().manual_seed(100 + rank))
    trainee.settle(x)
    return lambda: trainee.step(x)


def _tolerance(variant: str, world_size: int) -> dict:
    if variant not in LOW_PRECISION and variant != "no_comm":
        if world_size > 2 and variant in FIXED_CAPS:  # another layout, another summation order
            return {"rtol": 1e-5, "atol": 1e-7}
        return {}
    return {"rtol": 1e-3, "atol": 1e-5 if variant == "no_comm" else 1e-4}


def _rank_main(rank: int, world_size: int, ctx: BenchContext, settings: DdpSettings) -> BenchReport | None:
    device = launch.rank_device(ctx.backend)
    peer_group = launch.gloo_peer(ctx.backend)
    variants = [*settings.variants, PEER_VARIANT] if peer_group is not None else settings.variants
    results: dict[str, dict[str, float]] = {}
    fastpar_caps: dict[str, float] = {}
    auto_notes: list[str] = []
    for model_name in settings.models:
        width = MODELS[model_name][0]
        fastpar_caps[model_name] = fastpar_cap_mb(build_model(model_name))
        trainees = {v: Trainee(v, model_name, device, settings.lr, peer_group) for v in variants}
        check_batch = torch.randn(settings.batch, width, generator=torch.Generator().manual_seed(1)).to(device)
        check_one_step(trainees, check_batch, lambda v: _tolerance(v, world_size), model_name)
        batch = torch.randn(settings.batch, width, generator=torch.Generator().manual_seed(100 + rank)).to(device)
        for variant, trainee in trainees.items():
            if trainee.settle(batch):
                auto_notes.append(f"{model_name} {variant}: {_auto_note(trainee.model.comm_stats()['auto'])}")
        results[model_name] = launch.time_on_all_ranks(
            {v: (lambda t=t, x=batch: t.step(x)) for v, t in trainees.items()}, ctx.plan, device
        )
        del trainees
    if rank != 0:
        return None
    return _report(ctx, settings, world_size, results, fastpar_caps, auto_notes)


def _auto_note(summary: dict) -> str:
    measured = summary.get("measured_step_ms", {})
    steps = ", ".join(f"{k} {v:.1f} ms" for k, v in measured.items())
    return f"chose {summary.get('chosen')}, kept {summary.get('kept')} ({summary.get('buckets')} buckets; {steps})"


def step_goals(model_name: str, seconds: dict[str, float]) -> list[Verdict]:
    """The declared goals checked for one model's step times (seconds per variant)."""
    flags = floor_flags(model_name, seconds)
    goals = []

    def check(goal: Goal, ours: str, theirs: str, named: bool = False) -> None:
        reference = f"{goal.reference} ({theirs})" if named else None  # name the variant that turned out best
        ratio = seconds[ours] / seconds[theirs]
        goals.append(goal.check(ratio, scope=model_name, reference=reference, flag=pair_flag(flags, ours, theirs)))

    fp32_torch = {v: t for v, t in seconds.items() if v.startswith("ddp") and v not in (*LOW_PRECISION, PEER_VARIANT)}
    if "fastpar_fp32" in seconds:
        check(FP32_VS_BEST_TORCH, "fastpar_fp32", min(fp32_torch, key=fp32_torch.get), named=True)
    if "fastpar_bf16" in seconds and "ddp_fp16_hook" in seconds:
        check(BF16_VS_FP16_HOOK, "fastpar_bf16", "ddp_fp16_hook")
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
    fastpar_caps: dict[str, float],
    auto_notes: list[str],
) -> BenchReport:
    rows, footer, goals = [], [], []
    for model_name, seconds in results.items():
        floor, peer = seconds["no_comm"], seconds["ddp"]
        for variant, t in seconds.items():
            rows.append(dict(model=model_name, variant=variant, step_ms=t * 1e3, x_floor=t / floor, x_ddp=t / peer))
        footer += [f"beyond a bound: {flag}" for flag in floor_flags(model_name, seconds).values()]
        goals += step_goals(model_name, seconds)
    caps = ", ".join(f"{m} bucket_cap_mb={c:g}" for m, c in fastpar_caps.items())
    return BenchReport(
        benchmark="ddp",
        title=f"training step time, {world_size} ranks",
        columns=step_columns(17),
        rows=rows,
        header=step_header(ctx, world_size, settings.batch, ddp_fastpar_cap=caps),
        footer=footer + [f"auto: {note}" for note in auto_notes],
        goals=goals,
        notes=list(settings.skip_notes),
        summary={"step_ms": {m: {v: t * 1e3 for v, t in s.items()} for m, s in results.items()}},
        plot=PlotSpec("bar", "variant", "x_floor", series="model", ylabel="step time / no-communication step"),
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("ddp")
    group.add_argument("--models", default="mlp,blocks", help="comma-separated of mlp, blocks (default both)")
    group.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset (ddp always runs)")
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
