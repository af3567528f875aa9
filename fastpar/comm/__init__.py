"""``fastpar.comm``: fastpar's torch.distributed backend ``"fastpar"``.

All-reduce, reduce-scatter, all-gather, broadcast and barrier between ranks on one host run through POSIX
shared memory with fastpar's C++ reduction kernels, with sums bit-identical to gloo's; on a group that spans hosts
they run hierarchically (shared memory within each host, gloo among one leader per host, so each host sends its
data once); everything else runs on gloo. ``import fastpar`` registers the name::

    import fastpar, torch.distributed as dist
    dist.init_process_group("fastpar")            # or "cpu:fastpar,cuda:nccl"
    fastpar.comm.shm_status()                     # {'backend': 'fastpar', 'shm': True, 'reason': '', 'nodes': 1}
"""

from .backend import (
    BACKEND_NAME,
    all_reduce_lists,
    all_reduce_runs,
    cpu_backend,
    is_available,
    reduces_lists,
    register,
    shm_status,
    staging,
    thread_policy,
)
from .segments import list_segments, sweep_stale_segments

__all__ = [
    "BACKEND_NAME",
    "all_reduce_lists",
    "all_reduce_runs",
    "cpu_backend",
    "is_available",
    "list_segments",
    "reduces_lists",
    "register",
    "shm_status",
    "staging",
    "sweep_stale_segments",
    "thread_policy",
]
