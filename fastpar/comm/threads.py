"""The thread model of the "fastpar" backend on CPU: how its waits spin and how many threads a reduction uses,
chosen from the cores this process may use and the ranks that share them.

Per rank there are: the compute thread (forward, backward, the optimizer; torch's intra-op threads when
``torch.set_num_threads`` > 1), the backend's worker (``fastpar-shm``: runs the queued collectives in order,
stages chunks into shared memory and sums them), a callback helper (``fastpar-shm-cb``, only while a future's
callback runs on the worker) and gloo's threads (idle unless a collective falls back to gloo). A caller that
waits on a collective runs it on its own thread instead of waiting for the worker.

With as many ranks as cores every core already has a compute thread, so

- a wait that spins takes the core from its own rank's compute thread (or from the peer it waits for): it sleeps
  at once instead (``spin_us = 0``); with a core free per rank beyond its compute thread it spins up to 50 us,
  since the peer usually arrives within microseconds;
- a reduction split over intra-op threads wakes threads that only take other ranks' cores: it runs inline on the
  thread that runs the collective (``summation_threads = cores // ranks``, at least 1).

``FASTPAR_SHM_SPIN_US`` and ``FASTPAR_SHM_THREADS`` override the choice.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..host import usable_cpu_count

SPIN_US_WITH_SPARE_CORES = 50


@dataclass(frozen=True)
class ThreadPolicy:
    spin_us: int  # the longest a wait spins before it sleeps on a futex
    summation_threads: int  # the most threads one reduction or staging copy splits over
    why: str


def _env_int(name: str) -> int | None:
    text = os.environ.get(name)
    if text is None or text == "":
        return None
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name} must be a whole number, got {text!r}") from None
    if value < 0:
        raise ValueError(f"{name} must be 0 or more, got {value}")
    return value


def choose(local_ranks: int, cores: int | None = None) -> ThreadPolicy:
    """The policy for a group of ``local_ranks`` ranks on this host sharing ``cores`` (default: the CPUs this
    process may use)."""
    cores = usable_cpu_count() if cores is None else cores
    ranks = max(1, local_ranks)
    spare = cores >= 2 * ranks  # room for every rank's worker beside its compute thread
    spin = _env_int("FASTPAR_SHM_SPIN_US")
    threads = _env_int("FASTPAR_SHM_THREADS")
    why = f"{ranks} ranks on {cores} cores"
    if spin is None:
        spin = SPIN_US_WITH_SPARE_CORES if spare else 0
    if threads is None:
        threads = max(1, cores // ranks)
    return ThreadPolicy(spin_us=spin, summation_threads=threads, why=why)
