"""What the training-step benchmarks (``fastpar bench ddp``, ``fastpar bench zero``) share: the models, the
one-step correctness check against stock DDP, the first columns and header lines of their tables, and the
floor check (no variant can be faster than the same step without communication).

Models: ``mlp`` = 16 x (Linear(1024, 1024) + GELU); ``blocks`` = 96 x (Linear(256, 256) + LayerNorm(256) +
GELU); ``tiny`` = 4 x (Linear(64, 64) + GELU), for smoke tests. Same weights on every rank (seed 0).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from .. import launch
from ..context import BenchContext
from ..goals import beyond_floor
from ..harness import BenchUsageError, WrongResultError, count_mismatches
from ..table import Column

MODELS = {"mlp": (1024, 16), "blocks": (256, 96), "tiny": (64, 4)}  # name -> (width, depth)
FLOOR = "no_comm"  # the variant without communication: no variant's step can be faster


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


def parse_models(text: str, models: Iterable[str], batch: int) -> list[str]:
    """The model names of ``--models`` (from ``models``); refuses unknown names and ``--batch`` < 1."""
    chosen = [m.strip() for m in text.split(",") if m.strip()]
    unknown = sorted(set(chosen) - set(models)) or (["(none)"] if not chosen else [])
    if unknown:
        raise BenchUsageError(f"unknown model(s) {unknown}; choose from {', '.join(models)}")
    if batch < 1:
        raise BenchUsageError(f"--batch must be at least 1, got {batch}")
    return chosen


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


def step_columns(variant_width: int) -> list[Column]:
    """The first columns of a training-step table."""
    return [
        Column("model", "model", 7),
        Column("variant", "variant", variant_width),
        Column("step_ms", "step(ms)", 10, ".2f", "ms"),
        Column("x_floor", "x no_comm", 10, ".2f", "x"),
        Column("x_ddp", "x ddp", 8, ".2f", "x"),
    ]


def step_header(ctx: BenchContext, world_size: int, batch: int, **extra: str) -> dict[str, str]:
    """The header lines of a training-step benchmark, ``extra`` before the timing line."""
    return {
        "backend": ctx.backend,
        "world size": str(world_size),
        "threads per rank": str(ctx.threads),
        "batch": str(batch),
        **extra,
        "timing": f"median of {ctx.rounds} interleaved rounds x {ctx.iters} steps after {ctx.warmup} warm-up",
    }


def floor_flags(model_name: str, seconds: Mapping[str, float]) -> dict[str, str]:
    """variant -> why its time cannot be right, for each variant faster than the step without communication."""
    floor = seconds[FLOOR]
    flags = {v: beyond_floor(f"{model_name} {v}", t, floor, FLOOR) for v, t in seconds.items() if v != FLOOR}
    return {v: flag for v, flag in flags.items() if flag}


def pair_flag(flags: Mapping[str, str], *variants: str) -> str | None:
    """The flags of the variants a goal compares (a ratio with an impossible time on either side is no result)."""
    return "; ".join(flags[v] for v in variants if v in flags) or None
