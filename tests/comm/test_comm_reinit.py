"""Re-creating the "fastpar" group: init -> collectives -> destroy_process_group() -> init again, several rounds on
one store (torch hands the new group the same store prefix, with the last round's keys still in it). Every round
must use shared memory on every rank, give gloo's bits, and leave nothing in /dev/shm.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import traceback

import torch
import torch.distributed as dist

from fastpar.comm import list_segments
from fastpar.launcher import free_port, loopback_env

ROUNDS = 4


def _rounds(rank: int, world: int, port: int, results) -> None:
    import fastpar

    os.environ.update(loopback_env(port, rank, world))
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=30)
    try:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timeout)
        rounds = []
        for round_ in range(ROUNDS):
            dist.init_process_group("fastpar", store=store, rank=rank, world_size=world, timeout=timeout)
            # the reference: gloo on keys of its own (torch's gloo, too, fails to connect when it is re-created on
            # the keys of a destroyed group)
            gloo = dist.ProcessGroupGloo(dist.PrefixStore(f"reference/{round_}/", store), rank, world, timeout)
            gen = torch.Generator().manual_seed(1000 * round_ + rank)
            ours = torch.randn(10_001, generator=gen) * torch.exp(torch.randn(10_001, generator=gen) * 4)
            theirs = ours.clone()
            dist.all_reduce(ours)
            gloo.allreduce([theirs]).wait()
            rounds.append({"status": fastpar.comm.shm_status(), "equal": torch.equal(ours, theirs)})
            dist.destroy_process_group()
        results.put((rank, rounds))
    except Exception:
        results.put((rank, traceback.format_exc()))


def test_group_recreated_on_the_same_store_uses_shared_memory_every_round():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port, world = free_port(), 3
    procs = [ctx.Process(target=_rounds, args=(r, world, port, results)) for r in range(world)]
    for p in procs:
        p.start()
    outcome = {}
    try:
        for _ in range(world):
            rank, value = results.get(timeout=240)
            outcome[rank] = value
    except queue.Empty:
        pass
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(5)
    assert sorted(outcome) == list(range(world)), f"ranks without a result (hung or died): {outcome}"
    for rank, rounds in outcome.items():
        assert isinstance(rounds, list), f"rank {rank}: {rounds}"
        for round_, result in enumerate(rounds):
            assert result["status"] == {"backend": "fastpar", "shm": True, "reason": "", "nodes": 1}, (
                rank,
                round_,
                result,
            )
            assert result["equal"], f"rank {rank}, round {round_}: all_reduce differs from gloo"
    assert [name for name in list_segments() if any(f".{p.pid}." in name for p in procs)] == []
