"""``fastpar bench fusion``: all-reduce of many small tensors, against one tensor of the same bytes.

Paths (all in place, SUM, on the same tensors' shapes):
  one_by_one        one blocking ``dist.all_reduce`` per tensor
  async_one_wait    every tensor launched with ``async_op=True``, then all waited at the end
  torch_coalesced   ``torch.distributed.all_reduce_coalesced`` (deprecated in torch, still present)
  fastpar_bucketed  ``fastpar.ddp.CoalescedAllReduce`` (buckets planned once, as DDP's): pack into flat
                    buckets, reduce, unpack -- pipelined: bucket k+1 packs while k reduces, k unpacks
                    as soon as it is back; on the fastpar backend one list all-reduce per bucket that
                    stages and sums every tensor where it lies (nothing packed)
  fastpar_call      ``fastpar.ddp.all_reduce_coalesced``: the same path as one call, planning included
  fastpar_views     the tensors are views into flat buckets (as fastpar DDP keeps gradients):
                    one all-reduce per bucket, nothing packed
  single            one all-reduce of one tensor of the same total bytes: the floor

``share_of_single`` = single's time / the path's time (1.0 = as fast as one big tensor); the goal of the
bucketed path is flagged (IMPOSSIBLE, never MET) when it is faster than its floor.
The first two paths issue thousands of collectives and are slow: they run ``--slow-iters`` calls per
round (default 1) and their correctness run doubles as their warm-up.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from .. import launch
from ..context import BenchContext
from ..goals import AT_LEAST, Goal, beyond_floor
from ..harness import (
    BenchUsageError,
    WrongResultError,
    bandwidth_gbs,
    count_mismatches,
    dtype_name,
    format_bytes,
    parse_dtype,
    synchronize,
)
from ..table import BenchReport, Column, PlotSpec

DESCRIPTION = "all-reduce of many small tensors: one by one, async, coalesced, fastpar buckets vs one tensor"
USES = {"nproc", "dtype"}
DEFAULTS = {"iters": 5, "warmup": 1, "rounds": 3}
VARIANTS = (
    "one_by_one",
    "async_one_wait",
    "torch_coalesced",
    "fastpar_bucketed",
    "fastpar_call",
    "fastpar_views",
    "single",
)
SLOW_VARIANTS = ("one_by_one", "async_one_wait")
BUCKETED_VS_SINGLE = Goal("fastpar_bucketed", "of single", 0.90, AT_LEAST, unit="%")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("fusion")
    group.add_argument("--count", type=int, default=4000, help="number of tensors (default 4000)")
    group.add_argument("--numel", type=int, default=1024, help="elements per tensor (default 1024)")
    group.add_argument(
        "--bucket-cap-mb", type=float, default=None, help="fastpar bucket size cap (default: fastpar's choice)"
    )
    group.add_argument("--slow-iters", type=int, default=1, help="calls per round of one_by_one/async (default 1)")
    group.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated subset of {','.join(VARIANTS)} (single always runs)",
    )


def _selected(flags: argparse.Namespace) -> list[str]:
    chosen = [v.strip() for v in flags.variants.split(",") if v.strip()]
    unknown = sorted(set(chosen) - set(VARIANTS))
    if unknown:
        raise BenchUsageError(f"unknown fusion variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    return [v for v in VARIANTS if v in chosen or v == "single"]


def _fill(tensors: list[torch.Tensor], rank: int) -> None:
    """Tensor j, element i: (rank % 4) + (i + j) % 4 -- small integers, exact in every dtype."""
    for j, t in enumerate(tensors):
        flat = t.view(-1)
        flat.copy_((rank % 4) + (torch.arange(flat.numel(), device=flat.device) + j) % 4)


def _expected(tensor: torch.Tensor, j: int, n: int) -> torch.Tensor:
    idx = torch.arange(tensor.numel(), device=tensor.device)
    return (sum(k % 4 for k in range(n)) + n * ((idx + j) % 4)).to(tensor.dtype).view(tensor.shape)


def build_path(
    name: str, count: int, numel: int, dtype, device, cap_mb: float | None
) -> tuple[list[torch.Tensor], Callable]:
    """The tensors a path reduces (as the check sees them) and one call of the path."""
    from ...ddp import CoalescedAllReduce, all_reduce_coalesced
    from ...ddp.coalesced import plan_coalesced_buckets

    if name == "single":
        flat = torch.zeros(count * numel, dtype=dtype, device=device)
        return [flat], lambda: dist.all_reduce(flat)
    tensors = [torch.zeros(numel, dtype=dtype, device=device) for _ in range(count)]
    if name == "one_by_one":
        return tensors, lambda: [dist.all_reduce(t) for t in tensors]
    if name == "async_one_wait":

        def launch_all_then_wait() -> None:
            works = [dist.all_reduce(t, async_op=True) for t in tensors]
            for work in works:
                work.wait()

        return tensors, launch_all_then_wait
    if name == "torch_coalesced":

        def torch_coalesced() -> None:
            with warnings.catch_warnings():  # only its deprecation notice, once per call
                warnings.filterwarnings("ignore", message=".*all_reduce_coalesced.*", category=FutureWarning)
                dist.all_reduce_coalesced(tensors)

        return tensors, torch_coalesced
    if name == "fastpar_bucketed":
        return tensors, CoalescedAllReduce(tensors, None, bucket_cap_mb=cap_mb)
    if name == "fastpar_call":
        return tensors, lambda: all_reduce_coalesced(tensors, None, bucket_cap_mb=cap_mb, scale=1.0)
    if name == "fastpar_views":
        buckets = plan_coalesced_buckets(tensors, cap_mb, dist.get_world_size())
        flats = [torch.zeros(len(b) * numel, dtype=dtype, device=device) for b in buckets]
        views = [view for flat in flats for view in flat.split(numel)]

        def reduce_buckets() -> None:
            works = [dist.all_reduce(flat, async_op=True) for flat in flats]
            for work in works:
                work.wait()

        return views, reduce_buckets
    raise ValueError(name)


def path_call(
    rank: int, world_size: int, name: str, count: int = 4000, numel: int = 1024, cap_mb: float | None = None
) -> Callable[[], object]:
    """One rank's call of path ``name`` on zeroed float32 CPU tensors (for ``fastpar.bench.peers``)."""
    return build_path(name, count, numel, torch.float32, torch.device("cpu"), cap_mb)[1]


def _rank_main(rank: int, world_size: int, ctx: BenchContext) -> BenchReport | None:
    flags = ctx.flags
    device = launch.rank_device(ctx.backend)
    dtype = parse_dtype(ctx.dtype)
    names = _selected(flags)
    from ...ddp.buckets import default_caps

    cap_note = f"{flags.bucket_cap_mb} MB"
    if flags.bucket_cap_mb is None:
        probe = [torch.empty(flags.numel, dtype=dtype, device=device)] * flags.count
        caps_mb = [c / 2**20 for c in default_caps(probe, world_size)]
        cap_note = f"{caps_mb[0]:g} MB first, then {caps_mb[-1]:g} MB (fastpar's default on {device.type})"
    paths = {name: build_path(name, flags.count, flags.numel, dtype, device, flags.bucket_cap_mb) for name in names}
    wrong: dict[str, int] = {}
    for name, (tensors, call) in paths.items():  # check every path once before timing anything
        _fill(tensors, rank)
        call()
        synchronize(device)
        if name == "single":
            bad = count_mismatches(tensors[0], _expected(tensors[0], 0, world_size))
        else:
            bad = sum(count_mismatches(t, _expected(t, j, world_size)) for j, t in enumerate(tensors))
        wrong[name] = launch.agree_count(bad, device)
        for t in tensors:
            t.zero_()  # timed on zeros: repeated sums never overflow
    if any(wrong.values()):
        listing = ", ".join(f"{k}: {v} wrong elements" for k, v in wrong.items() if v)
        raise WrongResultError(f"fusion on {world_size} ranks gave wrong results ({listing})")
    slow = {name: flags.slow_iters for name in SLOW_VARIANTS}
    seconds = launch.time_on_all_ranks(
        {name: call for name, (_, call) in paths.items()},
        ctx.plan,
        device,
        iters=slow,
        warmups={name: 0 for name in SLOW_VARIANTS},
    )
    return _report(ctx, world_size, dtype, seconds, cap_note) if rank == 0 else None


def _report(
    ctx: BenchContext, world_size: int, dtype: torch.dtype, seconds: dict[str, float], cap_note: str
) -> BenchReport:
    flags = ctx.flags
    nbytes = flags.count * flags.numel * torch.empty((), dtype=dtype).element_size()
    single = seconds["single"]
    peer = seconds.get("torch_coalesced")
    rows = []
    for name, t in seconds.items():
        tensors = 1 if name == "single" else flags.count
        rows.append(
            dict(
                variant=name,
                tensors=tensors,
                bytes=nbytes,
                time_ms=t * 1e3,
                algbw=bandwidth_gbs(nbytes, t),
                share_of_single=single / t,
                vs_torch_coalesced=(t / peer) if peer else None,
            )
        )
    columns = [
        Column("variant", "variant", 17),
        Column("tensors", "tensors", 8),
        Column("bytes", "bytes", 10),
        Column("time_ms", "time(ms)", 10, ".2f", "ms"),
        Column("algbw", "algbw(GB/s)", 12, ".3f", "GB/s"),
        Column("share_of_single", "share_of_single", 16, ".1%"),
        Column("vs_torch_coalesced", "time/torch_coal", 16, ".2f", "x"),
    ]
    footer = [f"floor: single all-reduce of {format_bytes(nbytes)} = {single * 1e3:.2f} ms"]
    summary = {"share_of_single": {r["variant"]: r["share_of_single"] for r in rows}}
    goals = []
    if "fastpar_bucketed" in seconds:
        bucketed = seconds["fastpar_bucketed"]
        flag = beyond_floor("fastpar_bucketed", bucketed, single, "single")
        goals.append(BUCKETED_VS_SINGLE.check(single / bucketed, flag=flag))
    footer.append(f"one_by_one and async_one_wait: {flags.slow_iters} call(s) per round (--slow-iters)")
    return BenchReport(
        benchmark="fusion",
        title=f"all-reduce of {flags.count} tensors x {flags.numel} {dtype_name(dtype)}, {world_size} ranks",
        columns=columns,
        rows=rows,
        header={
            "backend": ctx.backend,
            "world size": str(world_size),
            "bucket cap": cap_note,
            "timing": f"median of {ctx.rounds} interleaved rounds x {ctx.iters} iters, slowest rank",
        },
        footer=footer,
        goals=goals,
        summary=summary,
        plot=PlotSpec("bar", "variant", "share_of_single", ylabel="speed as a share of one single tensor"),
    )


def run(ctx: BenchContext) -> BenchReport | None:
    flags = ctx.flags
    for flag, value in (("--count", flags.count), ("--numel", flags.numel), ("--slow-iters", flags.slow_iters)):
        if value < 1:
            raise BenchUsageError(f"{flag} must be at least 1, got {value}")
    _selected(flags)
    if parse_dtype(ctx.dtype) not in (torch.float32, torch.float16, torch.bfloat16):
        raise BenchUsageError(f"fusion needs float32, float16 or bfloat16 (fastpar buckets), got {ctx.dtype}")
    return launch.run_distributed(_rank_main, ctx)
