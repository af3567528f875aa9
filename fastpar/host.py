"""What this process may use and how it was started: the usable CPUs and whether torchrun started it.

The one place these are probed (the trainer, the data loader, the job slots and the benchmarks read them here).
Imports nothing heavy.
"""

from __future__ import annotations

import os

# What torchrun (torch.distributed.run / the elastic agent) sets in every worker it starts.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def usable_cpus() -> list[int]:
    """The CPUs this process may run on: its affinity mask (a sweep trial pinned to one core sees one), not the
    machine's count."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def usable_cpu_count() -> int:
    return len(usable_cpus())


def under_torchrun() -> bool:
    """True in a worker started by torchrun or the elastic agent: its rank comes from the environment."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
