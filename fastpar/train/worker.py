"""One worker process: pick its device, join (or create) the process group, train, clean up."""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from .job import Job
from .loop import Run


def _init_process_group(backend: str, rank: int, world_size: int, device: torch.device,
                        timeout: datetime.timedelta) -> None:  # fmt: skip
    device_id = device if device.type == "cuda" else None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout, device_id=device_id)
        return
    # The elastic agent keeps one TCPStore for all restart rounds and workers connect without a prefix, so
    # a restarted group could read the dead workers' addresses (gloo: "connectFullMesh failed ...
    # Connection refused"). A per-round prefix keeps every round's keys apart.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                                is_master=False, timeout=timeout)  # fmt: skip
    store = dist.PrefixStore(f"fastpar/attempt_{attempt}", agent_store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                            device_id=device_id)  # fmt: skip


def run_worker(job: Job) -> dict[str, Any] | None:
    """Train on this process's rank (from torchrun's environment; rank 0 of 1 when there is none)."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    plan = job.plan
    if plan.device_type == "cuda":
        device = torch.device("cuda", plan.device_ids[local_rank] if plan.device_ids else local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if plan.nprocs > 1:  # launched here: keep torch threads to this process's share of the cores
        torch.set_num_threads(plan.threads_per_process)
    own_group = world_size > 1 and not dist.is_initialized()
    if own_group:
        if plan.nprocs:  # a local launch: keep gloo on loopback
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        _init_process_group(plan.backend or ("nccl" if device.type == "cuda" else "gloo"), rank, world_size, device,
                            datetime.timedelta(seconds=job.collective_timeout_s))  # fmt: skip
    try:
        return Run(job, rank, world_size, device).train()
    finally:
        if own_group and dist.is_initialized():
            dist.destroy_process_group()
