"""Starting processes: the one launcher behind the trainer, the benchmarks, the tests and the jobs.

Two ways to start ranks, one environment and timeout policy:

- :func:`spawn` runs ``fn(rank, world_size, *args)`` on N fresh local processes and returns every rank's
  value (tests, ``fastpar bench --nproc``, quick experiments). The first rank that raises ends the run with
  its traceback; a rank that never finishes is named — never a silent hang.
- :func:`launch_agent` runs torch's elastic agent, the machinery behind ``torchrun``: N workers on this
  machine, or this machine's share of a multi-node job meeting the other agents at a c10d rendezvous
  (the Trainer, and ``fastpar.batch`` once per node). ``max_restarts`` restarts the workers after a crash.

Every rank joins its process group through :func:`join_process_group`. Local groups stay on loopback: their
stores listen on 127.0.0.1 only (:func:`loopback_store`), since whoever reaches a store can read what it holds
and, through the rendezvous state torch unpickles, run code in the agent. A multi-node rendezvous has to listen
on the network; :func:`launch_agent` says where in one line, and the network between the nodes must be trusted.
"""

from __future__ import annotations

import datetime
import gc
import logging
import multiprocessing as mp
import os
import pickle
import queue
import secrets
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from .host import under_torchrun
from .rendezvous import (
    BOUND_RDZV_BACKEND,
    LOOPBACK,
    RDZV_ROUND_ENV,
    address_towards,
    bound_store,
    interface_of,
    is_loopback,
    listen_address,
    register_bound_rendezvous,
    restart_round,
)

BOUND_STORES_ENV = "FASTPAR_BOUND_STORES"
COLLECTIVE_TIMEOUT_S = 600.0  # a collective waiting longer than this fails instead of hanging
SPAWN_COLLECTIVE_TIMEOUT_S = 120.0  # tests and benchmarks: fail sooner


class RankError(RuntimeError):
    """A spawned rank failed or did not finish; the message names the rank and carries its traceback."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def loopback_store(timeout_s: float = 60.0, port: int = 0) -> dist.TCPStore:
    """A TCPStore server listening on 127.0.0.1 only, at ``port`` (0: a free one; read ``.port``).

    torch's TCPStore binds every interface; bound here and handed over as ``master_listen_fd`` it serves
    loopback alone. Raises OSError when ``port`` is taken.
    """
    return bound_store(LOOPBACK, timeout_s, port)


def loopback_env(port: int, rank: int | None = None, world_size: int | None = None) -> dict[str, str]:
    """Environment variables that pin a local process group to the loopback interface."""
    env = {"MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo"}
    if rank is not None:
        env.update(RANK=str(rank), LOCAL_RANK=str(rank))
    if world_size is not None:
        env.update(WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    return env


def launched_by_torchrun() -> bool:
    """True in a worker started by torchrun / the elastic agent (its rank comes from the environment)."""
    return under_torchrun()


def set_threads(threads: int | None) -> None:
    """Torch threads of this process (None: leave torch's default)."""
    if threads:
        torch.set_num_threads(threads)


def join_process_group(
    backend: str,
    *,
    rank: int,
    world_size: int,
    timeout_s: float = COLLECTIVE_TIMEOUT_S,
    store_port: int | None = None,
    device: torch.device | None = None,
) -> None:
    """Create the default process group as ``rank`` of ``world_size``.

    ``store_port``: the port of the :func:`loopback_store` of ranks this launcher spawned; None reads torchrun's
    environment. ``device``: a CUDA device binds the NCCL communicator to it at once.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    device_id = device if device is not None and device.type == "cuda" else None
    if store_port is not None:
        store = dist.TCPStore(LOOPBACK, store_port, None, is_master=False, timeout=timeout)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout, device_id=device_id
        )
        return
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, device_id=device_id)
        return
    # The elastic agent keeps one TCPStore for all restart rounds and workers connect without a prefix, so
    # a restarted group could read the dead workers' addresses (gloo: "connectFullMesh failed ...
    # Connection refused"). A per-round prefix keeps every round's keys apart.
    attempt = restart_round()  # the same on every node (a restart of one node restarts them all)
    agent_store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False, timeout=timeout
    )
    store = dist.PrefixStore(f"fastpar/attempt_{attempt}", agent_store)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timeout, device_id=device_id
    )


# --- spawn: N processes, every rank's value back ----------------------------------------------------
def leave_process_group() -> None:
    """Destroy the default group and free it now. A group that outlives ``destroy_process_group`` through
    reference cycles keeps gloo's threads alive until interpreter shutdown, where tearing them down aborts the
    process now and then ("terminate called without an active exception", SIGABRT after training succeeded)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def _spawned_rank(rank, world_size, port, backend, threads, pg_timeout, fn, args, results):
    os.environ.update(loopback_env(port, rank, world_size))
    set_threads(threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        if backend is not None:
            join_process_group(backend, rank=rank, world_size=world_size, timeout_s=pg_timeout, store_port=port)
        # plain pickle bytes: torch's queue reductions would share tensors through file descriptors that
        # die with this process before the parent reads them
        value = pickle.dumps(fn(rank, world_size, *args))
        results.put((rank, True, value))
    except BaseException:  # report everything, KeyboardInterrupt included, to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if backend is not None:
            leave_process_group()


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = "gloo",
    threads: int | None = 1,
    timeout: float = 300.0,
    pg_timeout: float = SPAWN_COLLECTIVE_TIMEOUT_S,
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
    # this process serves the ranks' store, on loopback; the ranks are its clients
    store = loopback_store(pg_timeout) if backend is not None else None
    port = store.port if store is not None else free_port()
    procs = [
        ctx.Process(
            target=_spawned_rank, args=(rank, world_size, port, backend, threads, pg_timeout, fn, args, results)
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
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
        del store  # the ranks are gone: stop serving
    return [values[r] for r in range(world_size)]


# --- launch_agent: torchrun's elastic agent ---------------------------------------------------------
@record  # a failing worker's traceback reaches the agent's error instead of "error_file: <N/A>"
def _agent_worker(fn: Callable[..., Any], args: Sequence[Any]) -> Any:
    try:
        return fn(*args)
    except KeyboardInterrupt:  # Ctrl-C reaches every process of the terminal's group: one message, from the agent
        raise SystemExit(130) from None


def network_notice(endpoint: str, also: str = "the workers' store", bound: bool = True) -> str:
    """The line a multi-node run prints: where its stores listen, and that the network must be trusted.
    ``bound``: the stores are fastpar's, bound to one address (torchrun's own listen on every interface)."""
    host, port = endpoint.rsplit(":", 1)
    try:
        address = listen_address(host) if bound else "0.0.0.0"
    except ConnectionError:  # a name that does not resolve here; the agent then fails naming it
        address = host
    where = "every interface of the host" if address in ("0.0.0.0", "::") else f"{address} only"
    return (
        f"fastpar: this job's store listens on {host}:{port} ({where}, and {also} on a second port of rank 0's "
        f"node); the network between the nodes must be trusted: whoever reaches these ports can read the "
        f"job's keys and run code in its processes"
    )


def launch_agent(
    entrypoint: Callable[..., Any] | str,
    args: Sequence[Any] = (),
    *,
    nproc_per_node: int,
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
    run_id: str | None = None,
    max_restarts: int = 0,
    local_addr: str | None = None,
) -> dict[int, Any]:
    """Run torch's elastic agent here with ``nproc_per_node`` workers; return the workers' values by global rank.

    ``entrypoint``: a picklable function called as ``entrypoint(*args)`` in each worker, or a program
    (``sys.executable``) started with ``args`` as its command line (its values are None).
    ``nnodes == 1`` without an endpoint: a c10d rendezvous on 127.0.0.1 at a free port. ``nnodes > 1``: this
    agent is one of ``nnodes`` meeting at ``rdzv_endpoint`` (``HOST:PORT``) under the shared ``run_id``;
    global ranks are assigned by the rendezvous. Ctrl-C stops the workers and raises KeyboardInterrupt.
    Every store listens on one address (fastpar.rendezvous): an endpoint on 127.0.0.1 keeps them on loopback;
    any other endpoint listens on the network and says so on stderr (the network between the nodes must be
    trusted). ``local_addr``: the address this node advertises to the others (default: the one its routes use
    to reach the endpoint); gloo's interface follows it unless ``GLOO_SOCKET_IFNAME`` is set. A node that
    cannot reach the endpoint fails in seconds naming the address.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nproc_per_node < 1 or nnodes < 1:
        raise ValueError(f"need nproc_per_node >= 1 and nnodes >= 1, got {nproc_per_node} and {nnodes}")
    if nnodes > 1 and not (rdzv_endpoint and run_id):
        raise ValueError("a multi-node launch needs rdzv_endpoint='HOST:PORT' and a run_id shared by every node")
    endpoint = rdzv_endpoint or f"{LOOPBACK}:{free_port()}"
    host = endpoint.rsplit(":", 1)[0]
    if not is_loopback(host) or listen_address(host) not in (LOOPBACK, "::1"):
        print(network_notice(endpoint), file=sys.stderr, flush=True)
    local_addr = local_addr or (LOOPBACK if is_loopback(host) else address_towards(host))
    register_bound_rendezvous()
    # inherited by the workers: gloo on the advertised address's interface; the Trainer knows the agent has said
    # where the stores listen
    interface = os.environ.get("GLOO_SOCKET_IFNAME") or interface_of(local_addr)
    worker_env = {BOUND_STORES_ENV: "1", **({"GLOO_SOCKET_IFNAME": interface} if interface else {})}
    config = LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nproc_per_node,
        run_id=run_id or f"fastpar-{secrets.token_hex(16)}",
        rdzv_backend=BOUND_RDZV_BACKEND,
        rdzv_endpoint=endpoint,
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        local_addr=local_addr,
    )
    if callable(entrypoint):
        target, call_args = _agent_worker, (entrypoint, tuple(args))
    else:
        target, call_args = entrypoint, tuple(str(a) for a in args)
    # The agent logs every rendezvous at INFO/WARNING; our own progress output is what users read.
    quiet = logging.getLogger("torch.distributed.elastic")
    previous = quiet.level
    quiet.setLevel(logging.ERROR)
    saved = {name: os.environ.get(name) for name in (*worker_env, RDZV_ROUND_ENV)}
    os.environ.update(worker_env)
    try:
        return elastic_launch(config, target)(*call_args)
    except SignalException as exc:  # the agent has stopped the workers; report Ctrl-C as Python does
        if exc.sigval == signal.SIGINT:
            raise KeyboardInterrupt("interrupted; the worker processes were stopped") from None
        raise
    finally:
        quiet.setLevel(previous)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
