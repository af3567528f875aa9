"""Multi-rank calls for in-process timers (the pytest-benchmark entry points in ``bench/``).

pytest-benchmark times a function in its own process. :func:`peer_group` makes that process rank 0 of
a local gloo group and starts the other ranks, which repeat the same call a fixed number of times, so
the timed call is a real multi-rank collective. The call is built on every rank by a factory named
``"module:function"`` and called as ``factory(rank, world_size, *args) -> call``; the factories below
build it from the same code as ``fastpar bench``.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import multiprocessing as mp
import os
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from ..launcher import LOOPBACK, loopback_env, loopback_store

_TIMEOUT = datetime.timedelta(seconds=120)


def _resolve(factory: str) -> Callable[..., Callable[[], object]]:
    module, name = factory.split(":")
    return getattr(importlib.import_module(module), name)


def _init(rank: int, world_size: int, port: int, store: dist.Store | None = None) -> None:
    """Join the group on rank 0's loopback store (``store`` on rank 0, a client of it on the peers)."""
    os.environ.update(loopback_env(port, rank, world_size))
    if store is None:
        store = dist.TCPStore(LOOPBACK, port, None, is_master=False, timeout=_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=_TIMEOUT)


def _peer(rank: int, world_size: int, port: int, factory: str, args: tuple, calls: int) -> None:
    torch.set_num_threads(1)
    _init(rank, world_size, port)
    try:
        call = _resolve(factory)(rank, world_size, *args)
        for _ in range(calls):
            call()
        dist.barrier()
    finally:
        dist.destroy_process_group()


class CountedCall:
    """Rank 0's call; counts itself so the group can be padded to the peers' fixed number of calls."""

    def __init__(self, call: Callable[[], object]) -> None:
        self.call, self.count = call, 0

    def __call__(self) -> None:
        self.count += 1
        self.call()


@contextlib.contextmanager
def peer_group(factory: str, args: tuple, calls: int, world_size: int = 2) -> Iterator[CountedCall]:
    """Yield rank 0's call in a ``world_size`` gloo group whose other ranks make ``calls`` calls.
    Call it at most ``calls`` times; any calls left are made on exit so no rank waits forever."""
    if dist.is_initialized():
        raise RuntimeError("peer_group needs a process without a process group")
    store = loopback_store(_TIMEOUT.total_seconds())  # served here, on loopback only; the peers are its clients
    port = store.port
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_peer, args=(rank, world_size, port, factory, args, calls), daemon=True)
        for rank in range(1, world_size)
    ]
    for p in procs:
        p.start()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    _init(0, world_size, port, store)
    try:
        counted = CountedCall(_resolve(factory)(0, world_size, *args))
        yield counted
        while counted.count < calls:  # e.g. pytest --benchmark-disable calls the target only once
            counted()
        dist.barrier()
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(5)
