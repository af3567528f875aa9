"""Slots: the disjoint shares of this machine that a local sweep runs its trials on, one trial per slot.

With GPUs a slot is one GPU (or a group, chosen with ``fastpar.topology`` for the fastest links) plus a
share of the CPU cores nearest to it. Without GPUs a slot is a set of cores. A trial entering its slot
pins itself (and so every process it starts) to the slot's cores, sets torch's and OpenMP's thread counts
to their number and sees only the slot's GPUs.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ..host import usable_cpus

_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


@dataclasses.dataclass(frozen=True)
class Slot:
    index: int
    cpus: tuple[int, ...]
    gpus: tuple[int, ...] = ()

    def describe(self) -> str:
        cpus = f"cpu {_cpu_text(self.cpus)}"
        return f"gpu {','.join(map(str, self.gpus))} + {cpus}" if self.gpus else cpus

    def enter(self) -> None:
        """Confine this process (and what it starts from now on) to the slot. Call before CUDA is touched."""
        import torch

        if self.gpus:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.gpus))
        if self.cpus and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, self.cpus)
        threads = max(1, len(self.cpus))
        for name in _THREAD_VARS:
            os.environ[name] = str(threads)
        torch.set_num_threads(threads)


def _cpu_text(cpus: tuple[int, ...]) -> str:
    from ..topology.model import format_cpu_list

    return format_cpu_list(list(cpus))


def _split(cpus: list[int], parts: int) -> list[tuple[int, ...]]:
    """``cpus`` cut into ``parts`` disjoint runs of equal length (the remainder unused); empty when too few."""
    share = len(cpus) // parts if parts else 0
    return [tuple(cpus[i * share : (i + 1) * share]) for i in range(parts)] if share else [() for _ in range(parts)]


def _gpu_groups(topology: Any, per_slot: int) -> list[tuple[int, ...]]:
    """Disjoint groups of ``per_slot`` free GPUs; each group is the best-connected set left."""
    from ..topology import select_devices
    from ..topology.select import busy_reason

    if per_slot == 1:
        return [(g.index,) for g in sorted(topology.gpus, key=lambda g: g.index) if not busy_reason(g)]
    topology = dataclasses.replace(topology, gpus=[dataclasses.replace(g) for g in topology.gpus])
    groups = []
    while True:
        try:
            chosen = select_devices(per_slot, topology)
        except ValueError:
            return groups
        groups.append(tuple(chosen))
        for gpu in topology.gpus:
            if gpu.index in chosen:
                gpu.processes = 1  # taken: select_devices skips it from now on


def local_topology() -> Any:
    """This machine's topology (NVML + /sys); GPUs that torch sees but NVML can't describe are listed bare."""
    from ..topology import discover
    from ..topology.model import GPU
    from ..train.environment import gpu_count

    topology = discover()
    if not topology.gpus:
        topology.gpus = [GPU(index=i) for i in range(gpu_count())]
    return topology


def plan_slots(
    cpus_per_trial: int | None = None,
    gpus_per_trial: int | None = None,
    *,
    max_parallel: int | None = None,
    topology: Any = None,
) -> list[Slot]:
    """The slots of this machine: ``gpus_per_trial`` GPUs each (default 1 when there are GPUs, else 0),
    ``cpus_per_trial`` cores each (default: the cores split evenly among the GPU slots, or 1 without GPUs).
    Raises ValueError when a slot asks for more than the machine has."""
    for name, value, minimum in (
        ("cpus_per_trial", cpus_per_trial, 1),
        ("gpus_per_trial", gpus_per_trial, 0),
        ("max_parallel", max_parallel, 1),
    ):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < minimum):
            raise ValueError(f"{name} must be a whole number >= {minimum}, got {value!r}")
    topology = topology if topology is not None else local_topology()
    cpus = usable_cpus()
    gpus_per_trial = (1 if topology.gpus else 0) if gpus_per_trial is None else gpus_per_trial
    if cpus_per_trial is not None and cpus_per_trial > len(cpus):
        raise ValueError(
            f"cpus_per_trial={cpus_per_trial}, but this process may use {len(cpus)} CPU(s) "
            f"({_cpu_text(tuple(cpus))}); ask for at most {len(cpus)}"
        )
    if gpus_per_trial > len(topology.gpus):
        why = f" ({topology.gpu_status})" if topology.gpu_status else ""
        raise ValueError(
            f"gpus_per_trial={gpus_per_trial}, but this machine has {len(topology.gpus)} GPU(s){why}; ask for at "
            f"most {len(topology.gpus)}, or gpus_per_trial=0 to run the trials on CPU cores"
        )
    if gpus_per_trial == 0:
        slots = [Slot(i, c) for i, c in enumerate(_split(cpus, len(cpus) // (cpus_per_trial or 1)))]
    else:
        groups = _gpu_groups(topology, gpus_per_trial)
        if not groups:
            raise ValueError(f"no {gpus_per_trial} free GPU(s) for a trial: all are busy (see 'fastpar topo')")
        slots = _gpu_slots(groups, topology, cpus, cpus_per_trial)
    return slots[:max_parallel] if max_parallel else slots


def _gpu_slots(groups: list[tuple[int, ...]], topology: Any, cpus: list[int], per_slot: int | None) -> list[Slot]:
    """GPU slots with the cores nearest their GPUs, shared out evenly among the slots that are near the same cores."""
    usable = set(cpus)
    near: dict[tuple[int, ...], list[int]] = {}  # nearest cores -> the slots (indices into groups) near them
    for index, group in enumerate(groups):
        affinity = set(topology.gpu(group[0]).cpu_affinity) & usable
        near.setdefault(tuple(sorted(affinity or usable)), []).append(index)
    cores: dict[int, tuple[int, ...]] = {}
    for shared, members in near.items():
        shares = _split(list(shared), len(members))
        for index, share in zip(members, shares, strict=True):
            cores[index] = share[:per_slot] if per_slot else share
    return [Slot(i, cores[i], group) for i, group in enumerate(groups)]
