"""One rank of the across-nodes collective tests (not a test itself): runs the "fastpar" backend's collectives on
a group whose ranks sit on several nodes and saves what it got. Usage:
nodes_collectives_worker.py RANK WORLD MASTER_ADDR MASTER_PORT OUT_DIR"""

from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist

import fastpar

N, SHARE = 300_001, 4_099  # odd sizes: uneven blocks in every ring


def inputs(rank: int) -> dict[str, torch.Tensor]:
    """This rank's inputs (the test recomputes them)."""
    g = torch.Generator().manual_seed(1000 + rank)
    return {
        "x": torch.randn(N, generator=g),
        "m": torch.randn(48, 64, generator=g),
        "parts": torch.randn(3, 5_000, generator=g),
    }


def join(rank: int, world: int, addr: str, port: str) -> dict[str, object]:
    """Join the group on the "fastpar" backend at node 0's address; returns what to save, its status first."""
    dist.init_process_group(
        "fastpar",
        init_method=f"tcp://{addr}:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    return {"status": fastpar.comm.shm_status()}


def save_and_leave(got: dict[str, object], out: str, rank: int) -> None:
    torch.save(got, f"{out}/{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def main(rank: int, world: int, addr: str, port: str, out: str) -> None:
    got = join(rank, world, addr, port)
    x = inputs(rank)
    t = x["x"].clone()
    dist.all_reduce(t)
    got["sum"] = t
    bf = x["x"].to(torch.bfloat16)
    dist.all_reduce(bf)
    got["sum_bf16"] = bf
    avg = x["x"].clone()
    dist.all_reduce(avg, op=dist.ReduceOp.AVG)
    got["avg"] = avg
    m = x["m"].t()  # not contiguous: summed in storage order, as gloo does
    dist.all_reduce(m)
    got["sum_t"] = m
    parts = [p.clone() for p in x["parts"]]
    works = [dist.all_reduce(p, async_op=True) for p in parts]  # several in flight
    for work in works:
        work.wait()
    got["parts"] = torch.stack(parts)
    coalesced = [p.clone() for p in x["parts"]]
    dist.all_reduce_coalesced(coalesced)
    got["coalesced"] = torch.stack(coalesced)
    rs = torch.empty(SHARE)
    dist.reduce_scatter_tensor(rs, x["x"][: world * SHARE].clone())
    got["reduce_scatter"] = rs
    ag = torch.empty(world * 5)
    dist.all_gather_into_tensor(ag, torch.full((5,), float(rank)))
    got["all_gather"] = ag
    gathered = [torch.empty(3) for _ in range(world)]
    dist.all_gather(gathered, torch.full((3,), float(rank)))  # the list form: gloo's path
    got["all_gather_list"] = torch.cat(gathered)
    bc = torch.full((7,), float(rank))
    dist.broadcast(bc, src=world - 1)
    got["broadcast"] = bc
    dist.barrier()
    save_and_leave(got, out, rank)


if __name__ == "__main__":
    rank, world, addr, port, out = sys.argv[1:6]
    main(int(rank), int(world), addr, port, out)
