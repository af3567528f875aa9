"""``fastpar bench zero``: ZeRO-1 and ZeRO-2 -- optimizer state and gradient bytes per rank and step time of
fastpar's ShardedOptimizer against torch's ZeroRedundancyOptimizer and unsharded DDP.

One step = ``zero_grad`` + forward + backward + AdamW step (lr 1e-3, weight decay 0.01), loss
``out.square().mean()``, on the ``fastpar bench ddp`` models (``mlp``, ``blocks``; ``tiny`` for smoke tests).
Variants, interleaved in rounds on the same ranks:

  no_comm        the bare model + AdamW, no communication: the floor
  ddp            torch DistributedDataParallel + AdamW: the peer without sharding
  ddp_fastpar    fastpar.DistributedDataParallel + AdamW: what ZeRO must not be slower than
  zero_torch     torch DDP + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW): the peer with sharding
  zero_fastpar   fastpar.DistributedDataParallel + fastpar.ShardedOptimizer(AdamW): ZeRO-1
  zero2_fastpar  the same with shard_gradients=True: ZeRO-2

Before timing every variant takes one step on the same batch on every rank; its parameters must then equal
torch DDP's bit for bit (no_comm: within rounding). Optimizer state bytes and gradient bytes are measured on
every rank after that step: the storage of every ``.grad`` and, for fastpar, of the gradient buckets, shards,
pool and exchange scratch (``ShardedOptimizer.memory_report()``); torch's DDP also holds its own buckets, which
Python cannot see, so its gradient bytes are a lower bound. On CPU ranks each timed zero_fastpar step includes
waiting for its all-gather (see ``Trainee.timed_step``). A variant faster than no_comm is flagged, and a goal
that compares it is IMPOSSIBLE.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...tensor_storage import storage_bytes
from .. import launch
from ..context import BenchContext
from ..goals import AT_MOST, Goal, Verdict
from ..harness import BenchUsageError
from ..table import BenchReport, Column, PlotSpec
from .training_step import (
    MODELS,
    build_model,
    check_one_step,
    floor_flags,
    pair_flag,
    parse_models,
    step_columns,
    step_header,
)

DESCRIPTION = (
    "ZeRO-1/2: optimizer state and gradients per rank and step time, fastpar sharded vs torch "
    "ZeroRedundancyOptimizer vs DDP"
)
USES = {"nproc"}
DEFAULTS = {"iters": 2, "warmup": 1, "rounds": 5}
VARIANTS = ("no_comm", "ddp", "ddp_fastpar", "zero_torch", "zero_fastpar", "zero2_fastpar")
LR, WEIGHT_DECAY = 1e-3, 0.01
STATE_PER_RANK = Goal("zero_fastpar optimizer state per rank", "(1/N of unsharded + one bucket)", 1.0, AT_MOST)
STEP_VS_UNSHARDED = Goal("zero_fastpar step", "ddp_fastpar", 1.05, AT_MOST)
STEP_VS_TORCH_ZERO = Goal("zero_fastpar step", "zero_torch", 0.90, AT_MOST)
STEP_ZERO2_VS_ZERO1 = Goal("zero2_fastpar step", "zero_fastpar", 1.05, AT_MOST)
GRADS_PER_RANK = Goal(
    "zero2_fastpar gradients per rank", "(1/N of the model's + the pool of buckets in flight)", 1.0, AT_MOST
)
STEP_GOALS = (
    (STEP_VS_UNSHARDED, "zero_fastpar", "ddp_fastpar"),
    (STEP_VS_TORCH_ZERO, "zero_fastpar", "zero_torch"),
    (STEP_ZERO2_VS_ZERO1, "zero2_fastpar", "zero_fastpar"),
)


@dataclass(frozen=True)
class ZeroSettings:
    """What ``run`` derived from the zero flags, for every rank."""

    models: list[str]
    batch: int


class Trainee:
    """One variant's model, optimizer and step."""

    def __init__(self, variant: str, model_name: str, device: torch.device, torch_group=None) -> None:
        """``torch_group``: the process group of torch's variants (``ddp``, ``zero_torch``) where it is not the
        default one (``bench nodes``: gloo beside the "fastpar" backend)."""
        from ...ddp import DistributedDataParallel
        from ...zero import ShardedOptimizer

        module = build_model(model_name).to(device)
        device_ids = [device.index] if device.type == "cuda" else None
        self.sharded: ShardedOptimizer | None = None
        if variant == "no_comm":
            self.model, self.optimizer = module, _adamw(module.parameters())
        elif variant in ("ddp", "zero_torch"):
            self.model = torch.nn.parallel.DistributedDataParallel(
                module, device_ids=device_ids, process_group=torch_group
            )
            if variant == "ddp":
                self.optimizer = _adamw(self.model.parameters())
            else:
                from torch.distributed.optim import ZeroRedundancyOptimizer

                self.optimizer = ZeroRedundancyOptimizer(
                    self.model.parameters(),
                    torch.optim.AdamW,
                    process_group=torch_group,
                    lr=LR,
                    weight_decay=WEIGHT_DECAY,
                )
        else:
            self.model = DistributedDataParallel(module, device_ids=device_ids)
            if variant == "ddp_fastpar":
                self.optimizer = _adamw(self.model.parameters())
            else:
                self.sharded = ShardedOptimizer(
                    self.model,
                    torch.optim.AdamW,
                    lr=LR,
                    weight_decay=WEIGHT_DECAY,
                    shard_gradients=variant == "zero2_fastpar",
                )
                self.optimizer = self.sharded

    def step(self, x: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.model(x).square().mean().backward()
        self.optimizer.step()

    def timed_step(self, x: torch.Tensor) -> None:
        """A step whose work all lies inside it: on CPU ranks the all-gather runs in gloo's background threads
        after ``step()`` returns, so it is waited for here (the overlap with the next forward is not credited);
        on GPUs the harness's device synchronisation covers it."""
        self.step(x)
        if self.sharded is not None and x.device.type == "cpu":
            self.sharded.wait_for_params()

    def flat_params(self) -> torch.Tensor:
        if self.sharded is not None:
            self.sharded.wait_for_params()
        return torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        if self.sharded is not None:
            return self.sharded.state_bytes()
        optimizer = getattr(self.optimizer, "optim", self.optimizer)  # torch's ZeRO: the local optimizer
        return storage_bytes(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))

    def grad_bytes(self) -> tuple[int, int]:
        """(bytes of gradient memory this rank holds now, of which in ZeRO-2's pool), each storage counted once."""
        if self.sharded is not None:
            report = self.sharded.memory_report()
            return report["gradients"], report["gradient_pool"]
        return storage_bytes(p.grad for p in self.model.parameters()), 0  # fastpar DDP: its bucket views, once

    def largest_bucket_numel(self) -> int:
        return max(zb.bucket.numel for zb in self.sharded._sharded) if self.sharded is not None else 0


def _tolerance(variant: str) -> dict:
    return {"rtol": 1e-4, "atol": 1e-6} if variant == "no_comm" else {}  # everything else: bit for bit


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


def _per_rank(value: int, device: torch.device) -> list[int]:
    values = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(values, torch.tensor([value], dtype=torch.int64, device=device))
    return [int(v.item()) for v in values]


def _rank_main(rank: int, world_size: int, ctx: BenchContext, settings: ZeroSettings) -> BenchReport | None:
    device = launch.rank_device(ctx.backend)
    seconds, memory = {}, {}
    for model_name in settings.models:
        width = MODELS[model_name][0]
        trainees = {v: Trainee(v, model_name, device) for v in VARIANTS}
        check_batch = torch.randn(settings.batch, width, generator=torch.Generator().manual_seed(1)).to(device)
        check_one_step(trainees, check_batch, _tolerance, model_name)
        memory[model_name] = {v: _per_rank(t.state_bytes(), device) for v, t in trainees.items()}
        grads = {v: t.grad_bytes() for v, t in trainees.items()}
        memory[model_name]["_grads"] = {v: _per_rank(g[0], device) for v, g in grads.items()}
        memory[model_name]["_pool"] = _per_rank(grads["zero2_fastpar"][1], device)
        memory[model_name]["_buckets"] = len(trainees["zero2_fastpar"].sharded._sharded)
        memory[model_name]["_bucket"] = trainees["zero_fastpar"].largest_bucket_numel()
        memory[model_name]["_numel"] = sum(p.numel() for p in trainees["ddp"].model.parameters())
        batch = torch.randn(settings.batch, width, generator=torch.Generator().manual_seed(100 + rank)).to(device)
        seconds[model_name] = launch.time_on_all_ranks(
            {v: (lambda t=t, x=batch: t.timed_step(x)) for v, t in trainees.items()}, ctx.plan, device
        )
        for trainee in trainees.values():
            if trainee.sharded is not None:
                trainee.sharded.wait_for_params()
        del trainees
    return _report(ctx, settings, world_size, seconds, memory) if rank == 0 else None


def _state_goal(model_name: str, mem: dict, world_size: int) -> Verdict:
    """Optimizer state on the largest rank against 1/N of the unsharded state plus one bucket's worth."""
    unsharded = max(mem["ddp_fastpar"])
    per_element = unsharded / mem["_numel"]
    bucket = mem["_bucket"] * per_element
    limit = unsharded / world_size + bucket
    worst = max(mem["zero_fastpar"])
    detail = (
        f"{worst / 2**20:.2f} MiB on the largest rank, limit {unsharded / 2**20:.2f}/{world_size} + "
        f"{bucket / 2**20:.2f} MiB; {worst / unsharded:.3f}x unsharded"
    )
    return STATE_PER_RANK.check(worst / limit, scope=model_name, detail=detail)


def _grads_goal(model_name: str, mem: dict, world_size: int) -> Verdict:
    """ZeRO-2's gradient bytes on each rank against 1/N of the model's fp32 gradient + that rank's pool (+ at most
    one padding element per bucket)."""
    model = mem["_numel"] * 4
    padding = 4 * mem["_buckets"]
    ratios = [
        g / (model / world_size + pool + padding)
        for g, pool in zip(mem["_grads"]["zero2_fastpar"], mem["_pool"], strict=True)
    ]
    worst = max(range(len(ratios)), key=ratios.__getitem__)
    grads, pool = mem["_grads"]["zero2_fastpar"][worst], mem["_pool"][worst]
    detail = (
        f"rank {worst}: {grads / 2**20:.2f} MiB, limit {model / 2**20:.2f}/{world_size} + pool {pool / 2**20:.2f} MiB; "
        f"ZeRO-1 {max(mem['_grads']['zero_fastpar']) / 2**20:.2f} MiB"
    )
    return GRADS_PER_RANK.check(ratios[worst], scope=model_name, detail=detail)


def _report(ctx: BenchContext, settings: ZeroSettings, world_size: int, seconds: dict, memory: dict) -> BenchReport:
    rows, footer, goals = [], [], []
    for model_name, times in seconds.items():
        mem = memory[model_name]
        floor, peer = times["no_comm"], times["ddp"]
        for variant in VARIANTS:
            t = times[variant]
            rows.append(
                dict(
                    model=model_name,
                    variant=variant,
                    step_ms=t * 1e3,
                    x_floor=t / floor,
                    x_ddp=t / peer,
                    x_ddp_fastpar=t / times["ddp_fastpar"],
                    state_mib=max(mem[variant]) / 2**20,
                    per_rank=" ".join(f"{b / 2**20:.2f}" for b in mem[variant]),
                    grad_mib=max(mem["_grads"][variant]) / 2**20,
                    grads_per_rank=" ".join(f"{b / 2**20:.2f}" for b in mem["_grads"][variant]),
                )
            )
        flags = floor_flags(model_name, times)
        footer += [f"beyond a bound: {flag}" for flag in flags.values()]
        goals.append(_state_goal(model_name, mem, world_size))
        goals.append(_grads_goal(model_name, mem, world_size))
        for goal, ours, theirs in STEP_GOALS:
            goals.append(goal.check(times[ours] / times[theirs], scope=model_name, flag=pair_flag(flags, ours, theirs)))
    # one state and one gradient column: every rank's MiB (the JSON rows also carry the largest)
    per_rank_width = 2 + max([len("state MiB per rank"), *(len(r["per_rank"]) for r in rows)])  # 2: a clear gap
    grads_width = 2 + max([len("grad MiB per rank"), *(len(r["grads_per_rank"]) for r in rows)])
    return BenchReport(
        benchmark="zero",
        title=f"ZeRO-1 and ZeRO-2: optimizer state, gradients and step time, {world_size} ranks",
        columns=[
            *step_columns(14),
            Column("x_ddp_fastpar", "x ddp_fastpar", 14, ".2f", "x"),
            Column("per_rank", "state MiB per rank", per_rank_width, unit="MiB"),
            Column("grads_per_rank", "grad MiB per rank", grads_width, unit="MiB"),
        ],
        rows=rows,
        header=step_header(
            ctx,
            world_size,
            settings.batch,
            optimizer=f"AdamW(lr={LR}, weight_decay={WEIGHT_DECAY}); state = its tensors (exp_avg, exp_avg_sq, step)",
        ),
        footer=footer,
        goals=goals,
        summary={
            "step_ms": {m: {v: t * 1e3 for v, t in s.items()} for m, s in seconds.items()},
            "state_bytes_per_rank": {m: {v: mem[v] for v in VARIANTS} for m, mem in memory.items()},
            "grad_bytes_per_rank": {m: mem["_grads"] for m, mem in memory.items()},
            "zero2_pool_bytes_per_rank": {m: mem["_pool"] for m, mem in memory.items()},
        },
        plot=PlotSpec("bar", "variant", "x_floor", series="model", ylabel="step time / no-communication step"),
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("zero")
    group.add_argument(
        "--models", default="mlp,blocks", help=f"comma-separated of {', '.join(MODELS)} (default mlp,blocks)"
    )
    group.add_argument("--batch", type=int, default=64, help="rows per step per rank (default 64)")


def run(ctx: BenchContext) -> BenchReport | None:
    models = parse_models(ctx.flags.models, MODELS, ctx.flags.batch)
    if ctx.nproc == 1:
        raise BenchUsageError("zero shards across ranks: --nproc must be at least 2")
    return launch.run_distributed(_rank_main, ctx, ZeroSettings(models, ctx.flags.batch))
