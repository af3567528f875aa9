"""Run a function on N local ranks with a process group: for tests, ``fastpar bench --nproc`` and
quick experiments. Training jobs use torch's elastic launcher instead (``fastpar.train``).

Every rank binds to loopback, gets a free port and a bounded process-group timeout; the first rank
that raises ends the whole group with its traceback, and a rank that never finishes is named —
never a silent hang.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_env(port: int, rank: int | None = None, world_size: int | None = None) -> dict[str, str]:
    """Environment variables that pin a local process group to the loopback interface."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo"}
    if rank is not None:
        env.update(RANK=str(rank), LOCAL_RANK=str(rank))
    if world_size is not None:
        env.update(WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    return env


def _worker(rank, world_size, port, backend, threads, pg_timeout, fn, args, results):
    import torch
    import torch.distributed as dist

    os.environ.update(loopback_env(port, rank, world_size))
    if threads:
        torch.set_num_threads(threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        if backend is not None:
            dist.init_process_group(
                backend,
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=pg_timeout),
            )
        # plain pickle bytes: torch's queue reductions would share tensors through file descriptors that
        # die with this process before the parent reads them
        value = pickle.dumps(fn(rank, world_size, *args))
        results.put((rank, True, value))
    except BaseException:  # report everything, KeyboardInterrupt included, to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if backend is not None and dist.is_initialized():
            dist.destroy_process_group()


class RankError(RuntimeError):
    """A spawned rank failed or did not finish; the message names the rank and carries its traceback."""


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = "gloo",
    threads: int | None = 1,
    timeout: float = 300.0,
    pg_timeout: float = 120.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes and return their results
    in rank order. ``fn`` and ``args`` must be picklable (a module-level function).

    ``backend=None`` starts no process group. ``threads`` sets ``torch.set_num_threads`` per rank.
    ``timeout`` bounds the whole run; ``pg_timeout`` is the process group's collective timeout.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, port, backend, threads, pg_timeout, fn, args, results),
            daemon=False,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while len(values) < world_size:
            remaining = (deadline - datetime.datetime.now()).total_seconds()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(values))
                raise RankError(f"ranks {missing} did not finish within {timeout:.0f} s (of {world_size} ranks)")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in values and p.exitcode not in (None, 0)]
                if dead:
                    codes = {r: procs[r].exitcode for r in dead}
                    raise RankError(f"rank(s) {dead} died without a result (exit codes {codes})") from None
                continue
            if not ok:
                raise RankError(f"rank {rank} of {world_size} failed:\n{value}")
            values[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=5 if len(values) == world_size else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        results.close()
    return [values[r] for r in range(world_size)]
