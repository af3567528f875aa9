"""One rank of the across-nodes sharded-training test (not a test itself): fastpar's fully sharded model (FSDP2:
reduce-scatter and all-gather) and DDP train 3 SGD steps on the "fastpar" backend across nodes; rank 0 saves each
one's full parameters, every rank saves whether its copy equals rank 0's. Usage:
nodes_sharded_worker.py RANK WORLD MASTER_ADDR MASTER_PORT OUT_DIR"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from nodes_collectives_worker import join, save_and_leave  # this folder: the same join and exit

import fastpar
from fastpar.shard import fully_shard_model

STEPS, BATCH = 3, 8


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)
    )


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(BATCH, 32, generator=g), torch.randn(BATCH, 8, generator=g)


def train(model: torch.nn.Module, rank: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def flat(model: torch.nn.Module) -> torch.Tensor:
    parts = []
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        parts.append(full.detach().reshape(-1))
    return torch.cat(parts)


def main(rank: int, world: int, addr: str, port: str, out: str) -> None:
    got = join(rank, world, addr, port)
    sharded = fully_shard_model(make_model)
    train(sharded, rank)
    got["fsdp"] = flat(sharded)
    ddp = fastpar.DistributedDataParallel(make_model())
    train(ddp, rank)
    got["ddp"] = flat(ddp.module)
    for key in ("fsdp", "ddp"):
        first = got[key].clone()
        dist.broadcast(first, 0)
        got[f"{key}_same_as_rank0"] = torch.equal(first, got[key])
    save_and_leave(got, out, rank)


if __name__ == "__main__":
    rank, world, addr, port, out = sys.argv[1:6]
    main(int(rank), int(world), addr, port, out)
