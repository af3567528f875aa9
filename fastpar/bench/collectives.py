"""``fastpar bench allreduce|reducescatter|allgather|broadcast|alltoall``: nccl-tests for torch.distributed.

Sizes follow nccl-tests: ``size`` is the larger buffer of the operation in bytes (the whole input of a
reduce-scatter, the whole output of an all-gather) and ``count`` its elements. algbw = size / time;
busbw = algbw x the collective's bus factor, which makes numbers comparable with the link speed:
all-reduce 2(n-1)/n; reduce-scatter, all-gather, all-to-all (n-1)/n; broadcast 1.

Correctness: every rank fills its input with small rank- and index-dependent integers whose result is
exact in every dtype (for up to 32 ranks), and every element of the result is checked before timing.
Timing runs on zero-filled buffers, so repeated in-place sums never overflow.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import launch
from .harness import (
    Plan,
    WrongResultError,
    bandwidth_gbs,
    count_mismatches,
    dtype_name,
    format_bytes,
    interleaved_rounds,
    median,
    memcpy_seconds,
    parse_dtype,
    synchronize,
)
from .table import BenchReport, Column, PlotSpec

NAMES = ("allreduce", "reducescatter", "allgather", "broadcast", "alltoall")
DESCRIPTION = "torch.distributed collectives, nccl-tests style: time, algbw, busbw, #wrong per size"
USES = {"sizes", "nproc", "dtype"}
DEFAULTS = {"min_bytes": "1K", "max_bytes": "16M", "factor": 4, "iters": 10, "warmup": 3, "rounds": 3}


def bus_factor(name: str, world_size: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw x factor."""
    n = world_size
    if name == "allreduce":
        return 2.0 * (n - 1) / n
    if name in ("reducescatter", "allgather", "alltoall"):
        return (n - 1) / n
    if name == "broadcast":
        return 1.0
    raise ValueError(f"unknown collective {name!r}; one of {', '.join(NAMES)}")


def _pattern(numel: int, device: torch.device, offset: int = 0) -> torch.Tensor:
    """``(offset + i) % 4`` for i < numel, as int64."""
    return (torch.arange(numel, device=device, dtype=torch.int64) + offset) % 4


@dataclass
class CollectiveCase:
    """One collective at one size on one rank: buffers, the call, and the exact expected result."""

    name: str
    count: int  # elements of the larger buffer (nccl-tests' count)
    inp: torch.Tensor
    out: torch.Tensor
    call: Callable[[], object]
    expected: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.count * self.inp.element_size()


def make_case(name: str, nbytes: int, dtype: torch.dtype, device: torch.device, rank: int, n: int) -> CollectiveCase:
    """Buffers for ``name`` moving about ``nbytes`` (rounded down to whole elements, and to a multiple
    of the world size where the buffer is split across ranks), filled with the check pattern."""
    elem = torch.empty((), dtype=dtype).element_size()
    count = max(1, nbytes // elem)
    split = name in ("reducescatter", "allgather", "alltoall")
    if split:
        count = max(n, count // n * n)
    chunk = count // n

    def make(values: torch.Tensor) -> torch.Tensor:
        return values.to(dtype)

    if name == "allreduce":
        inp = make((rank % 4) + _pattern(count, device))
        out = inp
        expected = make(sum(k % 4 for k in range(n)) + n * _pattern(count, device))
        call = lambda: dist.all_reduce(inp)  # noqa: E731
    elif name == "reducescatter":
        inp = make((rank % 4) + _pattern(count, device))
        out = torch.zeros(chunk, dtype=dtype, device=device)
        expected = make(sum(k % 4 for k in range(n)) + n * _pattern(chunk, device, offset=rank * chunk))
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        call = lambda: reduce_scatter(out, inp)  # noqa: E731
    elif name == "allgather":
        inp = make((rank % 16) + _pattern(chunk, device))
        out = torch.zeros(count, dtype=dtype, device=device)
        expected = make(torch.cat([(k % 16) + _pattern(chunk, device) for k in range(n)]))
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        call = lambda: all_gather(out, inp)  # noqa: E731
    elif name == "alltoall":
        inp = make(torch.cat([((rank * n + k) % 16) + _pattern(chunk, device) for k in range(n)]))
        out = torch.zeros(count, dtype=dtype, device=device)
        expected = make(torch.cat([((k * n + rank) % 16) + _pattern(chunk, device) for k in range(n)]))
        call = lambda: dist.all_to_all_single(out, inp)  # noqa: E731
    elif name == "broadcast":
        values = 1 + _pattern(count, device)
        inp = make(values if rank == 0 else torch.zeros_like(values))
        out = inp
        expected = make(values)
        call = lambda: dist.broadcast(inp, src=0)  # noqa: E731
    else:
        raise ValueError(f"unknown collective {name!r}; one of {', '.join(NAMES)}")
    return CollectiveCase(name, count, inp, out, call, expected)


def case_call(rank: int, world_size: int, name: str, nbytes: int, dtype: str = "float32") -> Callable[[], object]:
    """One rank's call of ``name`` at ``nbytes`` on zeroed CPU buffers (for ``fastpar.bench.peers``)."""
    case = make_case(name, nbytes, parse_dtype(dtype), torch.device("cpu"), rank, world_size)
    case.inp.zero_()
    case.out.zero_()
    return case.call


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = "Sizes default to -b 1K -e 16M -f 4; each size is checked for correctness before it is timed."


def _nccl_version() -> str | None:
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # torch built without NCCL
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _rank_main(rank: int, world_size: int, args: argparse.Namespace) -> BenchReport | None:
    device = launch.rank_device(args.backend)
    dtype = parse_dtype(args.dtype)
    plan = Plan(args.warmup, args.rounds, args.iters)
    rows, wrong_sizes = [], []
    for nbytes in args.sizes:
        case = make_case(args.benchmark, nbytes, dtype, device, rank, world_size)
        case.call()
        synchronize(device)
        wrong = launch.agree_count(count_mismatches(case.out, case.expected), device)
        if wrong:
            wrong_sizes.append(f"{format_bytes(case.nbytes)} ({wrong} wrong elements summed over ranks)")
        if wrong_sizes:
            continue  # keep checking the other sizes, but time nothing once a result was wrong
        case.inp.zero_()
        case.out.zero_()
        times = interleaved_rounds({"op": case.call}, plan, device, before_round=lambda: launch.barrier(device))
        seconds = launch.slowest([median(times["op"])], device)[0]
        algbw = bandwidth_gbs(case.nbytes, seconds)
        rows.append(
            dict(size=case.nbytes, count=case.count, dtype=dtype_name(dtype), time_us=seconds * 1e6,
                 algbw=algbw, busbw=algbw * bus_factor(args.benchmark, world_size), wrong=wrong)
        )  # fmt: skip
        del case
    if wrong_sizes:
        raise WrongResultError(
            f"{args.benchmark} on {world_size} ranks gave wrong results at: {'; '.join(wrong_sizes)}"
        )
    floor = None
    if rank == 0:  # the other ranks wait idle in the barrier, so the copy has the machine to itself
        floor = bandwidth_gbs(2 * _floor_bytes(args.sizes), memcpy_seconds(_floor_bytes(args.sizes), device, plan))
    launch.barrier(device)
    return _report(args, world_size, device, rows, floor) if rank == 0 else None


_OPS = {
    "allreduce": "sum, in place",
    "reducescatter": "sum, out of place",
    "allgather": "out of place",
    "broadcast": "from rank 0, in place",
    "alltoall": "equal splits, out of place",
}


def _floor_bytes(sizes: list[int]) -> int:
    """Large enough to leave the caches (64M), as large as the largest message up to 1G."""
    return max(64 << 20, min(max(sizes), 1 << 30))


def _report(args, world_size: int, device: torch.device, rows: list[dict], memcpy_gbs: float) -> BenchReport:
    columns = [
        Column("size", "size(B)", 12),
        Column("count", "count", 12),
        Column("dtype", "dtype", 9),
        Column("time_us", "time(us)", 11, ".1f", "us"),
        Column("algbw", "algbw(GB/s)", 12, ".3f", "GB/s"),
        Column("busbw", "busbw(GB/s)", 12, ".3f", "GB/s"),
        Column("wrong", "#wrong", 7),
    ]
    header = {"backend": args.backend, "world size": str(world_size), "device": str(device)}
    if args.backend == "nccl":
        header["NCCL version"] = _nccl_version() or "unknown"
    header["op"] = _OPS[args.benchmark]
    header["timing"] = f"median of {args.rounds} rounds x {args.iters} iters after {args.warmup} warm-up, slowest rank"
    avg_busbw = sum(r["busbw"] for r in rows) / len(rows)
    peak_busbw = max(r["busbw"] for r in rows)
    footer = [
        "Out of bounds values : 0 OK",
        f"Avg bus bandwidth    : {avg_busbw:.3f} GB/s",
        f"floor: memcpy (one copy_ of {format_bytes(_floor_bytes(args.sizes))}, read+write) {memcpy_gbs:.3f} GB/s;"
        f" peak busbw = {peak_busbw / memcpy_gbs:.1%} of memcpy",
        f"bus factor for {world_size} ranks: {bus_factor(args.benchmark, world_size):.3f}",
    ]
    return BenchReport(
        benchmark=args.benchmark,
        title=f"{args.benchmark} bandwidth, {world_size} ranks",
        columns=columns,
        rows=rows,
        header=header,
        footer=footer,
        summary={
            "avg_busbw_gbs": avg_busbw,
            "peak_busbw_gbs": peak_busbw,
            "memcpy_gbs": memcpy_gbs,
            "world_size": world_size,
            "backend": args.backend,
        },  # fmt: skip
        plot=PlotSpec("line", "size", "busbw", ylabel="busbw (GB/s)"),
    )


def run(args: argparse.Namespace) -> BenchReport | None:
    world = launch.resolve_world(args.nproc, args.backend)
    args.backend = world.backend
    return launch.run_ranks(_rank_main, args, world, threads=args.threads)
