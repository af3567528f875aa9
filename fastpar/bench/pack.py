"""``fastpar bench pack``: bandwidth of ``fastpar.ops.pack/unpack`` against memcpy and torch's peers.

For each shape (``count x numel`` tensors) every implementation moves the same elements in one run,
interleaved in rounds:

  pack    memcpy (floor: one ``copy_`` of one flat tensor of the same elements and dtypes),
          fastpar.pack, torch.cat(out=), torch._utils._flatten_dense_tensors, torch._foreach_copy_,
          a Python loop of copy_
  unpack  memcpy (the reverse copy), fastpar.unpack, torch._foreach_copy_, a Python loop of copy_

Bandwidth counts bytes read + bytes written, so casts (``--out-dtype``) compare fairly with memcpy.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

import torch

from .. import ops
from .._ext import ext_status
from .harness import (
    FLOAT_DTYPES,
    BenchUsageError,
    Plan,
    WrongResultError,
    bandwidth_gbs,
    dtype_name,
    interleaved_rounds,
    median,
    parse_dtype,
)
from .table import BenchReport, Column, PlotSpec, goal_line

DESCRIPTION = "fastpar.ops.pack/unpack bandwidth vs memcpy, torch.cat, _flatten_dense_tensors, copy_ loops"
USES = {"dtype"}
DEFAULTS = {"iters": 3, "warmup": 2, "rounds": 5}
DTYPE_CHOICES = FLOAT_DTYPES  # what fastpar.ops packs (any pair of them with --out-dtype)
PEERS = {"pack": "torch.cat", "unpack": "_foreach_copy_"}  # torch's fastest equivalent of each direction
DEFAULT_SHAPES = "32x1M,384x16K,4000x1K"
GOAL = 0.85  # issue 2: at least 85% of memcpy at every shape
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


def shape_name(count: int, numel: int) -> str:
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if numel % size == 0:
            return f"{count}x{numel // size}{unit}"
    return f"{count}x{numel}"


def pack_variants(tensors: list[torch.Tensor], out: torch.Tensor) -> tuple[dict[str, Callable], dict[str, Callable]]:
    """The pack and unpack implementations for one shape, as zero-argument calls."""
    flatten = torch._utils._flatten_dense_tensors
    numel = sum(t.numel() for t in tensors)
    flat_in = torch.randn(numel).to(tensors[0].dtype)  # memcpy's source: same elements, one tensor
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
    return pack, unpack


def _check(tensors: list[torch.Tensor], out: torch.Tensor, shape: str) -> list[str]:
    """fastpar.pack must equal torch.cat; fastpar.unpack must restore every tensor (cast back)."""
    problems = []
    ops.pack(tensors, out)
    reference = torch.cat([t.view(-1) for t in tensors]).to(out.dtype)
    if not torch.equal(out, reference):
        problems.append(f"{shape}: fastpar.pack differs from torch.cat in {int((out != reference).sum())} elements")
    targets = [torch.full_like(t, float("nan")) for t in tensors]
    ops.unpack(out, targets)
    bad = sum(
        int((t != o.to(t.dtype)).sum()) for t, o in zip(targets, out.split([t.numel() for t in tensors]), strict=True)
    )
    if bad:
        problems.append(f"{shape}: fastpar.unpack wrote {bad} wrong elements")
    return problems


def run(args: argparse.Namespace) -> BenchReport:
    in_dtype = parse_dtype(args.dtype, DTYPE_CHOICES, user="pack")
    out_dtype = parse_dtype(args.out_dtype, DTYPE_CHOICES, user="pack --out-dtype") if args.out_dtype else in_dtype
    shapes = parse_shapes(args.shapes)
    plan = Plan(args.warmup, args.rounds, args.iters)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        measured, problems = [], []
        for count, numel in shapes:
            generator = torch.Generator().manual_seed(count * 7919 + numel)
            tensors = [torch.randn(numel, generator=generator).to(in_dtype) for _ in range(count)]
            out = torch.empty(count * numel, dtype=out_dtype)
            problems += _check(tensors, out, shape_name(count, numel))
            if problems:
                continue  # keep checking the other shapes, time nothing
            pack, unpack = pack_variants(tensors, out)
            both = {("pack", k): v for k, v in pack.items()} | {("unpack", k): v for k, v in unpack.items()}
            times = interleaved_rounds(both, plan, torch.device("cpu"))
            measured.append(((count, numel), {key: median(ts) for key, ts in times.items()}))
            del tensors, out, pack, unpack, both
    finally:
        torch.set_num_threads(previous_threads)
    if problems:
        raise WrongResultError("; ".join(problems))
    return _report(args, in_dtype, out_dtype, measured)


def _report(args, in_dtype, out_dtype, measured) -> BenchReport:
    elem_bytes = torch.empty((), dtype=in_dtype).element_size() + torch.empty((), dtype=out_dtype).element_size()
    rows, shares, speedups = [], {}, {}
    for (count, numel), seconds in measured:
        shape = shape_name(count, numel)
        moved = count * numel * elem_bytes
        for (direction, impl), t in seconds.items():
            floor = seconds[(direction, "memcpy")]
            rows.append(
                dict(shape=shape, op=direction, impl=impl, time_us=t * 1e6, gbs=bandwidth_gbs(moved, t),
                     of_memcpy=floor / t, bytes=moved)
            )  # fmt: skip
        for direction, impl in (("pack", "fastpar.pack"), ("unpack", "fastpar.unpack")):
            key, ours = f"{direction} {shape}", seconds[(direction, impl)]
            shares[key] = seconds[(direction, "memcpy")] / ours
            speedups[key] = seconds[(direction, PEERS[direction])] / ours
    worst = min(shares.values())
    status = ext_status()
    footer = [
        f"fastpar {key}: {share:.0%} of memcpy, {speedups[key]:.2f}x the speed of {PEERS[key.split()[0]]}"
        for key, share in shares.items()
    ]
    footer.append(goal_line(f">= {GOAL:.0%} of memcpy at every shape", f"worst {worst:.0%}", worst >= GOAL))
    return BenchReport(
        benchmark="pack",
        title="bucket pack/unpack bandwidth (read + write bytes)",
        columns=[
            Column("shape", "shape", 11),
            Column("op", "op", 7),
            Column("impl", "impl", 15),
            Column("time_us", "time(us)", 11, ".1f", "us"),
            Column("gbs", "GB/s", 8, ".2f", "GB/s"),
            Column("of_memcpy", "of_memcpy", 10, ".1%"),
        ],
        rows=rows,
        header={
            "ext backend": f"{status['backend']} ({status['reason']})",
            "dtype": f"{dtype_name(in_dtype)} -> {dtype_name(out_dtype)}",
            "threads": str(args.threads),
            "timing": f"median of {args.rounds} interleaved rounds x {args.iters} iters after {args.warmup} warm-up",
        },
        footer=footer,
        summary={
            "of_memcpy": shares,
            "speedup_vs_peer": speedups,
            "peers": PEERS,
            "worst_of_memcpy": worst,
            "goal": GOAL,
            "goal_met": worst >= GOAL,
            "ext_backend": status["backend"],
        },  # fmt: skip
        plot=PlotSpec("bar", "impl", "of_memcpy", series="shape", ylabel="bandwidth as a share of memcpy"),
    )
