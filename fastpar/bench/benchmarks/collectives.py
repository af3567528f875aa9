"""``fastpar bench allreduce|reducescatter|allgather|broadcast|alltoall``: nccl-tests for torch.distributed.

Sizes follow nccl-tests: ``size`` is the larger buffer of the operation in bytes (the whole input of a
reduce-scatter, the whole output of an all-gather or all-to-all) and ``count`` the elements each rank
passes to the call: the whole buffer for all-reduce and broadcast, one rank's share for reduce-scatter,
all-gather and all-to-all. A requested size is rounded down to whole elements, and for those three to a
whole number of elements per rank (``size = count x world size x element size``); sizes that round to a
size already measured are measured once. algbw = size / time; busbw = algbw x the collective's bus
factor, which makes numbers comparable with the link speed: all-reduce 2(n-1)/n; reduce-scatter,
all-gather, all-to-all (n-1)/n; broadcast 1.

Correctness: every element of every size is checked against exact expected values before that size is
timed (``collective_cases``); timing runs on zero-filled buffers, so repeated in-place sums never overflow.
The floor is one large ``copy_`` on the same device (memcpy), in the same run. With ``--backend fastpar``
(fastpar's shared-memory backend) the same collective on a gloo group over the same ranks is checked and
timed in the same interleaved rounds: columns ``gloo(us)`` and ``x gloo`` (gloo's time / fastpar's), and the
goals of the fastpar backend under the table. A size at least as large as the memcpy floor's buffer whose
busbw is above what an in-place all-reduce can reach (every rank reads and writes its buffer once at the
memcpy speed all ranks get together) is flagged: such a goal is IMPOSSIBLE, never MET.
"""

from __future__ import annotations

import argparse

import torch

from .. import launch
from ..context import BenchContext
from ..goals import AT_LEAST, AT_MOST, Goal, Verdict, above_bound
from ..harness import (
    DTYPES,
    WrongResultError,
    bandwidth_gbs,
    count_mismatches,
    dtype_name,
    format_bytes,
    memcpy_seconds,
    parse_dtype,
    synchronize,
)
from ..table import BenchReport, Column, PlotSpec
from .collective_cases import OPS, bus_factor, distinct_sizes, make_case

DESCRIPTION = "torch.distributed collectives, nccl-tests style: time, algbw, busbw, #wrong per size"
USES = {"sizes", "nproc", "dtype"}
DEFAULTS = {"min_bytes": "1K", "max_bytes": "16M", "factor": 4, "iters": 10, "warmup": 3, "rounds": 3}
DTYPE_CHOICES = tuple(dict.fromkeys(DTYPES.values()))  # every --dtype: the check values are exact in each


def describe(name: str) -> str:
    """One line for ``fastpar bench --help``."""
    return f"{OPS[name]}; nccl-tests style busbw table"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "size = the larger buffer in bytes, count = elements per rank per call (nccl-tests' columns); "
        "a size is rounded down to whole elements, and for reducescatter/allgather/alltoall to whole elements "
        "per rank. Every size is checked element by element before it is timed; a wrong result exits with "
        "status 1 and no speed."
    )


def _nccl_version() -> str | None:
    from ..info import collect

    return collect()["nccl"]


def _rank_main(rank: int, world_size: int, ctx: BenchContext) -> BenchReport | None:
    device = launch.rank_device(ctx.backend)
    dtype = parse_dtype(ctx.dtype)
    plan = ctx.plan
    name = ctx.benchmark
    peer_group = launch.gloo_peer(ctx.backend)  # fastpar: gloo over the same ranks, timed alongside
    sizes = distinct_sizes(name, ctx.sizes, torch.empty((), dtype=dtype).element_size(), world_size)
    rows, wrong_sizes = [], []
    for nbytes in sizes:
        cases = {"op": make_case(name, nbytes, dtype, device, rank, world_size)}
        if peer_group is not None:
            cases["gloo"] = make_case(name, nbytes, dtype, device, rank, world_size, group=peer_group)
        wrong = 0
        for case in cases.values():
            case.call()
            synchronize(device)
            wrong += launch.agree_count(count_mismatches(case.out, case.expected), device)
        case = cases["op"]
        if wrong:
            wrong_sizes.append(f"{format_bytes(case.nbytes)} ({wrong} wrong elements summed over ranks)")
        if wrong_sizes:
            continue  # keep checking the other sizes, but time nothing once a result was wrong
        for each in cases.values():
            each.inp.zero_()
            each.out.zero_()
        seconds = launch.time_on_all_ranks({key: each.call for key, each in cases.items()}, plan, device)
        algbw = bandwidth_gbs(case.nbytes, seconds["op"])
        row = dict(
            size=case.nbytes,
            count=case.count,
            dtype=dtype_name(dtype),
            time_us=seconds["op"] * 1e6,
            algbw=algbw,
            busbw=algbw * bus_factor(name, world_size),
            wrong=wrong,
        )
        if "gloo" in seconds:
            row.update(gloo_us=seconds["gloo"] * 1e6, x_gloo=seconds["gloo"] / seconds["op"])
        rows.append(row)
        del cases, case
    if wrong_sizes:
        raise WrongResultError(f"{name} on {world_size} ranks gave wrong results at: {'; '.join(wrong_sizes)}")
    floor_bytes, floor_gbs = _floor_bytes(sizes), 0.0
    if rank == 0:  # the other ranks wait idle in the barrier, so the copy has the machine to itself
        floor_gbs = bandwidth_gbs(2 * floor_bytes, memcpy_seconds(floor_bytes, device, plan))
    launch.barrier(device)
    # Every rank copying at once: the bandwidth each gets when all move bytes together, as in a collective (on a
    # CPU the ranks share the memory bus; GPUs each have their own memory).
    shared_gbs = floor_gbs
    if world_size > 1:
        seconds = launch.slowest([memcpy_seconds(floor_bytes, device, plan)], device)[0]
        shared_gbs = bandwidth_gbs(2 * floor_bytes, seconds)
    floors = (floor_bytes, floor_gbs, shared_gbs)
    return _report(ctx, world_size, device, rows, floors) if rank == 0 else None


def _floor_bytes(sizes: list[int]) -> int:
    """Large enough to leave the caches (64M), as large as the largest message up to 1G."""
    return max(64 << 20, min(max(sizes), 1 << 30))


def _report(ctx: BenchContext, world_size: int, device: torch.device, rows: list[dict], floors: tuple) -> BenchReport:
    name = ctx.benchmark
    floor_bytes, memcpy_gbs, shared_gbs = floors
    columns = [
        Column("size", "size(B)", 12, unit="B"),
        Column("count", "count", 12, unit="elements"),
        Column("dtype", "dtype", 9),
        Column("time_us", "time(us)", 11, ".1f", "us"),
        Column("algbw", "algbw(GB/s)", 12, ".4g", "GB/s"),
        Column("busbw", "busbw(GB/s)", 12, ".4g", "GB/s"),
        Column("wrong", "#wrong", 7),
    ]
    if rows and "gloo_us" in rows[0]:  # the fastpar backend, with gloo (the peer) timed in the same rounds
        columns += [Column("gloo_us", "gloo(us)", 11, ".1f", "us"), Column("x_gloo", "x gloo", 7, ".2f", "x")]
    header = {"backend": ctx.backend, "world size": str(world_size), "device": str(device)}
    if ctx.backend == "nccl":
        header["NCCL version"] = _nccl_version() or "unknown"
    header["op"] = OPS[name]
    header["timing"] = f"median of {ctx.rounds} rounds x {ctx.iters} iters after {ctx.warmup} warm-up, slowest rank"
    avg_busbw = sum(r["busbw"] for r in rows) / len(rows)
    peak_busbw, peak_algbw = max(r["busbw"] for r in rows), max(r["algbw"] for r in rows)
    factor = bus_factor(name, world_size)
    floor_line = f"floor: memcpy (one copy_ of {format_bytes(floor_bytes)}, read+write)"
    footer = [
        f"Out of bounds values : {sum(r['wrong'] for r in rows)} OK",
        f"Avg bus bandwidth    : {avg_busbw:.4g} GB/s",
        f"{floor_line} {memcpy_gbs:.4g} GB/s; peak busbw = {peak_busbw / memcpy_gbs:.2%} of memcpy, "
        f"peak algbw = {peak_algbw / memcpy_gbs:.2%}",
        f"bus factor for {world_size} rank{'s' if world_size > 1 else ''}: {factor:.3f}",
    ]
    if world_size == 1:
        footer.append("one rank: nothing crosses a link, so busbw is 0 by definition; compare algbw")
    else:
        footer.append(f"floor: memcpy on all {world_size} ranks at once {shared_gbs:.4g} GB/s each")
    bound = _allreduce_bound(name, world_size, shared_gbs)
    if bound:
        largest = rows[-1]  # the buffers that leave the caches, like the memcpy
        footer.append(
            f"an in-place all-reduce reads and writes every byte on every rank: busbw <= {bound:.4g} GB/s "
            f"({bound / memcpy_gbs:.1%} of one rank's memcpy); at {format_bytes(largest['size'])} busbw = "
            f"{largest['busbw'] / bound:.1%} of that bound"
        )
    goals = _fastpar_goals(name, rows, memcpy_gbs, bound, floor_bytes) if rows and "gloo_us" in rows[0] else []
    return BenchReport(
        benchmark=name,
        title=f"{name} bandwidth, {world_size} rank{'s' if world_size > 1 else ''}",
        columns=columns,
        rows=rows,
        header=header,
        footer=footer,
        goals=goals,
        summary={
            "avg_busbw_gbs": avg_busbw,
            "peak_busbw_gbs": peak_busbw,
            "peak_algbw_gbs": peak_algbw,
            "memcpy_gbs": memcpy_gbs,
            "memcpy_all_ranks_gbs": shared_gbs,
            "allreduce_bound_busbw_gbs": bound,
            "peak_busbw_of_memcpy": peak_busbw / memcpy_gbs,
            "bus_factor": factor,
            "world_size": world_size,
            "backend": ctx.backend,
        },
        plot=PlotSpec("line", "size", "busbw" if world_size > 1 else "algbw", ylabel="GB/s"),
    )


# the fastpar backend's all-reduce (float32): big messages at least 4x gloo's speed at 40% of memcpy's
# bandwidth, small ones in half of gloo's time
SPEEDUP_SIZES, LATENCY_SIZE = (16 << 20, 64 << 20), 4 << 10
SPEEDUP_VS_GLOO = Goal("all-reduce speed", "gloo's", 4.0, AT_LEAST)
BUSBW_OF_MEMCPY = Goal("all-reduce busbw", "of memcpy", 0.40, AT_LEAST, unit="%")
LATENCY_VS_GLOO = Goal("all-reduce time", "gloo's", 0.5, AT_MOST)


def _allreduce_bound(name: str, world_size: int, shared_gbs: float) -> float | None:
    """The busbw a CPU all-reduce cannot pass: each rank reads and writes its buffer once, at the bandwidth it gets
    with every rank copying (time >= one such memcpy), and busbw = algbw x 2(n-1)/n."""
    if name != "allreduce" or world_size < 2:
        return None
    return shared_gbs / 2 * bus_factor(name, world_size)


def _fastpar_goals(
    name: str, rows: list[dict], memcpy_gbs: float, bound: float | None, floor_bytes: int
) -> list[Verdict]:
    """The goals of the fastpar backend for the sizes this run measured (all-reduce, float32)."""
    if name != "allreduce":
        return []
    by_size = {r["size"]: r for r in rows if r["dtype"] == "float32"}

    def flag(row: dict) -> str | None:
        # only buffers that leave the caches, like the memcpy, are held to its bound
        if bound is None or row["size"] < floor_bytes:
            return None
        return above_bound(f"{format_bytes(row['size'])} busbw", row["busbw"], bound, "the in-place all-reduce bound")

    goals = []
    for size in SPEEDUP_SIZES:
        if size in by_size:
            row, scope = by_size[size], format_bytes(size)
            goals.append(SPEEDUP_VS_GLOO.check(row["x_gloo"], scope=scope, flag=flag(row)))
            share = row["busbw"] / memcpy_gbs if memcpy_gbs else 0.0
            goals.append(BUSBW_OF_MEMCPY.check(share, scope=scope, flag=flag(row)))
    if LATENCY_SIZE in by_size:
        row = by_size[LATENCY_SIZE]
        goals.append(LATENCY_VS_GLOO.check(1.0 / row["x_gloo"], scope=format_bytes(LATENCY_SIZE), flag=flag(row)))
    return goals


def run(ctx: BenchContext) -> BenchReport | None:
    return launch.run_distributed(_rank_main, ctx)
