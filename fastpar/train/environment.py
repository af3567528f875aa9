"""Resolve ``execution_environment`` into a plan: how many processes, on which devices, which backend.

Everything here runs in the launching process before any worker starts, so an environment that can't
be had is a clear error at once, not a crash in a worker. GPUs are counted through NVML
(``PYTORCH_NVML_BASED_CUDA_CHECK``) so the launcher never initialises CUDA itself.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch

from ..comm import cpu_backend
from ..host import TORCHRUN_VARS, under_torchrun, usable_cpu_count
from ..launcher import BOUND_STORES_ENV, network_notice
from ..user_errors import UserError

_MAX_DEFAULT_CPU_PROCESSES = 4


class ExecutionEnvironmentError(UserError, RuntimeError):
    """The requested execution environment can't be had on this machine; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class Plan:
    kind: str  # cpu | gpu | multi-gpu | cluster
    nprocs: int  # processes this launcher starts on this machine (0: already running under torchrun)
    backend: str | None  # process-group backend; None for a single process
    device_type: str  # cpu | cuda
    device_ids: tuple[int, ...] = ()  # CUDA device (ordinal in this process, not NVML index) of each local rank
    threads_per_process: int = 1

    @property
    def under_torchrun(self) -> bool:
        return self.nprocs == 0


def gpu_count() -> int:
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_cpu_processes() -> int:
    """A sensible share of the cores: up to 4 processes, each with cores/processes threads."""
    return max(1, min(_MAX_DEFAULT_CPU_PROCESSES, usable_cpu_count()))


def _cpu_plan(devices: int | None, threads: int | None, backend: str) -> Plan:
    nprocs = devices or default_cpu_processes()
    threads = threads or max(1, usable_cpu_count() // nprocs)
    return Plan("cpu", nprocs, cpu_backend(backend) if nprocs > 1 else None, "cpu", (), threads)


def _gpu_ids(kind: str, devices: int | None, available: int) -> tuple[int, ...]:
    if available == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
        raise ExecutionEnvironmentError(
            f"execution_environment={kind!r} needs a CUDA GPU, but torch sees none "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda}, CUDA_VISIBLE_DEVICES={visible}). "
            "Use execution_environment='cpu' or 'auto', or install a CUDA build of torch."
        )
    if kind == "gpu":
        if devices not in (None, 1):
            raise ExecutionEnvironmentError(
                f"execution_environment='gpu' trains on one GPU, got devices={devices}; "
                "use execution_environment='multi-gpu' for several"
            )
        return (0,)
    if devices is None:
        return tuple(range(available))
    if devices > available:
        raise ExecutionEnvironmentError(
            f"execution_environment='multi-gpu' with devices={devices}, but only {available} GPU(s) are visible; "
            f"use devices<={available} or leave devices=None for all of them"
        )
    if devices == available:
        return tuple(range(available))
    from ..topology.cuda_order import select_cuda_devices  # the best-connected k visible GPUs (NVLink first)

    return tuple(select_cuda_devices(devices))


def _cluster_plan(threads: int | None, backend: str = "auto") -> Plan:
    missing = [name for name in TORCHRUN_VARS if name not in os.environ]
    if missing:
        raise ExecutionEnvironmentError(
            "execution_environment='cluster' runs inside workers started by torchrun, but these variables are "
            f"missing: {', '.join(missing)}. Start the script with e.g. "
            "`torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 train.py` "
            "on every node, or use execution_environment='auto' on one machine."
        )
    stock = os.environ.get(BOUND_STORES_ENV) != "1"  # torchrun's own agent, not fastpar's launch_agent (it said)
    if stock and os.environ["RANK"] == "0" and os.environ["MASTER_ADDR"] not in ("127.0.0.1", "localhost", "::1"):
        endpoint = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        notice = network_notice(endpoint, also="torchrun's rendezvous store", bound=False)
        print(notice, file=sys.stderr, flush=True)
    cuda = gpu_count() > 0
    threads = threads or max(1, usable_cpu_count() // int(os.environ["LOCAL_WORLD_SIZE"]))
    # CPU ranks: fastpar's backend by default, hierarchical across nodes (shared memory within each, gloo between)
    return Plan("cluster", 0, "nccl" if cuda else cpu_backend(backend), "cuda" if cuda else "cpu", (), threads)


def resolve(kind: str, devices: int | None = None, threads: int | None = None, backend: str = "auto") -> Plan:
    """The plan for ``execution_environment=kind``; raises ExecutionEnvironmentError when it can't be had here.
    ``backend`` is TrainingOptions.cpu_backend: the backend of CPU processes (on one machine or on a cluster)."""
    if kind == "cluster":
        return _cluster_plan(threads, backend)
    if under_torchrun():
        # Started by torchrun (e.g. `torchrun --nproc-per-node=4 train.py`): join its group instead of launching.
        plan = _cluster_plan(threads, backend)
        if kind == "cpu":
            return dataclasses.replace(plan, backend=cpu_backend(backend), device_type="cpu")
        return plan
    available = gpu_count()
    if kind == "auto":
        kind = "multi-gpu" if available > 1 else "gpu" if available == 1 else "cpu"
        if kind != "cpu" and devices is not None and devices > available:
            raise ExecutionEnvironmentError(f"devices={devices}, but only {available} GPU(s) are visible")
    if kind == "cpu":
        return _cpu_plan(devices, threads, backend)
    ids = _gpu_ids(kind, devices, available)
    backend = "nccl" if len(ids) > 1 else None
    return Plan(kind, len(ids), backend, "cuda", ids, threads or max(1, usable_cpu_count() // len(ids)))
