"""One rank of ``fastpar bench nodes`` (run on a node by the benchmark, not by hand): joins the group at node 0's
address on the "fastpar" backend plus a gloo group over the same ranks, checks every variant's result, times them
in interleaved rounds, and rank 0 writes the times as JSON.

Usage: python -m fastpar.bench.benchmarks.nodes_rank RANK WORLD ADDRESS PORT OUT CONFIG_JSON
"""

from __future__ import annotations

import datetime
import json
import sys
import time

import torch
import torch.distributed as dist

ALLREDUCE = ("fastpar", "gloo")  # the group each all-reduce runs on
DDP = ("no_comm", "ddp_gloo", "fastpar_fp32", "fastpar_bf16")  # ddp_variants names; ddp_gloo: torch DDP on gloo
ZERO = ("no_comm", "zero_torch", "zero_fastpar", "zero2_fastpar")  # zero.Trainee names; zero_torch on gloo


def _check_all_reduce(numel: int, group, rank: int, world: int) -> None:
    t = torch.full((numel,), float(rank + 1))
    dist.all_reduce(t, group=group)
    expected = world * (world + 1) / 2  # exact in float32
    wrong = int((t != expected).sum())
    if wrong:
        raise RuntimeError(f"all-reduce on {group_name(group)}: {wrong} of {numel} elements wrong on rank {rank}")


def group_name(group) -> str:
    return "gloo" if group is not None else "fastpar"


def _time_all_reduce(numel: int, groups: dict, config: dict, gloo) -> dict[str, list[float]]:
    buffers = {name: torch.zeros(numel) for name in groups}  # zeros: repeated sums stay exact
    for name, group in groups.items():
        for _ in range(config["warmup"]):
            dist.all_reduce(buffers[name], group=group)
    seconds: dict[str, list[float]] = {name: [] for name in groups}
    names = list(groups)
    for round_ in range(config["rounds"]):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:  # rotate who goes first
            dist.barrier(group=gloo)
            start = time.perf_counter()
            for _ in range(config["iters"]):
                dist.all_reduce(buffers[name], group=groups[name])
            seconds[name].append((time.perf_counter() - start) / config["iters"])
    return seconds


def _batch(config: dict, rank: int, models: dict) -> torch.Tensor:
    """This rank's input batch for ``config["model"]`` (each rank its own)."""
    width = models[config["model"]][0]
    return torch.randn(config["batch"], width, generator=torch.Generator().manual_seed(100 + rank))


def _time_steps(steps: dict, x: torch.Tensor, config: dict, gloo) -> dict[str, list[float]]:
    """Seconds per step of each variant's ``steps[v](x)``: warm-up, then ``rounds`` interleaved rounds of
    ``config["steps"]`` steps (who goes first rotates), the ranks lined up by a barrier before each."""
    for step in steps.values():
        for _ in range(config["warmup"]):
            step(x)
    variants = list(steps)
    seconds: dict[str, list[float]] = {v: [] for v in variants}
    for round_ in range(config["rounds"]):
        for v in variants[round_ % len(variants) :] + variants[: round_ % len(variants)]:
            dist.barrier(group=gloo)
            start = time.perf_counter()
            for _ in range(config["steps"]):
                steps[v](x)
            seconds[v].append((time.perf_counter() - start) / config["steps"])
    return seconds


def _time_ddp(config: dict, rank: int, gloo) -> tuple[dict[str, list[float]], dict[str, str], dict, int]:
    """Seconds per step of each DDP variant, what came out wrong, the step profile, and the model's fp32 gradient
    bytes."""
    from .ddp_variants import MODELS, Trainee

    variants = DDP + tuple(config["extra_variants"])

    x = _batch(config, rank, MODELS)
    trainees = {v: Trainee(v, config["model"], torch.device("cpu"), lr=0.01, gloo_group=gloo) for v in variants}
    seconds = _time_steps({v: t.step for v, t in trainees.items()}, x, config, gloo)
    profile = _profile_ddp(trainees, x, config, gloo)
    wrong = {}
    for v, trainee in trainees.items():  # every rank holds the same parameters (no_comm trains alone)
        mine = trainee.flat_params()
        first = mine.clone()
        dist.broadcast(first, 0, group=gloo)
        if v != "no_comm" and not torch.equal(mine, first):
            wrong[v] = f"rank {rank}'s parameters differ from rank 0's"
    grad_bytes = sum(p.numel() * 4 for p in trainees["no_comm"].model.parameters())
    return seconds, wrong, profile, grad_bytes


def _profile_ddp(trainees: dict, x: torch.Tensor, config: dict, gloo) -> dict[str, dict[str, float]]:
    """Where a step's time goes, per variant (median seconds over ``config["rounds"]`` steps): ``forward``,
    ``backward`` (autograd's call, which returns once the gradients are synchronised), of it ``wait`` (fastpar:
    waiting for the wire after backward's compute ended, ``comm_stats()["wait_s"]``) and ``optimizer``."""
    phases: dict[str, dict[str, list[float]]] = {}
    for v, trainee in trainees.items():
        rows = phases.setdefault(v, {"forward": [], "backward": [], "wait": [], "optimizer": []})
        for _ in range(config["rounds"]):
            dist.barrier(group=gloo)
            trainee.optimizer.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            loss = trainee.model(x).square().mean()
            t1 = time.perf_counter()
            loss.backward()
            if trainee.after_backward is not None:
                trainee.after_backward()
            t2 = time.perf_counter()
            trainee.optimizer.step()
            t3 = time.perf_counter()
            stats = getattr(trainee.model, "comm_stats", None)
            rows["forward"].append(t1 - t0)
            rows["backward"].append(t2 - t1)
            rows["wait"].append(stats()["wait_s"] if stats is not None else float("nan"))
            rows["optimizer"].append(t3 - t2)
    return {v: {k: sorted(vals)[len(vals) // 2] for k, vals in rows.items()} for v, rows in phases.items()}


def _time_zero(config: dict, rank: int, gloo) -> tuple[dict[str, list[float]], dict[str, str]]:
    """ZeRO steps (AdamW): torch's ZeroRedundancyOptimizer over torch DDP on gloo (the peer), fastpar's ZeRO-1 and
    ZeRO-2 on the "fastpar" backend, and the model alone (no_comm, the floor); all but no_comm end equal."""
    from .ddp_variants import MODELS
    from .zero import Trainee

    x = _batch(config, rank, MODELS)
    trainees = {v: Trainee(v, config["model"], torch.device("cpu"), torch_group=gloo) for v in ZERO}
    seconds = _time_steps({v: t.timed_step for v, t in trainees.items()}, x, config, gloo)
    wrong = {}
    reference = trainees["zero_torch"].flat_params()
    for v, trainee in trainees.items():  # the same steps on the same batches: torch's ZeRO's parameters, bit for bit
        if v != "no_comm" and not torch.equal(trainee.flat_params(), reference):
            wrong[v] = f"rank {rank}'s parameters differ from torch's ZeRO's"
    return seconds, wrong


def main(rank: int, world: int, address: str, port: str, out: str, config: dict) -> None:
    from ...comm import shm_status

    dist.init_process_group(
        "fastpar",
        init_method=f"tcp://{address}:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=config["timeout_s"]),
    )
    gloo = dist.new_group(backend="gloo")
    result: dict = {"status": shm_status(), "threads": torch.get_num_threads()}
    groups = {"fastpar": None, "gloo": gloo}
    numel = config["bytes"] // 4
    for group in groups.values():
        _check_all_reduce(numel, group, rank, world)
    result["allreduce"] = _time_all_reduce(numel, groups, config, gloo)
    if config["model"]:
        result["ddp"], result["wrong"], result["profile"], result["grad_bytes"] = _time_ddp(config, rank, gloo)
    if config["model"] and config["zero"]:
        result["zero"], wrong = _time_zero(config, rank, gloo)
        result["wrong"] = result.get("wrong", {}) | {f"zero {v}": text for v, text in wrong.items()}
    every = [None] * world
    dist.all_gather_object(every, result, group=gloo)
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(every, fh)
    dist.barrier(group=gloo)
    dist.destroy_process_group()


if __name__ == "__main__":
    rank, world, address, port, out, config = sys.argv[1:7]
    main(int(rank), int(world), address, port, out, json.loads(config))
