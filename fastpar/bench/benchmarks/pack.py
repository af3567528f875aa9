"""``fastpar bench pack``: bandwidth of ``fastpar.ops.pack/unpack`` against memcpy and torch's peers.

For each shape (``count x numel`` tensors) every implementation moves the same elements in one run,
interleaved in rounds:

  pack    memcpy (floor: one ``copy_`` of one flat tensor of the same elements and dtypes),
          fastpar.pack, torch.cat(out=), torch._utils._flatten_dense_tensors, torch._foreach_copy_,
          a Python loop of copy_
  unpack  memcpy (the reverse copy), fastpar.unpack, torch._foreach_copy_, a Python loop of copy_

On a GPU (``--device cuda``, the default when one is visible) every CUDA kernel tier that can run there gets its
own rows next to the live ``fastpar.pack``: ``fastpar.pack[compiled]`` (the nvcc build) and ``fastpar.pack[cupy]``
(the same kernels compiled by NVRTC, launched through CuPy). Bandwidth counts bytes read + bytes written, so casts
(``--out-dtype``) compare fairly with memcpy. memcpy is the bound: a fastpar row above 100% of it cannot be a real
measurement, so it is flagged and the goal is IMPOSSIBLE, never MET.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

import torch

from ... import ops
from ...ops import loader
from ...ops.loader import ext_status
from ..context import BenchContext
from ..goals import AT_LEAST, Goal, above_bound
from ..harness import (
    FLOAT_DTYPES,
    BenchUsageError,
    WrongResultError,
    bandwidth_gbs,
    dtype_name,
    interleaved_rounds,
    median,
    parse_dtype,
)
from ..table import BenchReport, Column, PlotSpec

DESCRIPTION = "fastpar.ops.pack/unpack bandwidth vs memcpy, torch.cat, _flatten_dense_tensors, copy_ loops"
USES = {"dtype"}
DEFAULTS = {"iters": 3, "warmup": 2, "rounds": 5}
DTYPE_CHOICES = FLOAT_DTYPES  # what fastpar.ops packs (any pair of them with --out-dtype)
PEERS = {"pack": "torch.cat", "unpack": "_foreach_copy_"}  # torch's fastest equivalent of each direction
DEFAULT_SHAPES = "32x1M,384x16K,4000x1K"
WORST_OF_MEMCPY = Goal("fastpar pack/unpack at the worst shape", "of memcpy", 0.85, AT_LEAST, unit="%")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20}


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"32x1M,4000x1K"`` -> ``[(32, 1048576), (4000, 1024)]`` (count x elements per tensor)."""
    shapes = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)([KkMm]?)\s*", part)
        if not match or int(match.group(1)) < 1 or int(match.group(2)) < 1:
            raise BenchUsageError(f"cannot read shape {part!r}: write COUNTxNUMEL such as 384x16K")
        shapes.append((int(match.group(1)), int(match.group(2)) * _UNITS[match.group(3).upper()]))
    return shapes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("pack")
    group.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"COUNTxNUMEL list (default {DEFAULT_SHAPES})")
    group.add_argument("--out-dtype", help="dtype of the flat buffer (default: --dtype); a cast when different")
    group.add_argument(
        "--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: the GPU when one is visible, else CPU"
    )


def shape_name(count: int, numel: int) -> str:
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if numel % size == 0:
            return f"{count}x{numel // size}{unit}"
    return f"{count}x{numel}"


def kernel_tiers(device: torch.device) -> tuple[dict[str, object], list[str]]:
    """On a GPU, every CUDA kernel tier that runs there by name (``compiled``, ``cupy``), and why any other is
    absent; nothing on CPU (one tier there: the live ``fastpar.pack``)."""
    tiers, notes = {}, []
    if device.type != "cuda":
        return tiers, notes
    module = loader.extension()
    if module is not None and module.has_cuda():
        tiers["compiled"] = module
    else:
        notes.append("fastpar._C has no CUDA kernels here (not built with nvcc)")
    try:
        from ...ops.cupy_tier import load

        tier = load()
        tier.prepare(device)  # compile (or load from the disk cache) before timing
        tiers["cupy"] = tier
    except Exception as exc:  # missing CuPy/NVRTC/headers or a compile error: report, keep benchmarking
        notes.append(f"CuPy tier unavailable: {exc}")
    return tiers, notes


def pack_variants(
    tensors: list[torch.Tensor], out: torch.Tensor, tiers: dict[str, object] | None = None
) -> tuple[dict[str, Callable], dict[str, Callable]]:
    """The pack and unpack implementations for one shape, as zero-argument calls; ``tiers`` adds a
    ``fastpar.pack[name]``/``fastpar.unpack[name]`` pair per kernel tier (see :func:`kernel_tiers`)."""
    flatten = torch._utils._flatten_dense_tensors
    numel = sum(t.numel() for t in tensors)
    flat_in = torch.randn(numel).to(tensors[0].dtype).to(out.device)  # memcpy's source: same elements, one tensor
    out_views = list(out.split([t.numel() for t in tensors]))
    flat_tensors = [t.view(-1) for t in tensors]
    same_dtype = out.dtype == tensors[0].dtype
    pack = {
        "memcpy": lambda: out.copy_(flat_in),
        "fastpar.pack": lambda: ops.pack(tensors, out),
        "torch.cat": lambda: torch.cat(flat_tensors, out=out),
        "_flatten_dense": (lambda: flatten(tensors)) if same_dtype else (lambda: flatten(tensors).to(out.dtype)),
        "_foreach_copy_": lambda: torch._foreach_copy_(out_views, flat_tensors),
        "loop copy_": lambda: [o.copy_(t) for o, t in zip(out_views, flat_tensors, strict=True)],
    }
    unpack = {
        "memcpy": lambda: flat_in.copy_(out),
        "fastpar.unpack": lambda: ops.unpack(out, tensors),
        "_foreach_copy_": lambda: torch._foreach_copy_(flat_tensors, out_views),
        "loop copy_": lambda: [t.copy_(o) for o, t in zip(out_views, flat_tensors, strict=True)],
    }
    for name, tier in (tiers or {}).items():
        pack[f"fastpar.pack[{name}]"] = lambda tier=tier: tier.pack(tensors, out, 1.0)
        unpack[f"fastpar.unpack[{name}]"] = lambda tier=tier: tier.unpack(out, tensors, 1.0, False)
    return pack, unpack


def _check(tensors: list[torch.Tensor], out: torch.Tensor, shape: str, tiers: dict[str, object]) -> list[str]:
    """fastpar.pack (and each tier's) must equal torch.cat; fastpar.unpack must restore every tensor (cast back)."""
    problems = []
    for name, impl in {"": ops, **{f"[{k}]": v for k, v in tiers.items()}}.items():
        out.fill_(float("nan"))
        impl.pack(tensors, out, 1.0)
        reference = torch.cat([t.view(-1) for t in tensors]).to(out.dtype)
        if not torch.equal(out, reference):
            wrong = int((out != reference).sum())
            problems.append(f"{shape}: fastpar.pack{name} differs from torch.cat in {wrong} elements")
        targets = [torch.full_like(t, float("nan")) for t in tensors]
        impl.unpack(out, targets, 1.0, False)
        bad = sum(
            int((t != o.to(t.dtype)).sum())
            for t, o in zip(targets, out.split([t.numel() for t in tensors]), strict=True)
        )
        if bad:
            problems.append(f"{shape}: fastpar.unpack{name} wrote {bad} wrong elements")
    return problems


def run(ctx: BenchContext) -> BenchReport:
    flags = ctx.flags
    in_dtype = parse_dtype(ctx.dtype, DTYPE_CHOICES, user="pack")
    out_dtype = parse_dtype(flags.out_dtype, DTYPE_CHOICES, user="pack --out-dtype") if flags.out_dtype else in_dtype
    shapes = parse_shapes(flags.shapes)
    plan = ctx.plan
    device = _device(flags.device)
    tiers, notes = kernel_tiers(device)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(ctx.threads)
    try:
        measured, problems = [], []
        for count, numel in shapes:
            generator = torch.Generator().manual_seed(count * 7919 + numel)
            tensors = [torch.randn(numel, generator=generator).to(in_dtype).to(device) for _ in range(count)]
            out = torch.empty(count * numel, dtype=out_dtype, device=device)
            problems += _check(tensors, out, shape_name(count, numel), tiers)
            if problems:
                continue  # keep checking the other shapes, time nothing
            pack, unpack = pack_variants(tensors, out, tiers)
            both = {("pack", k): v for k, v in pack.items()} | {("unpack", k): v for k, v in unpack.items()}
            times = interleaved_rounds(both, plan, device)
            measured.append(((count, numel), {key: median(ts) for key, ts in times.items()}))
            del tensors, out, pack, unpack, both
    finally:
        torch.set_num_threads(previous_threads)
    if problems:
        raise WrongResultError("; ".join(problems))
    return _report(ctx, in_dtype, out_dtype, measured, device, notes)


def _device(choice: str) -> torch.device:
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise BenchUsageError("--device cuda, but no CUDA device is visible; use --device cpu")
    return torch.device("cuda", torch.cuda.current_device()) if choice == "cuda" else torch.device("cpu")


def _report(ctx: BenchContext, in_dtype, out_dtype, measured, device, notes) -> BenchReport:
    elem_bytes = torch.empty((), dtype=in_dtype).element_size() + torch.empty((), dtype=out_dtype).element_size()
    rows, shares, speedups, tier_shares = [], {}, {}, {}
    for (count, numel), seconds in measured:
        shape = shape_name(count, numel)
        moved = count * numel * elem_bytes
        for (direction, impl), t in seconds.items():
            floor = seconds[(direction, "memcpy")]
            rows.append(
                dict(
                    shape=shape,
                    op=direction,
                    impl=impl,
                    time_us=t * 1e6,
                    gbs=bandwidth_gbs(moved, t),
                    of_memcpy=floor / t,
                    bytes=moved,
                )
            )
        for direction, impl in (("pack", "fastpar.pack"), ("unpack", "fastpar.unpack")):
            key, ours = f"{direction} {shape}", seconds[(direction, impl)]
            shares[key] = seconds[(direction, "memcpy")] / ours
            speedups[key] = seconds[(direction, PEERS[direction])] / ours
        for (direction, impl), t in seconds.items():
            if impl.endswith("]"):  # a kernel tier's own rows, e.g. fastpar.pack[cupy]
                tier_shares[f"{impl.removeprefix('fastpar.')} {shape}"] = seconds[(direction, "memcpy")] / t
    worst = min(shares.values())
    status = ext_status()
    footer = [
        f"fastpar {key}: {share:.1%} of memcpy, {speedups[key]:.2f}x the speed of {PEERS[key.split()[0]]}"
        for key, share in shares.items()
    ]
    footer += [f"tier {key}: {share:.1%} of memcpy" for key, share in tier_shares.items()] + notes
    beyond = [above_bound(f"fastpar {key}", share, 1.0, "memcpy") for key, share in {**shares, **tier_shares}.items()]
    beyond = [flag for flag in beyond if flag]
    footer += [f"beyond a bound: {flag}" for flag in beyond]
    worst_key = min(shares, key=shares.get)
    goal = WORST_OF_MEMCPY.check(worst, detail=worst_key, flag="; ".join(beyond) or None)
    return BenchReport(
        benchmark="pack",
        title="bucket pack/unpack bandwidth (read + write bytes)",
        columns=[
            Column("shape", "shape", 11),
            Column("op", "op", 7),
            Column("impl", "impl", 24),
            Column("time_us", "time(us)", 11, ".1f", "us"),
            Column("gbs", "GB/s", 8, ".2f", "GB/s"),
            Column("of_memcpy", "of_memcpy", 10, ".1%"),
        ],
        rows=rows,
        header={
            "ext backend": f"{status['backend']} ({status['reason']})",
            "device": str(device),
            "dtype": f"{dtype_name(in_dtype)} -> {dtype_name(out_dtype)}",
            "threads": str(ctx.threads),
            "timing": f"median of {ctx.rounds} interleaved rounds x {ctx.iters} iters after {ctx.warmup} warm-up",
        },
        footer=footer,
        goals=[goal],
        summary={
            "of_memcpy": shares,
            "speedup_vs_peer": speedups,
            "peers": PEERS,
            "worst_of_memcpy": worst,
            "ext_backend": status["backend"],
            "tier_of_memcpy": tier_shares,
        },
        plot=PlotSpec("bar", "impl", "of_memcpy", series="shape", ylabel="bandwidth as a share of memcpy"),
    )
