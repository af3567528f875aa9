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
goal lines of the fastpar backend under the table.
"""

from __future__ import annotations

import argparse

import torch

from . import launch
from .collective_cases import NAMES, OPS, CollectiveCase, bus_factor, case_call, distinct_sizes, make_case
from .harness import (
    DTYPES,
    Plan,
    WrongResultError,
    bandwidth_gbs,
    count_mismatches,
    dtype_name,
    format_bytes,
    memcpy_seconds,
    parse_dtype,
    synchronize,
)
from .table import BenchReport, Column, PlotSpec

DESCRIPTION = "torch.distributed collectives, nccl-tests style: time, algbw, busbw, #wrong per size"
USES = {"sizes", "nproc", "dtype"}
DEFAULTS = {"min_bytes": "1K", "max_bytes": "16M", "factor": 4, "iters": 10, "warmup": 3, "rounds": 3}
DTYPE_CHOICES = tuple(dict.fromkeys(DTYPES.values()))  # every --dtype: the check values are exact in each
__all__ = ["NAMES", "CollectiveCase", "bus_factor", "case_call", "check_and_time", "make_case", "run"]


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


def check_and_time(
    name: str, nbytes: int, dtype: torch.dtype, device: torch.device, rank: int, world_size: int, plan: Plan,
    *, timed: bool = True,
) -> tuple[CollectiveCase, int, float | None]:  # fmt: skip
    """One collective at one size: check every element against the exact result (all ranks agree on the
    count of wrong ones), then, when right and ``timed``, time it on zeroed buffers (slowest rank's median).
    Returns ``(case, wrong elements summed over ranks, seconds or None)``."""
    case = make_case(name, nbytes, dtype, device, rank, world_size)
    case.call()
    synchronize(device)
    wrong = launch.agree_count(count_mismatches(case.out, case.expected), device)
    if wrong or not timed:
        return case, wrong, None
    case.inp.zero_()
    case.out.zero_()  # timed on zeros: repeated in-place sums never overflow
    return case, 0, launch.time_on_all_ranks({"op": case.call}, plan, device)["op"]


def _rank_main(rank: int, world_size: int, args: argparse.Namespace) -> BenchReport | None:
    device = launch.rank_device(args.backend)
    dtype = parse_dtype(args.dtype)
    plan = Plan(args.warmup, args.rounds, args.iters)
    peer_group = launch.gloo_peer(args.backend)  # fastpar: gloo over the same ranks, timed alongside
    sizes = distinct_sizes(args.benchmark, args.sizes, torch.empty((), dtype=dtype).element_size(), world_size)
    rows, wrong_sizes = [], []
    for nbytes in sizes:
        cases = {"op": make_case(args.benchmark, nbytes, dtype, device, rank, world_size)}
        if peer_group is not None:
            cases["gloo"] = make_case(args.benchmark, nbytes, dtype, device, rank, world_size, group=peer_group)
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
        seconds = launch.time_on_all_ranks({name: each.call for name, each in cases.items()}, plan, device)
        algbw = bandwidth_gbs(case.nbytes, seconds["op"])
        row = dict(size=case.nbytes, count=case.count, dtype=dtype_name(dtype), time_us=seconds["op"] * 1e6,
                   algbw=algbw, busbw=algbw * bus_factor(args.benchmark, world_size), wrong=wrong)  # fmt: skip
        if "gloo" in seconds:
            row.update(gloo_us=seconds["gloo"] * 1e6, x_gloo=seconds["gloo"] / seconds["op"])
        rows.append(row)
        del cases, case
    if wrong_sizes:
        raise WrongResultError(
            f"{args.benchmark} on {world_size} ranks gave wrong results at: {'; '.join(wrong_sizes)}"
        )
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
    return _report(args, world_size, device, rows, floors) if rank == 0 else None


def _floor_bytes(sizes: list[int]) -> int:
    """Large enough to leave the caches (64M), as large as the largest message up to 1G."""
    return max(64 << 20, min(max(sizes), 1 << 30))


def _report(args, world_size: int, device: torch.device, rows: list[dict], floors: tuple) -> BenchReport:
    name = args.benchmark
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
    header = {"backend": args.backend, "world size": str(world_size), "device": str(device)}
    if args.backend == "nccl":
        header["NCCL version"] = _nccl_version() or "unknown"
    header["op"] = OPS[name]
    header["timing"] = f"median of {args.rounds} rounds x {args.iters} iters after {args.warmup} warm-up, slowest rank"
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
            f"({bound / memcpy_gbs:.0%} of one rank's memcpy); at {format_bytes(largest['size'])} busbw = "
            f"{largest['busbw'] / bound:.0%} of that bound"
        )
    goals = _fastpar_goals(name, rows, memcpy_gbs) if rows and "gloo_us" in rows[0] else {}
    footer += [f"goal {text}: {'MET' if met else 'NOT MET'}" for text, met in goals.items()]
    return BenchReport(
        benchmark=name,
        title=f"{name} bandwidth, {world_size} rank{'s' if world_size > 1 else ''}",
        columns=columns,
        rows=rows,
        header=header,
        footer=footer,
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
            "backend": args.backend,
            "goals_met": goals,
        },  # fmt: skip
        plot=PlotSpec("line", "size", "busbw" if world_size > 1 else "algbw", ylabel="GB/s"),
    )


# issue 17, at 2 ranks: big fp32 all-reduces >= 4x gloo's speed at >= 40% of memcpy's bandwidth; 4 KB in half
# of gloo's time
_GOAL_SPEEDUP_SIZES, _GOAL_SPEEDUP, _GOAL_MEMCPY_SHARE = (16 << 20, 64 << 20), 4.0, 0.40
_GOAL_LATENCY_SIZE, _GOAL_LATENCY_RATIO = 4 << 10, 0.5


def _allreduce_bound(name: str, world_size: int, shared_gbs: float) -> float | None:
    """The busbw a CPU all-reduce cannot pass: each rank reads and writes its buffer once, at the bandwidth it gets
    with every rank copying (time >= one such memcpy), and busbw = algbw x 2(n-1)/n."""
    if name != "allreduce" or world_size < 2:
        return None
    return shared_gbs / 2 * bus_factor(name, world_size)


def _fastpar_goals(name: str, rows: list[dict], memcpy_gbs: float) -> dict[str, bool]:
    """The goal lines of the fastpar backend for the sizes this run measured (all-reduce, float32)."""
    goals: dict[str, bool] = {}
    if name != "allreduce":
        return goals
    by_size = {r["size"]: r for r in rows if r["dtype"] == "float32"}
    for size in _GOAL_SPEEDUP_SIZES:
        if size in by_size:
            row = by_size[size]
            goals[f"{format_bytes(size)} all-reduce >= {_GOAL_SPEEDUP:.0f}x faster than gloo: {row['x_gloo']:.2f}x"] = (
                row["x_gloo"] >= _GOAL_SPEEDUP
            )
            share = row["busbw"] / memcpy_gbs if memcpy_gbs else 0.0
            goals[f"{format_bytes(size)} busbw >= {_GOAL_MEMCPY_SHARE:.0%} of memcpy: {share:.0%}"] = (
                share >= _GOAL_MEMCPY_SHARE
            )
    if _GOAL_LATENCY_SIZE in by_size:
        ratio = 1.0 / by_size[_GOAL_LATENCY_SIZE]["x_gloo"]
        text = f"{format_bytes(_GOAL_LATENCY_SIZE)} all-reduce time <= {_GOAL_LATENCY_RATIO}x gloo's: {ratio:.2f}x"
        goals[text] = ratio <= _GOAL_LATENCY_RATIO
    return goals


def run(args: argparse.Namespace) -> BenchReport | None:
    return launch.run_distributed(_rank_main, args)
