"""``fastpar bench shard --memory``: each strategy's measured memory per rank on models the planner has not seen,
beside the plan's prediction and the ZeRO paper's figure, and the memory goals checked.

For each model (shard_models.py) and strategy (DDP, ZeRO-1, ZeRO-2, FSDP2 resharding after forward) every rank
builds the model (same seed), takes one step -- ``zero_grad`` + forward + backward + AdamW step on its own
batch -- and then measures a second one (fastpar.shard.peak_memory): the peak over the whole step (CPU:
torch's ``MemTracker``; CUDA: ``max_memory_allocated``) and the state + buffers held after it (parameters,
buffers, gradients, optimizer state, ZeRO's flat buffers, pool and scratch; storages counted once).

Beside them: the plan's peak (``memory.total``: model state + activations + buffers in flight) and state
(model state + the buffers it keeps) from ``plan_for_module`` on rank 0's batch; and the ZeRO paper's figure
from the model's parameter bytes P (gradients G = P, AdamW state S = 2P): P + G + S for DDP, P + G + S/N for
ZeRO-1, P + (G + S)/N for ZeRO-2, (P + G + S)/N for FSDP. The staging allowance is
min(2 x the bucket cap, G(N - 1) / (2N)).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...shard.peak_memory import STATE_KEYS, measure_step
from ...tensor_storage import storage_bytes
from .. import launch
from ..context import BenchContext
from ..goals import AT_MOST, Goal
from ..table import BenchReport, Column, PlotSpec
from .shard_models import ModelCase, call, model_case, to_device

STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")
CKPT = "+ckpt"  # a strategy with fastpar.shard.checkpoint_activations(model) applied first
LR, WEIGHT_DECAY = 1e-3, 0.01
PEAK_PREDICTION = Goal("|plan / measured - 1| of the step's peak", "", 0.10, AT_MOST, unit="%")
STATE_PREDICTION = Goal("|plan / measured - 1| of state + buffers", "", 0.05, AT_MOST, unit="%")
ZERO2_PAPER = Goal("zero2 (state + buffers - staging)", "(P + (G + S)/N), the ZeRO paper's stage 2", 1.10, AT_MOST)
ZERO1_PAPER = Goal("zero1 (state + buffers - staging)", "(P + G + S/N), the ZeRO paper's stage 1", 1.10, AT_MOST)
# strictly smaller: the larger of the two ratios below 1 (0.999 leaves no tie)
STATE_ORDER = Goal("max(zero2 / zero1, zero1 / ddp) of state + buffers", "(zero2 < zero1 < ddp)", 0.999, AT_MOST)
PEAK_ORDER = Goal("max(zero2 / zero1, zero1 / ddp) of the peak", "(zero2 < zero1 < ddp)", 0.999, AT_MOST)
_FIELDS = ("peak", *STATE_KEYS, "total")


@dataclass(frozen=True)
class MemorySettings:
    models: tuple[str, ...]
    batch: int | None  # per rank; None: each model's own
    tiny: bool  # the models at toy sizes
    checkpointing: bool = False  # also each strategy with the repeated blocks checkpointed ("ddp+ckpt", ...)

    @property
    def strategies(self) -> tuple[str, ...]:
        return STRATEGIES + (tuple(f"{s}{CKPT}" for s in STRATEGIES) if self.checkpointing else ())


class _Trainee:
    """One strategy on one model: its modules, optimizer and step."""

    def __init__(self, strategy: str, case: ModelCase, device: torch.device) -> None:
        from ...ddp import DistributedDataParallel
        from ...shard import fully_shard_model
        from ...zero import ShardedOptimizer

        self.case, self.sharded = case, None
        module = case.build().to(device)
        if strategy.endswith(CKPT):
            from ...shard import checkpoint_activations

            checkpoint_activations(module)
            strategy = strategy.removesuffix(CKPT)
        self.module: nn.Module = module
        if strategy == "fsdp":
            self.model = fully_shard_model(module, reshard_after_forward=True)
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
            return
        self.model = DistributedDataParallel(module)
        if strategy == "ddp":
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        else:
            self.sharded = ShardedOptimizer(
                self.model, torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY, shard_gradients=strategy == "zero2"
            )
            self.optimizer = self.sharded

    def step(self, batch: Any) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.case.loss(call(self.model, batch), batch).backward()
        self.optimizer.step()
        if self.sharded is not None and next(self.module.parameters()).device.type == "cpu":
            self.sharded.wait_for_params()  # the all-gather runs in gloo's threads: inside the step

    def finish(self) -> None:
        if self.sharded is not None:
            self.sharded.wait_for_params()


def _gather(values: list[int], device: torch.device) -> list[list[int]]:
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [[int(v) for v in t.tolist()] for t in everyone]


def _measure(case: ModelCase, strategy: str, batch: Any, device: torch.device) -> list[dict[str, int]]:
    """Every rank's peak and state for one strategy (every rank gets the list)."""
    trainee = _Trainee(strategy, case, device)
    trainee.step(batch)  # optimizer state and buffers are allocated in the first step
    launch.barrier(device)
    memory = measure_step(partial(trainee.step, batch), trainee.module, trainee.optimizer, device)
    trainee.finish()
    row = [memory.peak, *(memory.state[k] for k in STATE_KEYS), memory.state_total]
    del trainee, memory  # before the next strategy: the CUDA peak counts all that is live
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return [dict(zip(_FIELDS, r, strict=True)) for r in _gather(row, device)]


def _plan(case: ModelCase, batch: Any, world_size: int, backend: str, device: torch.device):
    """The planner's estimates for this model, world size and batch (predictions only)."""
    from ...costmodel.memory_planner import plan_for_module

    return plan_for_module(
        case.build().to(device),
        batch,
        loss=case.loss,
        devices=world_size,
        device_memory="1TB",
        optimizer="adamw",
        strategies=STRATEGIES,
        backend=backend if backend in ("gloo", "fastpar") else None,
        fsdp_blocks_per_unit=1,  # what fully_shard_model builds by default, as measured here
    )


def _estimate(plan, strategy: str):
    ckpt = strategy.endswith(CKPT)
    strategy = strategy.removesuffix(CKPT)
    rows = [
        e
        for e in plan.estimates
        if e.strategy == strategy
        and (strategy != "fsdp" or e.options.get("reshard_after_forward", True))
        and bool(e.options.get("activation_checkpointing")) == ckpt
    ]
    return rows[0] if rows else None


def _model_facts(case: ModelCase, world_size: int, backend: str) -> dict[str, int]:
    """P (parameter bytes, a tied tensor once) and the staging allowance from the bucket cap fastpar's DDP uses."""
    from ...ddp.buckets import default_caps

    module = case.build()
    params = list(module.parameters())
    p = storage_bytes(params)
    cap = max(default_caps(params, world_size, shared_buckets=backend == "fastpar"))
    staging = int(min(2 * cap, p * (world_size - 1) / world_size / 2))
    return {"P": p, "G": p, "S": 2 * p, "cap": cap, "staging": staging}


def paper_figure(strategy: str, p: float, g: float, s: float, n: int) -> float:
    """The ZeRO paper's per-device model state: DDP (replicated), stage 1, stage 2, and full sharding."""
    return {"ddp": p + g + s, "zero1": p + g + s / n, "zero2": p + (g + s) / n, "fsdp": (p + g + s) / n}[strategy]


def _strategies_for(case: ModelCase, settings: MemorySettings) -> tuple[str, ...]:
    """The settings' strategies; the checkpointed ones only for a model with repeated blocks to checkpoint."""
    from ...shard.activation_checkpoint import ActivationCheckpointError, block_names

    try:
        has_blocks = bool(block_names(case.build()))
    except ActivationCheckpointError:
        has_blocks = False
    return tuple(s for s in settings.strategies if has_blocks or not s.endswith(CKPT))


def memory_rank_main(rank: int, world_size: int, ctx: BenchContext, settings: MemorySettings) -> BenchReport | None:
    device = launch.rank_device(ctx.backend)
    measured: dict[str, dict[str, list[dict[str, int]]]] = {}
    batches: dict[str, Any] = {}
    for name in settings.models:
        case = model_case(name, settings.tiny)
        gen = torch.Generator().manual_seed(1 + rank)
        batch = to_device(case.batch(settings.batch or case.default_batch, gen), device)
        batches[name] = batch
        measured[name] = {s: _measure(case, s, batch, device) for s in _strategies_for(case, settings)}
    if rank != 0:
        return None
    plans, facts = {}, {}
    for name in settings.models:
        case = model_case(name, settings.tiny)
        plans[name] = _plan(case, batches[name], world_size, ctx.backend, device)
        facts[name] = _model_facts(case, world_size, ctx.backend)
    return _report(ctx, settings, world_size, measured, plans, facts)


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _report(ctx, settings, world_size, measured, plans, facts) -> BenchReport:
    n = world_size
    rows, goals, summary = [], [], {}
    for name, per_strategy in measured.items():
        f = facts[name]
        largest: dict[str, dict[str, int]] = {}
        summary[name] = {"P": f["P"], "staging": f["staging"], "bucket_cap": f["cap"], "strategies": {}}
        for strategy, ranks in per_strategy.items():
            estimate = _estimate(plans[name], strategy)
            plan_peak = estimate.memory.total if estimate is not None else float("nan")
            plan_state = (
                estimate.memory.model_state + estimate.memory.persistent_buffers
                if estimate is not None
                else float("nan")
            )
            paper = paper_figure(strategy.removesuffix(CKPT), f["P"], f["G"], f["S"], n)
            for rank, m in enumerate(ranks):
                rows.append(
                    dict(
                        model=name,
                        strategy=strategy,
                        rank=rank,
                        peak_mib=m["peak"] / 2**20,
                        plan_peak_mib=plan_peak / 2**20,
                        peak_x=_ratio(plan_peak, m["peak"]),
                        state_mib=m["total"] / 2**20,
                        plan_state_mib=plan_state / 2**20,
                        state_x=_ratio(plan_state, m["total"]),
                        paper_mib=paper / 2**20,
                        paper_x=_ratio(m["total"], paper),
                    )
                )
            largest[strategy] = {
                "peak": max(m["peak"] for m in ranks),
                "total": max(m["total"] for m in ranks),
            }
            summary[name]["strategies"][strategy] = {
                "per_rank": ranks,
                "plan_peak": plan_peak,
                "plan_state": plan_state,
                "paper": paper,
            }
            scope = f"{name} {strategy}"
            if estimate is None:  # checkpointing the planner can't price here (its blocks are not probed layers)
                continue
            goals.append(PEAK_PREDICTION.check(abs(_ratio(plan_peak, largest[strategy]["peak"]) - 1), scope=scope))
            goals.append(STATE_PREDICTION.check(abs(_ratio(plan_state, largest[strategy]["total"]) - 1), scope=scope))
        for strategy, goal in (("zero2", ZERO2_PAPER), ("zero1", ZERO1_PAPER)):
            paper = paper_figure(strategy, f["P"], f["G"], f["S"], n)
            value = _ratio(largest[strategy]["total"] - f["staging"], paper)
            goals.append(goal.check(value, scope=name, detail=f"staging {f['staging'] / 2**20:.2f} MiB"))
        for key, goal in (("total", STATE_ORDER), ("peak", PEAK_ORDER)):
            z2, z1, ddp = (largest[s][key] for s in ("zero2", "zero1", "ddp"))
            goals.append(
                goal.check(
                    max(_ratio(z2, z1), _ratio(z1, ddp)),
                    scope=name,
                    detail=f"{z2 / 2**20:.2f} / {z1 / 2**20:.2f} / {ddp / 2**20:.2f} MiB",
                )
            )
    models = {name: model_case(name, settings.tiny).describe for name in measured}
    header = {
        "backend": ctx.backend,
        "world size": str(n),
        "optimizer": f"AdamW(lr={LR}, weight_decay={WEIGHT_DECAY}), fp32",
        "batch": "per rank: " + (str(settings.batch) if settings.batch else "each model's own (below)"),
        "step": "zero_grad + forward + backward + optimizer step; the second step measured, after one warm-up",
        "peak": "torch.cuda.max_memory_allocated" if ctx.backend == "nccl" else "torch's MemTracker over the step",
        "state": "parameters + buffers + gradients + optimizer state + ZeRO's buffers after the step (storages once)",
        "plan": "plan_for_module on rank 0's batch: peak = memory.total, state = model state + kept buffers",
        "paper": "P + G + S (ddp), P + G + S/N (zero1), P + (G + S)/N (zero2), (P + G + S)/N (fsdp); G = P, S = 2P",
        "staging": "min(2 x bucket cap, G(N-1)/(2N))",
    }
    if settings.checkpointing:
        header["+ckpt"] = (
            "checkpoint_activations(model) first (the repeated blocks); plan: the planner's ckpt row, nan where it "
            "can't price it (the blocks are not layers its probe measured); a model without blocks has no such rows"
        )
    header |= {f"model {name}": text for name, text in models.items()}
    return BenchReport(
        benchmark="shard",
        title=f"sharding strategies, {n} ranks: measured peak and state + buffers per rank, the plan, the ZeRO paper",
        columns=[
            Column("model", "model", 10),
            Column("strategy", "strategy", 9),
            Column("rank", "rank", 5),
            Column("peak_mib", "peak MiB", 10, ".2f", "MiB"),
            Column("plan_peak_mib", "plan MiB", 10, ".2f", "MiB"),
            Column("peak_x", "plan/peak", 10, ".3f", "x"),
            Column("state_mib", "state MiB", 10, ".2f", "MiB"),
            Column("plan_state_mib", "plan MiB", 10, ".2f", "MiB"),
            Column("state_x", "plan/state", 11, ".3f", "x"),
            Column("paper_mib", "paper MiB", 10, ".2f", "MiB"),
            Column("paper_x", "state/paper", 12, ".3f", "x"),
        ],
        rows=rows,
        header=header,
        goals=goals,
        summary={"memory": summary},
        plot=PlotSpec("bar", "strategy", "peak_mib", series="model", ylabel="peak MiB per rank"),
    )
