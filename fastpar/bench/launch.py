"""Run a benchmark on N ranks: spawn them locally (``--nproc N``) or join a torchrun launch, both
through :mod:`fastpar.launcher`.

Backend: gloo on CPU; NCCL when CUDA is available and every rank gets its own GPU; ``fastpar`` (fastpar's
shared-memory backend, CPU) when asked for, with a gloo group over the same ranks as the peer. A benchmark's
per-rank function is ``fn(rank, world_size, ctx, *settings) -> BenchReport | None`` (rank 0 returns the report);
it raises :class:`WrongResultError` on every rank alike (ranks agree first with :func:`agree_count`),
so no rank is left waiting in a collective.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..launcher import join_process_group, launched_by_torchrun, leave_process_group, set_threads, spawn
from .context import BenchContext
from .harness import BenchUsageError, Plan, WrongResultError, interleaved_rounds, median

BACKENDS = ("auto", "gloo", "nccl", "fastpar")


def max_cpu_ranks() -> int:
    """More CPU ranks than this measures the scheduler, not the collective."""
    return max(8, 2 * (os.cpu_count() or 1))


@dataclass(frozen=True)
class World:
    nproc: int
    backend: str  # "gloo" | "nccl" | "fastpar"
    external: bool  # True under torchrun: this process is one rank already


def resolve_world(nproc: int | None, backend: str = "auto") -> World:
    """Check ``--nproc``/``--backend`` against the machine and pick the backend."""
    if backend not in BACKENDS:
        raise BenchUsageError(f"unknown backend {backend!r}; use auto, gloo, nccl or fastpar")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    external = launched_by_torchrun()
    if external:
        world = int(os.environ["WORLD_SIZE"])
        if nproc is not None and nproc != world:
            raise BenchUsageError(f"--nproc {nproc} disagrees with torchrun's WORLD_SIZE={world}; drop --nproc")
        nproc = world
    elif nproc is None:
        nproc = gpus if gpus >= 1 and backend != "gloo" else 2
    if nproc < 1:
        raise BenchUsageError(f"--nproc must be at least 1, got {nproc}")
    # the ranks that share this machine's GPUs: all of them when spawned here, torchrun's local ones otherwise
    local = int(os.environ.get("LOCAL_WORLD_SIZE", nproc)) if external else nproc
    if backend == "auto":
        if gpus >= 1 and local > gpus and not external:
            raise BenchUsageError(
                f"--nproc {nproc} is above the {gpus} GPU(s) visible; use --nproc {gpus} or fewer, "
                "or --backend gloo to run CPU ranks"
            )
        backend = "nccl" if gpus >= 1 and local <= gpus else "gloo"
    if backend == "nccl":
        if gpus == 0:
            raise BenchUsageError("--backend nccl needs CUDA GPUs and none is visible; use --backend gloo")
        if local > gpus:
            raise BenchUsageError(
                f"{local} ranks on this machine but only {gpus} GPU(s) visible; NCCL needs one GPU per rank"
            )
    if backend in ("gloo", "fastpar") and not external and nproc > max_cpu_ranks():
        raise BenchUsageError(
            f"--nproc {nproc} is above {max_cpu_ranks()} CPU ranks for this {os.cpu_count()}-core machine; "
            "the numbers would measure the scheduler. Use fewer ranks or torchrun across machines"
        )
    return World(nproc=nproc, backend=backend, external=external)


def gloo_peer(backend: str):
    """On the fastpar backend, a gloo group over the same ranks (torch's own CPU collectives: the peer every
    benchmark times next to it); None otherwise. Collective: every rank calls it."""
    return dist.new_group(backend="gloo") if backend == "fastpar" else None


def rank_device(backend: str) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree_count(count: int, device: torch.device) -> int:
    """Sum of ``count`` over all ranks (every rank gets the same answer)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return count
    total = torch.tensor([count], dtype=torch.int64, device=device)
    dist.all_reduce(total)
    return int(total.item())


def slowest(seconds: list[float], device: torch.device) -> list[float]:
    """Element-wise maximum over ranks: a collective is as slow as its slowest rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(seconds)
    values = torch.tensor(seconds, dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values.tolist()


def barrier(device: torch.device) -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        if device.type == "cuda":
            dist.barrier(device_ids=[device.index])
        else:
            dist.barrier()


def time_on_all_ranks(
    variants: Mapping[str, Callable[[], object]], plan: Plan, device: torch.device, **overrides: Any
) -> dict[str, float]:
    """Median seconds per call of each variant (interleaved rounds, every rank starting each timed block
    together after a barrier), as measured by the slowest rank. ``overrides`` go to
    :func:`~fastpar.bench.harness.interleaved_rounds` (``iters``, ``warmups``)."""
    times = interleaved_rounds(variants, plan, device, before_round=lambda: barrier(device), **overrides)
    names = list(variants)
    return dict(zip(names, slowest([median(times[name]) for name in names], device), strict=True))


@dataclass(frozen=True)
class _Wrong:
    message: str


def _rank_entry(rank: int, world_size: int, fn: Callable[..., Any], args: tuple) -> Any:
    try:
        return fn(rank, world_size, *args)
    except WrongResultError as exc:
        return _Wrong(str(exc))


def run_ranks(fn: Callable[..., Any], world: World, *args: Any, threads: int = 1, timeout: float = 3600.0) -> Any:
    """Run ``fn(rank, world_size, *args)`` on every rank; return rank 0's value (None on other
    torchrun ranks). Raises :class:`WrongResultError` when the ranks found a wrong result."""
    if world.external:
        value = _run_external(fn, args, world, threads)
    else:
        value = spawn(_rank_entry, world.nproc, fn, args, backend=world.backend, threads=threads, timeout=timeout)[0]
    if isinstance(value, _Wrong):
        raise WrongResultError(value.message)
    return value


def run_distributed(rank_main: Callable[..., Any], ctx: BenchContext, *settings: Any) -> Any:
    """The ``run(ctx)`` of a multi-rank benchmark: check ``--nproc``/``--backend``, record the backend
    chosen in ``ctx.backend``, run ``rank_main(rank, world_size, ctx, *settings)`` on every rank, return rank
    0's value."""
    world = resolve_world(ctx.nproc, ctx.backend)
    ctx.backend = world.backend
    return run_ranks(rank_main, world, ctx, *settings, threads=ctx.threads)


def _run_external(fn: Callable[..., Any], args: tuple, world: World, threads: int) -> Any:
    rank = int(os.environ["RANK"])
    set_threads(threads)
    if world.backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    owns_group = not dist.is_initialized()
    if owns_group:
        join_process_group(world.backend, rank=rank, world_size=world.nproc)
    try:
        value = _rank_entry(rank, world.nproc, fn, args)
    finally:
        if owns_group:
            leave_process_group()
    return value if rank == 0 else (value if isinstance(value, _Wrong) else None)
