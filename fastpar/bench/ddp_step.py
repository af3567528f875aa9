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

Goals (issue 11): fastpar_fp32 <= 0.92x the best fp32 torch variant; fastpar_bf16 <= 0.85x ddp_fp16_hook;
fastpar_auto <= the best of fastpar_cap_1/4/25.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
from collections.abc import Callable

import torch
from torch import nn

from . import launch
from .harness import BenchUsageError, Plan, WrongResultError, count_mismatches
from .table import BenchReport, Column, PlotSpec

DESCRIPTION = "DDP step time: fastpar vs torch DDP variants vs a no-communication step"
USES = {"nproc"}
DEFAULTS = {"iters": 2, "warmup": 1, "rounds": 5}
MODELS = {"mlp": (1024, 16), "blocks": (256, 96)}  # name -> (width, depth)
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
GOAL_FP32_VS_BEST_TORCH = 0.92  # issue 11: fastpar fp32 <= 0.92x the best fp32 torch variant
GOAL_BF16_VS_FP16_HOOK = 0.85
AUTO_SETTLE_MAX_STEPS = 60
GOAL_VS_GLOO = 0.80  # issue 17: on the fastpar backend, fastpar fp32 <= 0.80x stock DDP on gloo


def build_model(name: str, seed: int = 0) -> nn.Module:
    width, depth = MODELS[name]
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers.append(nn.Linear(width, width))
        if name == "blocks":
            layers.append(nn.LayerNorm(width))
        layers.append(nn.GELU())
    return nn.Sequential(*layers)


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
    from ..ddp import DistributedDataParallel as FastparDDP

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

    from ..ddp.buckets import default_caps

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


def step_columns(variant_width: int) -> list[Column]:
    """The first columns of a training-step table (``ddp``, ``zero``)."""
    return [
        Column("model", "model", 7),
        Column("variant", "variant", variant_width),
        Column("step_ms", "step(ms)", 10, ".2f", "ms"),
        Column("x_floor", "x no_comm", 10, ".2f", "x"),
        Column("x_ddp", "x ddp", 8, ".2f", "x"),
    ]


def step_header(args: argparse.Namespace, world_size: int, **extra: str) -> dict[str, str]:
    """The header lines of a training-step benchmark, ``extra`` before the timing line."""
    return {
        "backend": args.backend,
        "world size": str(world_size),
        "threads per rank": str(args.threads),
        "batch": str(args.batch),
        **extra,
        "timing": f"median of {args.rounds} interleaved rounds x {args.iters} steps after {args.warmup} warm-up",
    }


def check_models_and_batch(args: argparse.Namespace, models) -> None:
    """``args.model_list`` from ``--models`` (names in ``models``); refuse unknown names and ``--batch`` < 1."""
    args.model_list = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(args.model_list) - set(models)) or (["(none)"] if not args.model_list else [])
    if unknown:
        raise BenchUsageError(f"unknown model(s) {unknown}; choose from {', '.join(models)}")
    if args.batch < 1:
        raise BenchUsageError(f"--batch must be at least 1, got {args.batch}")


def check_one_step(trainees: dict, batch: torch.Tensor, tolerance: Callable[[str], dict], model_name: str) -> None:
    """Every variant takes one step on the same batch on every rank; its parameters must then equal stock DDP's
    (``tolerance(variant)``: ``count_mismatches`` tolerances). Raises WrongResultError on every rank alike."""
    for trainee in trainees.values():
        trainee.step(batch)
    reference = trainees["ddp"].flat_params()
    wrong = {
        v: launch.agree_count(count_mismatches(t.flat_params(), reference, **tolerance(v)), batch.device)
        for v, t in trainees.items()
    }
    if any(wrong.values()):
        listing = ", ".join(f"{v}: {n} parameters differ" for v, n in wrong.items() if n)
        raise WrongResultError(f"{model_name}: after one step on the same batch, vs stock DDP: {listing}")


def _tolerance(variant: str, world_size: int) -> dict:
    if variant not in LOW_PRECISION and variant != "no_comm":
        if world_size > 2 and variant in FIXED_CAPS:  # another layout, another summation order
            return {"rtol": 1e-5, "atol": 1e-7}
        return {}
    return {"rtol": 1e-3, "atol": 1e-5 if variant == "no_comm" else 1e-4}


def _rank_main(rank: int, world_size: int, args: argparse.Namespace) -> BenchReport | None:
    device = launch.rank_device(args.backend)
    plan = Plan(args.warmup, args.rounds, args.iters)
    peer_group = launch.gloo_peer(args.backend)
    variants = [*args.variant_list, PEER_VARIANT] if peer_group is not None else args.variant_list
    results: dict[str, dict[str, float]] = {}
    args.fastpar_caps, args.auto_notes = {}, []
    for model_name in args.model_list:
        width = MODELS[model_name][0]
        args.fastpar_caps[model_name] = fastpar_cap_mb(build_model(model_name))
        trainees = {v: Trainee(v, model_name, device, args.lr, peer_group) for v in variants}
        check_batch = torch.randn(args.batch, width, generator=torch.Generator().manual_seed(1)).to(device)
        check_one_step(trainees, check_batch, lambda v: _tolerance(v, world_size), model_name)
        batch = torch.randn(args.batch, width, generator=torch.Generator().manual_seed(100 + rank)).to(device)
        for variant, trainee in trainees.items():
            if trainee.settle(batch):
                args.auto_notes.append(f"{model_name} {variant}: {_auto_note(trainee.model.comm_stats()['auto'])}")
        results[model_name] = launch.time_on_all_ranks(
            {v: (lambda t=t, x=batch: t.step(x)) for v, t in trainees.items()}, plan, device
        )
        del trainees
    return _report(args, world_size, results) if rank == 0 else None


def _auto_note(summary: dict) -> str:
    measured = summary.get("measured_step_ms", {})
    steps = ", ".join(f"{k} {v:.1f} ms" for k, v in measured.items())
    return f"chose {summary.get('chosen')}, kept {summary.get('kept')} ({summary.get('buckets')} buckets; {steps})"


def _goal_lines(model_name: str, seconds: dict[str, float]) -> tuple[list[str], dict[str, bool]]:
    """The issue-11 goals for one model: (footer lines, goal -> met)."""
    checks = []
    fp32_torch = {v: t for v, t in seconds.items() if v.startswith("ddp") and v not in (*LOW_PRECISION, PEER_VARIANT)}
    if "fastpar_fp32" in seconds:
        best = min(fp32_torch, key=fp32_torch.get)
        checks.append(
            ("fastpar_fp32", f"the best fp32 torch variant ({best})", fp32_torch[best], GOAL_FP32_VS_BEST_TORCH)
        )
    if "fastpar_bf16" in seconds and "ddp_fp16_hook" in seconds:
        checks.append(("fastpar_bf16", "ddp_fp16_hook", seconds["ddp_fp16_hook"], GOAL_BF16_VS_FP16_HOOK))
    if "fastpar_fp32" in seconds and PEER_VARIANT in seconds:
        checks.append(("fastpar_fp32", PEER_VARIANT, seconds[PEER_VARIANT], GOAL_VS_GLOO))
    fixed = {v: seconds[v] for v in FIXED_CAPS if v in seconds}
    if "fastpar_auto" in seconds and fixed:
        best = min(fixed, key=fixed.get)
        checks.append(("fastpar_auto", f"the best fixed cap ({best})", fixed[best], 1.0))
    lines, met = [], {}
    for ours, theirs, their_s, limit in checks:
        ratio = seconds[ours] / their_s
        met[f"{model_name}: {ours} / {theirs}"] = ratio <= limit
        verdict = "MET" if ratio <= limit else "NOT MET"
        lines.append(f"goal {model_name}: {ours} <= {limit:.2f}x {theirs}: {ratio:.2f}x -> {verdict}")
    return lines, met


def _report(args, world_size: int, results: dict[str, dict[str, float]]) -> BenchReport:
    rows, footer, goals = [], [], {}
    for model_name, seconds in results.items():
        floor, peer = seconds["no_comm"], seconds["ddp"]
        for variant, t in seconds.items():
            rows.append(dict(model=model_name, variant=variant, step_ms=t * 1e3, x_floor=t / floor, x_ddp=t / peer))
        lines, met = _goal_lines(model_name, seconds)
        footer += lines
        goals |= met
    caps = ", ".join(f"{m} bucket_cap_mb={c:g}" for m, c in args.fastpar_caps.items())
    return BenchReport(
        benchmark="ddp",
        title=f"training step time, {world_size} ranks",
        columns=step_columns(17),
        rows=rows,
        header=step_header(args, world_size, ddp_fastpar_cap=caps),
        footer=footer + [f"auto: {note}" for note in args.auto_notes],
        notes=list(args.skip_notes),
        summary={"step_ms": {m: {v: t * 1e3 for v, t in s.items()} for m, s in results.items()}, "goals_met": goals},
        plot=PlotSpec("bar", "variant", "x_floor", series="model", ylabel="step time / no-communication step"),
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("ddp")
    group.add_argument("--models", default="mlp,blocks", help="comma-separated of mlp, blocks (default both)")
    group.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset (ddp always runs)")
    group.add_argument("--batch", type=int, default=64, help="rows per step per rank (default 64)")
    group.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (default 0.01)")


def run(args: argparse.Namespace) -> BenchReport | None:
    check_models_and_batch(args, MODELS)
    wanted = {v.strip() for v in args.variants.split(",") if v.strip()} | {"no_comm", "ddp"}
    if wanted - set(VARIANTS):
        raise BenchUsageError(f"unknown variant(s) {sorted(wanted - set(VARIANTS))}; choose from {', '.join(VARIANTS)}")
    possible, args.skip_notes = available_variants()
    args.variant_list = [v for v in possible if v in wanted]
    return launch.run_distributed(_rank_main, args)
