"""One worker process: pick its device, join (or create) the process group, train, clean up."""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

import torch
import torch.distributed as dist

from ..launcher import join_process_group, leave_process_group, set_threads
from ..user_errors import OptionError
from .job import Job, private_copy
from .loop import Run


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
        set_threads(plan.threads_per_process)
        job = private_copy(job)  # tensors that came through torch's pickler are shared with the other workers
    own_group = world_size > 1 and not dist.is_initialized()
    if own_group:
        join_process_group(
            plan.backend or ("nccl" if device.type == "cuda" else "gloo"),
            rank=rank,
            world_size=world_size,
            timeout_s=job.collective_timeout_s,
            device=device,
        )
    finished = False  # every rank got here alike: safe to wait for the others before the group goes
    try:
        result = Run(job, rank, world_size, device).train()
        finished = True
        return result
    except OptionError as exc:
        if plan.nprocs <= 1:
            raise
        # refused before the first step, alike on every rank (e.g. no sharding fits memory_budget): the launching
        # process raises it again, as one message instead of every worker's traceback
        finished = True
        return {"refused": (exc.option, str(exc))}
    except Exception as exc:
        # said at once, before the group's teardown, which a dead peer can hold up until the agent stops this process
        if world_size > 1:
            first = (str(exc).strip().splitlines() or [""])[0]
            print(
                f"fastpar: rank {rank} on {socket.gethostname()} failed: {type(exc).__name__}: {first}",
                file=sys.stderr,
                flush=True,
            )
        raise
    finally:
        if own_group and dist.is_initialized():
            if finished:  # gloo aborts a process whose peer tears the group down while it finishes its last collective
                dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
            leave_process_group()
