"""The buffers, calls and exact expected results of each collective benchmark (``fastpar bench allreduce`` ...).

Sizes follow nccl-tests: ``size`` is the larger buffer of the operation in bytes (the whole input of a
reduce-scatter, the whole output of an all-gather or all-to-all) and ``count`` the elements each rank
passes to the call: the whole buffer for all-reduce and broadcast, one rank's share for reduce-scatter,
all-gather and all-to-all. A requested size is rounded down to whole elements, and for those three to a
whole number of elements per rank (``size = count x world size x element size``).

Check values: small integers that depend on the rank and the index, exact in every supported dtype
(int8 and bfloat16 included) at any world size. In a reduction each element gets one "owner" term
(1..5, from rank ``i % n``) plus a 1 from each of the first 8 ranks, so no sum, partial or final,
exceeds 13; gathered and exchanged values are 0..61 and say which rank sent them.

:func:`check_and_time` checks one case on every rank and times it: the step the collective benchmarks and
``fastpar bench calibrate`` share.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import launch
from ..harness import Plan, count_mismatches, parse_dtype, synchronize

# name -> what the call does, for --help and the table header
OPS = {
    "allreduce": "sum of all ranks' buffers, in place",
    "reducescatter": "sum of all ranks' buffers, rank r keeps share r",
    "allgather": "every rank's share, gathered on every rank",
    "broadcast": "rank 0's buffer to every rank, in place",
    "alltoall": "rank r sends its k-th share to rank k",
}
NAMES = tuple(OPS)
SPLIT = ("reducescatter", "allgather", "alltoall")  # the buffer is split into one share per rank
_BASE_RANKS = 8  # ranks that add a 1 to every element of a reduction


def bus_factor(name: str, world_size: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw x factor."""
    n = world_size
    if name == "allreduce":
        return 2.0 * (n - 1) / n
    if name in SPLIT:
        return (n - 1) / n
    if name == "broadcast":
        return 1.0
    raise ValueError(f"unknown collective {name!r}; one of {', '.join(NAMES)}")


def element_counts(name: str, nbytes: int, element_size: int, world_size: int) -> tuple[int, int]:
    """``(count, total)``: elements per call (nccl-tests' count) and elements of the larger buffer for a
    requested size of ``nbytes``, rounded down (at least one element per rank)."""
    total = max(1, nbytes // element_size)
    if name in SPLIT:
        count = max(1, total // world_size)
        return count, count * world_size
    return total, total


def distinct_sizes(name: str, sizes: list[int], element_size: int, world_size: int) -> list[int]:
    """The requested sizes, dropping those that round to the same buffer as a smaller one."""
    seen, kept = set(), []
    for nbytes in sizes:
        total = element_counts(name, nbytes, element_size, world_size)[1]
        if total not in seen:
            seen.add(total)
            kept.append(nbytes)
    return kept


def _reduce_input(idx: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """Rank ``rank``'s contribution at indices ``idx``: 1 from the first ranks, plus 1..5 from the owner."""
    base = 1 if rank < _BASE_RANKS else 0
    return base + torch.where(idx % n == rank, 1 + idx % 5, 0)


def _reduce_result(idx: torch.Tensor, n: int) -> torch.Tensor:
    return min(n, _BASE_RANKS) + 1 + idx % 5


def _tag(source: int, numel: int, device: torch.device) -> torch.Tensor:
    """Values 0..60 that differ between sources (mod 61) and along the buffer: who sent what, where."""
    return (torch.arange(numel, device=device, dtype=torch.int64) + 7 * source) % 61


@dataclass
class CollectiveCase:
    """One collective at one size on one rank: buffers, the call, and the exact expected result."""

    name: str
    count: int  # elements per call on each rank (nccl-tests' count)
    total: int  # elements of the larger buffer
    inp: torch.Tensor
    out: torch.Tensor
    call: Callable[[], object]
    expected: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.total * self.inp.element_size()


def make_case(
    name: str, nbytes: int, dtype: torch.dtype, device: torch.device, rank: int, n: int, group=None
) -> CollectiveCase:
    """Buffers for ``name`` moving about ``nbytes`` (see :func:`element_counts`), filled with the check values;
    the call runs on ``group`` (default: the default process group)."""
    count, total = element_counts(name, nbytes, torch.empty((), dtype=dtype).element_size(), n)
    idx = torch.arange(total, device=device, dtype=torch.int64)
    share = slice(rank * count, (rank + 1) * count)
    if name == "allreduce":
        inp = _reduce_input(idx, rank, n).to(dtype)
        out, expected = inp, _reduce_result(idx, n)
        call = lambda: dist.all_reduce(inp, group=group)  # noqa: E731
    elif name == "reducescatter":
        inp = _reduce_input(idx, rank, n).to(dtype)
        out, expected = torch.zeros(count, dtype=dtype, device=device), _reduce_result(idx[share], n)
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        call = lambda: reduce_scatter(out, inp, group=group)  # noqa: E731
    elif name == "allgather":
        inp = _tag(rank, count, device).to(dtype)
        out = torch.zeros(total, dtype=dtype, device=device)
        expected = torch.cat([_tag(k, count, device) for k in range(n)])
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        call = lambda: all_gather(out, inp, group=group)  # noqa: E731
    elif name == "alltoall":
        inp = torch.cat([_tag(rank * n + k, count, device) for k in range(n)]).to(dtype)
        out = torch.zeros(total, dtype=dtype, device=device)
        expected = torch.cat([_tag(k * n + rank, count, device) for k in range(n)])
        call = lambda: dist.all_to_all_single(out, inp, group=group)  # noqa: E731
    elif name == "broadcast":
        expected = 1 + _tag(0, total, device)
        inp = (expected if rank == 0 else torch.zeros_like(expected)).to(dtype)
        out = inp
        call = lambda: dist.broadcast(inp, src=0, group=group)  # noqa: E731
    else:
        raise ValueError(f"unknown collective {name!r}; one of {', '.join(NAMES)}")
    return CollectiveCase(name, count, total, inp, out, call, expected.to(dtype))


def case_call(rank: int, world_size: int, name: str, nbytes: int, dtype: str = "float32") -> Callable[[], object]:
    """One rank's call of ``name`` at ``nbytes`` on zeroed CPU buffers (for ``fastpar.bench.peers``)."""
    case = make_case(name, nbytes, parse_dtype(dtype), torch.device("cpu"), rank, world_size)
    case.inp.zero_()
    case.out.zero_()
    return case.call


def check_and_time(
    name: str,
    nbytes: int,
    dtype: torch.dtype,
    device: torch.device,
    rank: int,
    world_size: int,
    plan: Plan,
    *,
    timed: bool = True,
) -> tuple[CollectiveCase, int, float | None]:
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
