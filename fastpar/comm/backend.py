"""The "fastpar" torch.distributed backend: creation, rendezvous of the shared-memory segments, and status.

``torch.distributed`` calls :func:`_create_backend` for every group that uses the backend. It builds a gloo
backend (for everything the shared-memory path does not do) and fastpar's C++ ``ShmBackend`` around it, then the
ranks agree through the group's store where they are. torch hands a group re-created after
``destroy_process_group()`` the same store prefix, with the last instance's keys still in it, so every key lives
under the instance's generation: each rank counts itself in on one store counter, and since a rank leaves the
rendezvous only after all ranks counted themselves in, instance g is counts g * size + 1 .. (g + 1) * size on every
rank.

1. every rank publishes a host key (hostname, boot id, user, the /dev/shm mount) and reads everyone's: ranks with
   the same key are one node; nodes are numbered by their lowest rank, the node's leader;
2. rank 0 decides whether the group can use shared memory (:func:`_why_not`) and publishes the decision;
3. each node's leader removes segments crashed jobs left, creates its node's segment (0600, pages reserved, one
   slot per rank of the node) and publishes its name and a random token; on a group of several nodes the leaders
   also build a gloo backend among themselves (rank = node number);
4. every rank maps its node's segment and checks the token (same memory, not just the same name), and reports;
5. each leader unlinks its name once all reported, or as soon as the rendezvous fails (a rank died in it): no name
   is left in /dev/shm. If any rank could not attach, every rank falls back to gloo (the same decision everywhere,
   from the same reports), and the reason is kept: :func:`shm_status`.

On one node the collectives run in shared memory with gloo's summation order. Across nodes (several ranks on at
least one node) all-reduce, reduce-scatter, all-gather, broadcast and barrier run hierarchically (csrc/shm/nodes.cpp):
within each node in shared memory, among the node leaders on gloo, then within each node again, so each node sends
its data across the network once rather than once per rank. An all-reduce then sums each node's ranks first (by
ascending rank), then the nodes' sums in gloo's order among the leaders; every rank gets the same bits, but not
gloo's bits over the whole group.
"""

from __future__ import annotations

import collections
import datetime
import json
import logging
import os
import secrets
import socket
import warnings

import torch

from ..ops import loader
from . import threads
from .segments import SHM_DIR, create_segment, sweep_stale_segments

BACKEND_NAME = "fastpar"
MAX_RANKS = 64  # csrc/shm/segment.h kMaxRanks
MAX_BUFFERS = 62  # csrc/shm/segment.h kMaxBuffers
_KEY = "fastpar_shm/"
_log = logging.getLogger("fastpar.comm")


def staging() -> tuple[int, int]:
    """(bytes a rank stages per step, steps it may stage ahead): FASTPAR_SHM_SLOT_KB (default 256) and
    FASTPAR_SHM_BUFFERS (default 4). A step's chunk should stay in cache between the rank that writes it and the
    ranks that read it; the buffers let a rank run ahead while the others are not scheduled."""
    kib = int(os.environ.get("FASTPAR_SHM_SLOT_KB", "256"))
    buffers = int(os.environ.get("FASTPAR_SHM_BUFFERS", "4"))
    if kib < 4 or kib % 4:
        raise ValueError(f"FASTPAR_SHM_SLOT_KB must be a multiple of 4 and at least 4, got {kib}")
    if not 2 <= buffers <= MAX_BUFFERS:
        raise ValueError(f"FASTPAR_SHM_BUFFERS must be 2..{MAX_BUFFERS}, got {buffers}")
    return kib * 1024, buffers


def is_available() -> bool:
    """Whether this installation can run the shared-memory path (Linux, /dev/shm, the compiled extension)."""
    ext = loader.extension()
    return ext is not None and hasattr(ext, "ShmBackend") and SHM_DIR.is_dir()


def cpu_backend(choice: str = "auto") -> str:
    """The process-group backend of CPU ranks on one machine: ``auto`` picks fastpar's shared-memory backend
    ("fastpar", several times faster than gloo) when :func:`is_available`, else gloo; other choices pass through."""
    if choice != "auto":
        return choice
    return BACKEND_NAME if is_available() else "gloo"


def register() -> None:
    """Make ``"fastpar"`` a backend name of torch.distributed (``init_process_group("fastpar")``,
    ``"cpu:fastpar,cuda:nccl"``). Cheap and idempotent: ``import fastpar`` calls it."""
    import torch.distributed as dist

    if not dist.is_available() or BACKEND_NAME.upper() in getattr(dist.Backend, "_plugins", {}):
        return
    # cpu and cuda, like gloo: a drop-in for it (CUDA tensors go to the gloo backend inside).
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"])


def _host_key() -> str:
    """Equal on two ranks exactly when they can share a POSIX shared-memory segment (same machine, same
    /dev/shm mount, same user); the token check after mapping makes sure of it."""
    try:
        boot_id = open("/proc/sys/kernel/random/boot_id").read().strip()
        shm_dev = os.stat(SHM_DIR).st_dev
    except OSError:
        return f"no-shm:{socket.gethostname()}:{os.getpid()}"
    return f"{socket.gethostname()}|{boot_id}|{shm_dev}|{os.geteuid()}"


def _why_not(host_keys: list[str]) -> str:
    """'' when the ranks can use shared memory (on one node, or hierarchically across nodes); else why not."""
    if os.environ.get("FASTPAR_SHM", "1") == "0":
        return "disabled by FASTPAR_SHM=0"
    if not is_available():
        return "the compiled extension or /dev/shm is not available"
    if any(key.startswith("no-shm:") for key in host_keys):
        return "no /dev/shm on this machine"
    per_node = collections.Counter(host_keys)
    most = max(per_node.values())
    if most > MAX_RANKS:
        return f"{most} ranks on one host is above the {MAX_RANKS} the shared-memory path serves"
    if len(per_node) > 1 and most == 1:
        return f"each of the {len(per_node)} ranks is on a host of its own, so collectives go through gloo"
    return ""


def _node_layout(host_keys: list[str]) -> list[int]:
    """Every rank's node: ranks with one host key share a node, numbered by their lowest rank."""
    numbers: dict[str, int] = {}
    return [numbers.setdefault(key, len(numbers)) for key in host_keys]


def _generation(store, size: int) -> int:
    """Which instance of the group on this store this is (module docstring): the same number on every rank."""
    return (store.add(f"{_KEY}instances", 1) - 1) // size


def _gather(store, key: str, ranks: range, me: int, what: str) -> list[str]:
    """The value of ``key``/r of every rank r in ``ranks``; one that never wrote it (it died, or hangs) is named in
    the error."""
    try:
        return [store.get(f"{key}/{r}").decode() for r in ranks]
    except Exception as exc:  # the store's timeout: DistStoreError, or RuntimeError from older torch
        missing = [r for r in ranks if not store.check([f"{key}/{r}"])]
        raise RuntimeError(
            f"fastpar backend, rank {me}: rank(s) {missing} did not {what} in init_process_group within the "
            f"store's timeout (did they die or stop?). Restart all ranks together. ({exc})"
        ) from exc


def _rendezvous(backend, ext, store, key: str, rank: int, size: int, group: str, timeout) -> tuple[str, int]:
    """Steps 1-5 of the module docstring, under this instance's ``key``. Returns ('' when every rank attached, else
    the shared reason; how many ranks share this rank's node)."""
    import torch.distributed as dist

    store.set(f"{key}host/{rank}", _host_key())
    hosts = _gather(store, f"{key}host", range(size), rank, "publish its host")
    node_of = _node_layout(hosts)
    node, nodes, local = node_of[rank], max(node_of) + 1, node_of.count(node_of[rank])
    leader = node_of.index(node)
    if rank == 0:  # one decision, from rank 0's environment
        store.set(f"{key}decision/0", _why_not(hosts))
    reason = _gather(store, f"{key}decision", range(1), rank, "decide whether to use shared memory")[0]
    plan = {"name": "", "token": 0, "reason": reason}
    try:
        if rank == leader:
            if not reason:
                sweep_stale_segments()
                token = secrets.randbits(63)
                try:
                    name = create_segment(lambda name: ext.shm_create(name, local, *staging(), token), group)
                    plan["name"], plan["token"] = name, token
                except RuntimeError as exc:
                    plan["reason"] = f"node {node}: cannot create the shared-memory segment: {exc}"
            store.set(f"{key}plan/{leader}", json.dumps(plan))
        else:
            plan = json.loads(
                _gather(store, f"{key}plan", range(leader, leader + 1), rank, "create the shared memory")[0]
            )
        outcome = plan["reason"]
        if not outcome and nodes == 1:
            outcome = backend.attach(plan["name"], plan["token"])
        elif not outcome:
            leaders = None
            if rank == leader:  # the leaders' own gloo group: only they take part in its rendezvous
                leaders = dist.ProcessGroupGloo(dist.PrefixStore(f"{key}leaders/", store), node, nodes, timeout)
            outcome = backend.attach_nodes(plan["name"], plan["token"], node_of, leaders)
        store.set(f"{key}attached/{rank}", outcome)
        outcomes = _gather(store, f"{key}attached", range(size), rank, "report whether it mapped the shared memory")
    finally:
        if rank == leader and plan["name"]:
            ext.shm_unlink(plan["name"])  # its node mapped it, gave up, or died: no name left to leak
    failed = [text for text in outcomes if text]
    if len(failed) == size and len(set(failed)) == 1:  # rank 0's decision, or one cause everywhere
        reason = failed[0]
    else:
        reason = "; ".join(f"rank {r}: {text}" for r, text in enumerate(outcomes) if text)
    if reason:
        backend.detach(reason)  # the same decision on every rank, from the same reports
    return reason, local


def _create_backend(opts, backend_options=None):
    """The backend factory torch.distributed calls (``extended_api=True``): see the module docstring."""
    import torch.distributed as dist

    store, rank, size, timeout = opts.store, opts.group_rank, opts.group_size, opts.timeout
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    generation = _generation(store, size)
    gloo = dist.ProcessGroupGloo(dist.PrefixStore(f"gloo/{generation}/", store), rank, size, timeout)
    ext = loader.extension()
    if ext is None or not hasattr(ext, "ShmBackend"):
        warnings.warn(
            "fastpar backend: the compiled extension is not available "
            f"({loader.ext_status()['reason']}); this group runs on gloo",
            RuntimeWarning,
            stacklevel=2,
        )
        return gloo
    backend = ext.ShmBackend(rank, size, gloo, timeout)
    reason, local = _rendezvous(backend, ext, store, f"{_KEY}{generation}/", rank, size, str(opts.group_id), timeout)
    if not reason and hasattr(backend, "set_thread_policy"):  # the node's ranks share its cores
        policy = threads.choose(local_ranks=local)
        backend.set_thread_policy(policy.spin_us, policy.summation_threads)
    if reason and rank == 0:
        expected = "host of its own" in reason or "FASTPAR_SHM=0" in reason
        (_log.info if expected else _log.warning)(
            "fastpar backend, group %s: gloo for all collectives: %s", opts.group_id, reason
        )
    return backend


def _shm_backend(group):
    """The CPU backend of ``group`` (default: the default group) when it is fastpar's on shared memory, else None."""
    import torch.distributed as dist

    ext = loader.extension()
    if ext is None or not hasattr(ext, "shm_all_reduce_lists"):
        return None
    try:
        backend = (group or dist.group.WORLD)._get_backend(torch.device("cpu"))
    except RuntimeError:
        return None
    state = ext.shm_backend_state(backend)
    return backend if state is not None and state[0] else None


def reduces_lists(group=None) -> bool:
    """Whether :func:`all_reduce_lists` can run on ``group``: fastpar's backend on shared memory."""
    return _shm_backend(group) is not None


def all_reduce_lists(lists, group=None) -> None:
    """All-reduce (SUM) every list of CPU tensors in place: one collective per list, each staging its tensors and
    summing into them where they lie (the bits of an all-reduce of the list's concatenation, gloo's
    ``all_reduce_coalesced``), all in flight before the first wait; returns when all are done. Each list holds one
    float dtype. Needs :func:`reduces_lists`."""
    loader.extension().shm_all_reduce_lists(_required_shm_backend(group, "all_reduce_lists"), lists)


def all_reduce_runs(tensors, group=None) -> None:
    """All-reduce (SUM) CPU tensors (float32/float16/bfloat16) in place: one list collective per run of one dtype,
    split in C++ (no per-tensor Python work). Needs :func:`reduces_lists`."""
    loader.extension().shm_all_reduce_runs(_required_shm_backend(group, "all_reduce_runs"), tensors)


def _required_shm_backend(group, caller: str):
    backend = _shm_backend(group)
    if backend is None:
        raise RuntimeError(
            f"{caller} needs a process group on fastpar's shared-memory backend "
            "(init_process_group('fastpar') with every rank on this host); use torch.distributed.all_reduce_coalesced"
        )
    return backend


def thread_policy(group=None) -> dict | None:
    """The wait and thread policy of the "fastpar" backend of ``group`` (default: the default group), as
    :mod:`fastpar.comm.threads` chose it: ``{"spin_us": int, "summation_threads": int}``; None when the group
    does not run on shared memory."""
    import torch.distributed as dist

    group = group or dist.group.WORLD
    try:
        backend = group._get_backend(torch.device("cpu"))
    except RuntimeError:
        return None
    ext = loader.extension()
    policy = ext.shm_thread_policy(backend) if ext is not None and hasattr(ext, "shm_thread_policy") else None
    if policy is None:
        return None
    spin_us, summation_threads = policy
    return {"spin_us": spin_us, "summation_threads": summation_threads}


def shm_status(group=None) -> dict:
    """How the "fastpar" backend of ``group`` (default: the default group) moves CPU tensors:
    ``{"backend": name, "shm": bool, "reason": why not shared memory ('' when it is), "nodes": n}``; ``nodes`` is
    the number of nodes the group spans when its collectives run hierarchically (shared memory within each node,
    gloo between), 1 on one node's shared memory, 0 when everything goes to gloo."""
    import torch.distributed as dist

    group = group or dist.group.WORLD
    name = dist.get_backend(group)
    try:
        backend = group._get_backend(torch.device("cpu"))
    except RuntimeError as exc:
        return {"backend": name, "shm": False, "reason": str(exc), "nodes": 0}
    ext = loader.extension()
    state = ext.shm_backend_state(backend) if ext is not None and hasattr(ext, "shm_backend_state") else None
    if state is None:
        return {
            "backend": name,
            "shm": False,
            "reason": f"{type(backend).__name__} is not fastpar's backend",
            "nodes": 0,
        }
    one_host, reason, nodes = state
    return {"backend": name, "shm": bool(one_host or nodes), "reason": reason, "nodes": nodes or int(bool(one_host))}


# Last, once every name above exists: ``import fastpar.comm`` before torch imports torch from this module, and
# the hook ``import fastpar`` set on torch's import leaves the registration to this line.
register()
