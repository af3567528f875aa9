"""The shared benchmark vocabulary: sizes, dtypes, timing, medians of interleaved rounds, checks.

Timing model (every benchmark): a variant runs ``warmup`` untimed calls, then ``rounds`` rounds of
``iters`` back-to-back calls each; one round's number is its mean time per call and the reported
time is the median over rounds. Variants are interleaved round by round, so a slow drift of the
machine (other jobs, thermal) hits every variant alike instead of whichever ran last.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ..user_errors import UserError


class BenchUsageError(UserError, ValueError):
    """Bad flags or an impossible configuration: the CLI prints it and exits with status 2."""


class WrongResultError(RuntimeError):
    """A benchmark computed a wrong result: the CLI prints what was wrong and exits with status 1,
    without printing any speed (a fast wrong answer is not a result)."""


_SUFFIXES = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}

# Every name ``--dtype`` accepts. Each benchmark narrows it: the collectives take all of them (the
# check values are small integers, exact in each), fusion and pack only the float types fastpar buckets
# hold, ddp and data run in float32 only.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float64": torch.float64,
    "double": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
}
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def parse_bytes(text: str) -> int:
    """``"64"``, ``"8K"``, ``"1M"``, ``"2G"`` (binary units, like nccl-tests) -> bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMGkmg]?)[Bb]?\s*", str(text))
    if not match:
        raise BenchUsageError(
            f"cannot read size {text!r}: use a number of bytes with an optional K/M/G suffix, e.g. 8K"
        )
    return int(match.group(1)) * _SUFFIXES[match.group(2).upper()]


def format_bytes(nbytes: int) -> str:
    """Bytes in the shortest exact K/M/G form (``8388608`` -> ``8M``)."""
    for suffix in ("G", "M", "K"):
        unit = _SUFFIXES[suffix]
        if nbytes >= unit and nbytes % unit == 0:
            return f"{nbytes // unit}{suffix}"
    return str(nbytes)


def size_sweep(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """Sizes from ``min_bytes`` up to ``max_bytes`` multiplying by ``factor`` (nccl-tests ``-b -e -f``)."""
    if min_bytes <= 0:
        raise BenchUsageError(f"minimum size (-b) must be positive, got {min_bytes}")
    if max_bytes < min_bytes:
        raise BenchUsageError(
            f"sizes out of order: -b {format_bytes(min_bytes)} is larger than -e {format_bytes(max_bytes)}; "
            "give the smaller size to -b"
        )
    if factor < 2 and min_bytes != max_bytes:
        raise BenchUsageError(f"the size factor (-f) must be at least 2, got {factor}")
    sizes = [min_bytes]
    while sizes[-1] * factor <= max_bytes and min_bytes != max_bytes:
        sizes.append(sizes[-1] * factor)
    return sizes


def parse_dtype(name: str, allowed: tuple[torch.dtype, ...] | None = None, user: str = "this benchmark") -> torch.dtype:
    """A dtype name from :data:`DTYPES` -> ``torch.dtype``; with ``allowed``, also refuse the others."""
    try:
        dtype = DTYPES[name.lower()]
    except KeyError:
        raise BenchUsageError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}") from None
    if allowed is not None and dtype not in allowed:
        names = ", ".join(dtype_name(d) for d in allowed)
        raise BenchUsageError(f"{user} supports --dtype {names}; got {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so wall-clock time covers it (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_per_call(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    """Mean seconds per call of ``calls`` back-to-back calls of ``fn``."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / calls


@dataclass
class Plan:
    """How much of each variant to run: warm-up calls, rounds, calls per round."""

    warmup: int
    rounds: int
    iters: int

    def __post_init__(self) -> None:
        if self.warmup < 0 or self.rounds < 1 or self.iters < 1:
            raise BenchUsageError(
                f"need -w >= 0, --rounds >= 1 and -n >= 1; got -w {self.warmup}, --rounds {self.rounds}, -n {self.iters}"
            )


def interleaved_rounds(
    variants: Mapping[str, Callable[[], object]],
    plan: Plan,
    device: torch.device,
    *,
    iters: Mapping[str, int] | None = None,
    warmups: Mapping[str, int] | None = None,
    before_round: Callable[[], object] | None = None,
) -> dict[str, list[float]]:
    """Seconds per call of every variant in every round: ``{name: [round0, round1, ...]}``.

    ``iters`` and ``warmups`` override the calls per round and warm-up calls for slow variants; ``before_round`` runs before each
    variant's timed block (e.g. a barrier so all ranks start together)."""
    iters, warmups = dict(iters or {}), dict(warmups or {})
    for name, fn in variants.items():
        for _ in range(warmups.get(name, plan.warmup)):
            fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(plan.rounds):
        for name, fn in variants.items():
            if before_round is not None:
                before_round()
            times[name].append(time_per_call(fn, iters.get(name, plan.iters), device))
    return times


def median(values: list[float]) -> float:
    return statistics.median(values)


def count_mismatches(actual: torch.Tensor, expected: torch.Tensor, *, atol: float = 0.0, rtol: float = 0.0) -> int:
    """Number of elements of ``actual`` that differ from ``expected`` (exactly, or beyond the tolerance)."""
    if actual.shape != expected.shape:
        return max(actual.numel(), expected.numel())
    if atol == 0.0 and rtol == 0.0:
        return int((actual != expected).sum().item())
    a, e = actual.double(), expected.double()
    return int((~torch.isclose(a, e, rtol=rtol, atol=atol)).sum().item())


def memcpy_seconds(nbytes: int, device: torch.device, plan: Plan) -> float:
    """Median seconds of one large ``copy_`` of ``nbytes`` on ``device``: the machine's floor for moving bytes."""
    numel = max(1, nbytes // 4)
    src = torch.ones(numel, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    times = interleaved_rounds({"memcpy": lambda: dst.copy_(src)}, plan, device)
    return median(times["memcpy"])


def bandwidth_gbs(nbytes: float, seconds: float) -> float:
    """Bytes per second in GB/s (10^9, as nccl-tests prints)."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")
