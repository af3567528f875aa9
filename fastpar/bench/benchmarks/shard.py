"""``fastpar bench shard``: step time and per-rank memory of every sharding strategy on one model, with the
memory planner's predictions beside the measurements.

One step = ``zero_grad`` + forward + backward + AdamW step (lr 1e-3, weight decay 0.01), loss
``out.square().mean()``, on ``--depth`` blocks of (Linear(``--width``) + GELU). Variants, interleaved in
rounds on the same ranks, on the run's backend and -- on the fastpar backend -- again on a gloo group over
the same ranks (suffix ``_gloo``):

  no_comm        the bare model + AdamW, no communication: the floor (run's backend only)
  ddp            fastpar.DistributedDataParallel + AdamW
  zero1          + fastpar.ShardedOptimizer (optimizer state / N)
  zero2          + ShardedOptimizer(shard_gradients=True) (gradients / N too)
  fsdp_reshard   fastpar.fully_shard_model (torch FSDP2), parameters resharded after forward
  fsdp_keep      the same, parameters kept gathered between forward and backward
                 (both with the plan's units: the blocks a unit its estimate groups)
  pipeline       fastpar.shard.pipeline_model: one stage per rank, 1F1B over ``--microbatches``; it takes the
                 ranks' batches together (the same global batch as the data-parallel variants)

Before timing every variant takes one step on the same batches; its parameters must then equal fastpar DDP's:
bit for bit for ZeRO, within rounding for the fully sharded and pipelined steps (their sums run in another
order). Memory is what each rank holds after a step (parameters, gradients, optimizer state: storages counted
once), next to the planner's prediction for the same strategy, world size and batch.

``--memory`` measures memory instead of time, on other models (shard_memory.py): each strategy's peak over a
whole step and its state + buffers per rank, beside the plan's prediction and the ZeRO paper's figure.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from ...tensor_storage import storage_bytes
from ...user_errors import UserError
from .. import launch
from ..context import BenchContext
from ..goals import AT_MOST, Goal
from ..harness import BenchUsageError, WrongResultError, count_mismatches
from ..table import BenchReport, Column, PlotSpec
from .shard_models import DEFAULT_MODELS, MODELS
from .training_step import floor_flags, pair_flag

DESCRIPTION = (
    "sharding strategies: step time and per-rank memory of DDP, ZeRO-1/2, FSDP2 and pipeline stages, with the plan"
)
USES = {"nproc"}
DEFAULTS = {"iters": 2, "warmup": 1, "rounds": 5}
STRATEGIES = ("ddp", "zero1", "zero2", "fsdp_reshard", "fsdp_keep", "pipeline")
LR, WEIGHT_DECAY = 1e-3, 0.01
ZERO2_VS_ZERO1 = Goal("zero2 step", "zero1", 1.05, AT_MOST)
FSDP_VS_DDP = Goal("fully sharded step (the plan's reshard choice)", "ddp on the same backend", 1.35, AT_MOST)
PICK_CONFIRMED = Goal("the plan's pick, measured step", "the fastest measured strategy that fits", 1.15, AT_MOST)
STEP_PREDICTION = Goal("|predicted / measured - 1| of the step time", "", 0.25, AT_MOST, unit="%")
STATE_PREDICTION = Goal("|predicted / measured - 1| of model-state bytes", "", 0.05, AT_MOST, unit="%")


@dataclass(frozen=True)
class ShardSettings:
    """What ``run`` derived from the shard flags, for every rank."""

    width: int
    depth: int
    batch: int
    microbatches: int
    memory: int | None  # the planner's device memory (bytes); None: 64 GiB, everything fits
    plans: dict | None = None  # the plan of each wire (by variant suffix), made before the ranks started


def build_model(width: int, depth: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)))


def _loss(out: torch.Tensor, _target: torch.Tensor | None = None) -> torch.Tensor:
    return out.square().mean()


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


def _state_tensors(optimizer: torch.optim.Optimizer):
    inner = getattr(optimizer, "optimizer", optimizer)
    return [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]


class Trainee:
    """One variant: its model, optimizer, step and the bytes it holds."""

    def __init__(
        self, strategy: str, settings: ShardSettings, group, device: torch.device, blocks_per_unit: int = 1
    ) -> None:
        from ...ddp import DistributedDataParallel
        from ...shard import fully_shard_model, pipeline_model
        from ...zero import ShardedOptimizer

        self.strategy, self.sharded, self.pipelined = strategy, None, None
        module = build_model(settings.width, settings.depth).to(device)
        if strategy == "no_comm":
            self.model, self.optimizer = module, _adamw(module.parameters())
        elif strategy in ("ddp", "zero1", "zero2"):
            self.model = DistributedDataParallel(module, process_group=group)
            if strategy == "ddp":
                self.optimizer = _adamw(self.model.parameters())
            else:
                self.sharded = ShardedOptimizer(
                    self.model, torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY, shard_gradients=strategy == "zero2"
                )
                self.optimizer = self.sharded
        elif strategy.startswith("fsdp"):
            self.model = fully_shard_model(
                module, group=group, reshard_after_forward=strategy == "fsdp_reshard", blocks_per_unit=blocks_per_unit
            )
            self.optimizer = _adamw(self.model.parameters())
        else:
            world = group.size() if group is not None else dist.get_world_size()
            example = torch.zeros(settings.batch * world, settings.width, device=device)
            self.pipelined = pipeline_model(
                module,
                stages=world,
                loss_fn=_loss,
                microbatches=settings.microbatches,
                schedule="1f1b",
                example_input=example,
                group=group,
            )
            self.model = self.pipelined.module
            self.optimizer = _adamw(self.pipelined.parameters())

    def step(self, x: torch.Tensor, everyone: torch.Tensor) -> None:
        """``x``: this rank's batch; ``everyone``: all ranks' batches, in rank order (the pipeline's input)."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.pipelined is not None:
            self.pipelined.step(everyone, everyone)
        else:
            _loss(self.model(x)).backward()
        self.optimizer.step()
        if self.sharded is not None and x.device.type == "cpu":
            self.sharded.wait_for_params()  # the all-gather runs in gloo's threads: inside the timed step

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """Full parameters by the plain model's names (this rank's stage only, for the pipeline)."""
        if self.pipelined is not None:
            named = self.pipelined.named_parameters()
        else:
            named = getattr(self.model, "module", self.model).named_parameters()
        return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in named}

    def memory(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds now."""
        if self.sharded is not None:
            report = self.sharded.memory_report()
            return {k: report[k] for k in ("parameters", "gradients", "optimizer_state")}
        params = list(self.pipelined.parameters() if self.pipelined is not None else self.model.parameters())
        return {
            "parameters": storage_bytes(params),
            "gradients": storage_bytes(p.grad for p in params),
            "optimizer_state": storage_bytes(_state_tensors(self.optimizer)),
        }


def _tolerance(strategy: str) -> dict:
    exact = strategy in ("ddp", "zero1", "zero2")
    return {} if exact else {"rtol": 1e-4, "atol": 1e-6}


def _check_one_step(trainees: dict[str, Trainee], x, everyone, device) -> None:
    for trainee in trainees.values():
        trainee.step(x, everyone)
    reference = trainees["ddp"].named_parameters()
    wrong = {}
    for name, trainee in trainees.items():
        if name.startswith("no_comm"):
            continue
        mine = trainee.named_parameters()
        ref = torch.cat([reference[n].reshape(-1) for n in mine])
        got = torch.cat([p.reshape(-1) for p in mine.values()])
        wrong[name] = launch.agree_count(count_mismatches(got, ref, **_tolerance(name.removesuffix("_gloo"))), device)
    if any(wrong.values()):
        listing = ", ".join(f"{v}: {n} parameters differ" for v, n in wrong.items() if n)
        raise WrongResultError(f"after one step on the same batches, vs fastpar DDP: {listing}")


def _plan(settings: ShardSettings, world_size: int, backend: str, probe=None):
    """The planner's estimates for this model, world size, batch and wire (predictions only: nothing is sharded).
    ``probe``: another wire's plan's measurements, so that the wires differ only in how the wire is priced."""
    from ...costmodel.memory_planner import plan_for_module

    model = build_model(settings.width, settings.depth)
    example = torch.zeros(settings.batch, settings.width)
    return plan_for_module(
        model,
        example,
        loss=_loss,
        devices=world_size,
        device_memory=settings.memory or 64 * 2**30,
        optimizer="adamw",
        stages=[world_size],
        schedules=("1f1b",),
        microbatches=[settings.microbatches],
        backend=backend,
        probe_result=probe,
    )


def _estimate(plan, strategy: str):
    if strategy.startswith("fsdp"):
        keep = strategy == "fsdp_reshard"
        rows = [
            e for e in plan.estimates if e.strategy == "fsdp" and e.options.get("reshard_after_forward", True) == keep
        ]
    else:
        rows = [e for e in plan.estimates if e.strategy == strategy]
    return min(rows, key=lambda e: e.step_s) if rows else None


def _blocks_per_unit(plan, strategy: str) -> int:
    estimate = _estimate(plan, strategy) if strategy.startswith("fsdp") else None
    return estimate.options.get("blocks_per_unit", 1) if estimate is not None else 1


def _rank_main(rank: int, world_size: int, ctx: BenchContext, settings: ShardSettings) -> BenchReport | None:
    device = launch.rank_device(ctx.backend)
    wires = {"": None}
    gloo = launch.gloo_peer(ctx.backend)
    if gloo is not None:
        wires["_gloo"] = gloo
    plans = settings.plans
    if plans is None:  # an outside launcher's ranks: rank 0 plans before anything is built, the others wait
        backends = {s: dist.get_backend(g) for s, g in wires.items()}
        box = [_plans(settings, world_size, backends) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=gloo)
        plans = box[0]
    trainees = {"no_comm": Trainee("no_comm", settings, None, device)}
    for suffix, group in wires.items():
        for strategy in STRATEGIES:
            units = _blocks_per_unit(plans[suffix], strategy)  # FSDP2 with the plan's units for that wire
            trainees[strategy + suffix] = Trainee(strategy, settings, group, device, units)
    gen = torch.Generator().manual_seed(1)
    everyone = torch.randn(settings.batch * world_size, settings.width, generator=gen).to(device)
    x = everyone.narrow(0, rank * settings.batch, settings.batch)
    _check_one_step(trainees, x, everyone, device)
    memory = {v: _per_rank(t.memory(), device) for v, t in trainees.items() if v in STRATEGIES}
    seconds = launch.time_on_all_ranks(
        {v: (lambda t=t: t.step(x, everyone)) for v, t in trainees.items()}, ctx.plan, device
    )
    for trainee in trainees.values():
        if trainee.sharded is not None:
            trainee.sharded.wait_for_params()
    del trainees
    if rank != 0:
        return None
    return _report(ctx, settings, world_size, seconds, memory, plans, list(wires))


def _plans(settings: ShardSettings, world_size: int, backends: dict[str, str]) -> dict:
    """The plan for each wire (variant suffix -> its backend), the later ones priced on the first's measurements."""
    plans: dict = {}
    for suffix, backend in backends.items():
        plans[suffix] = _plan(settings, world_size, backend, plans[""].probe if plans else None)
    return plans


def _per_rank(memory: dict[str, int], device: torch.device) -> list[dict[str, int]]:
    keys = ("parameters", "gradients", "optimizer_state")
    mine = torch.tensor([memory[k] for k in keys], dtype=torch.int64, device=device)
    values = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(values, mine)
    return [dict(zip(keys, (int(v) for v in t.tolist()), strict=True)) for t in values]


def _report(ctx, settings, world_size, seconds, memory, plans, suffixes) -> BenchReport:
    """``plans``: the planner's estimates for each wire (by variant suffix), made for that wire's backend."""
    rows, goals, footer = [], [], []
    flags = floor_flags("shard", seconds)
    footer += [f"beyond a bound: {flag}" for flag in flags.values()]
    floor = seconds["no_comm"]
    for suffix in suffixes:
        wire, plan = _wire(ctx, suffix), plans[suffix]
        for strategy in STRATEGIES:
            variant = strategy + suffix
            t, mem = seconds[variant], memory[strategy]
            measured = max(sum(m.values()) for m in mem)
            estimate = _estimate(plan, strategy)
            predicted = _predicted_state(estimate, strategy)
            rows.append(
                dict(
                    wire=wire,
                    variant=strategy,
                    step_ms=t * 1e3,
                    x_floor=t / floor,
                    x_ddp=t / seconds["ddp" + suffix],
                    state_mib=measured / 2**20,
                    plan_mib=predicted / 2**20,
                    plan_ms=estimate.step_s * 1e3 if estimate is not None else float("nan"),
                    fits="yes" if estimate is not None and estimate.fits else "no",
                )
            )
        goals.append(
            ZERO2_VS_ZERO1.check(
                seconds["zero2" + suffix] / seconds["zero1" + suffix],
                scope=wire,
                flag=pair_flag(flags, "zero2" + suffix, "zero1" + suffix),
            )
        )
        fsdp = plan.best("fsdp")
        keep = fsdp is not None and not fsdp.options.get("reshard_after_forward", True)
        chosen = ("fsdp_keep" if keep else "fsdp_reshard") + suffix
        goals.append(
            FSDP_VS_DDP.check(
                seconds[chosen] / seconds["ddp" + suffix], scope=wire, detail=chosen, flag=pair_flag(flags, chosen)
            )
        )
        if plan.choice is not None:
            fitting = [s for s in STRATEGIES if (e := _estimate(plan, s)) is not None and e.fits]
            pick = _plan_pick(plan)
            fastest = min(fitting, key=lambda s: seconds[s + suffix])
            goals.append(
                PICK_CONFIRMED.check(
                    seconds[pick + suffix] / seconds[fastest + suffix],
                    scope=wire,
                    reference=f"{fastest} (fastest measured)",
                    detail=f"plan picked {pick}",
                )
            )
        for strategy in STRATEGIES:
            estimate = _estimate(plan, strategy)
            if estimate is not None:
                goals.append(
                    STEP_PREDICTION.check(
                        abs(estimate.step_s / seconds[strategy + suffix] - 1), scope=f"{wire}: {strategy}"
                    )
                )
    plan = plans[""]
    for strategy in STRATEGIES:
        estimate = _estimate(plan, strategy)
        if estimate is None:
            continue
        measured = max(sum(m.values()) for m in memory[strategy])
        goals.append(STATE_PREDICTION.check(abs(_predicted_state(estimate, strategy) / measured - 1), scope=strategy))
    return BenchReport(
        benchmark="shard",
        title=f"sharding strategies, {world_size} ranks: step time and model-state bytes per rank, with the plan",
        columns=[
            Column("wire", "wire", 8),
            Column("variant", "variant", 14),
            Column("step_ms", "step(ms)", 10, ".2f", "ms"),
            Column("x_floor", "x no_comm", 10, ".2f", "x"),
            Column("x_ddp", "x ddp", 8, ".2f", "x"),
            Column("plan_ms", "plan(ms)", 10, ".2f", "ms"),
            Column("state_mib", "state MiB", 11, ".2f", "MiB"),
            Column("plan_mib", "plan MiB", 10, ".2f", "MiB"),
            Column("fits", "fits", 6),
        ],
        rows=rows,
        header={
            "backend": ctx.backend,
            "world size": str(world_size),
            "threads per rank": str(ctx.threads),
            "model": f"{settings.depth} x (Linear({settings.width}) + GELU), AdamW(lr={LR}, weight_decay={WEIGHT_DECAY})",
            "batch": f"{settings.batch} per rank; pipeline: {settings.batch * world_size} in {settings.microbatches} microbatches",
            "no_comm": f"{floor * 1e3:.2f} ms (the floor)",
            **{
                f"plan ({_wire(ctx, suffix)})": f"pick {p.choice} {p.choice_options or ''}; {p.measurement}"
                for suffix, p in plans.items()
            },
            **{
                f"fsdp units ({_wire(ctx, suffix)})": "; ".join(
                    f"{v}: {_blocks_per_unit(p, v)} block(s) a unit" for v in ("fsdp_reshard", "fsdp_keep")
                )
                for suffix, p in plans.items()
            },
            "state": "parameters + gradients + optimizer state on the largest rank after a step (storages once)",
            "timing": f"median of {ctx.rounds} interleaved rounds x {ctx.iters} steps after {ctx.warmup} warm-up",
        },
        footer=footer,
        goals=goals,
        summary={
            "step_ms": {v: t * 1e3 for v, t in seconds.items()},
            "state_bytes_per_rank": memory,
            "plan": plan.to_json(),
            "plans": {_wire(ctx, suffix): p.to_json() for suffix, p in plans.items()},
        },
        plot=PlotSpec("bar", "variant", "x_ddp", series="wire", ylabel="step time / fastpar DDP step"),
    )


def _wire(ctx: BenchContext, suffix: str) -> str:
    """The backend a variant suffix ran on: the run's for "", gloo for "_gloo" (the peer group)."""
    return ctx.backend if not suffix else "gloo"


def _predicted_state(estimate, strategy: str) -> float:
    """The plan's model-state bytes, counted as the measurement counts them: ZeRO's memory report holds its
    persistent buffers (point-to-point scratch, the ZeRO-2 pool) among the gradients."""
    if estimate is None:
        return float("nan")
    extra = estimate.memory.persistent_buffers if strategy in ("zero1", "zero2") else 0
    return estimate.memory.model_state + extra


def _plan_pick(plan) -> str:
    if plan.choice == "fsdp":
        return "fsdp_reshard" if plan.choice_options.get("reshard_after_forward", True) else "fsdp_keep"
    return plan.choice


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("shard")
    group.add_argument("--width", type=int, default=1024, help="features of each Linear (default 1024)")
    group.add_argument("--depth", type=int, default=8, help="blocks of Linear + GELU (default 8)")
    group.add_argument(
        "--batch", type=int, default=None, help="rows per step per rank (default 64; --memory: each model's own)"
    )
    group.add_argument("--microbatches", type=int, default=4, help="the pipeline's microbatches per step (default 4)")
    group.add_argument(
        "--memory",
        action="store_true",
        help="measure each strategy's peak and state + buffers per rank on several models, beside the plan and the "
        "ZeRO paper's figure (no timing)",
    )
    group.add_argument(
        "--models",
        default=None,
        help=f"with --memory: comma-separated, of {', '.join(MODELS)} (default {','.join(DEFAULT_MODELS)}; all: every one)",
    )
    group.add_argument("--tiny", action="store_true", help="with --memory: the models at toy sizes (a quick check)")
    group.add_argument(
        "--checkpointing",
        action="store_true",
        help="with --memory: also each strategy with the repeated blocks' activations checkpointed (ddp+ckpt, ...)",
    )
    group.add_argument(
        "--device-memory", default=None, help="the planner's memory per device, e.g. 64MB (default 64GiB)"
    )


def run(ctx: BenchContext) -> BenchReport | None:
    flags = ctx.flags
    if ctx.nproc == 1:
        raise BenchUsageError("shard compares strategies across ranks: --nproc must be at least 2")
    if flags.batch is not None and flags.batch < 1:
        raise BenchUsageError(f"--batch must be at least 1, got {flags.batch}")
    if flags.memory:
        return _run_memory(ctx)
    if flags.models is not None or flags.tiny or flags.checkpointing:
        raise BenchUsageError("--models, --tiny and --checkpointing choose what --memory measures; add --memory")
    for name in ("width", "depth", "microbatches"):
        if getattr(flags, name) < 1:
            raise BenchUsageError(f"--{name} must be at least 1, got {getattr(flags, name)}")
    memory = None
    if flags.device_memory is not None:
        from ...costmodel.memory_planner import parse_bytes

        try:
            memory = parse_bytes(flags.device_memory)
        except (ValueError, UserError) as exc:
            raise BenchUsageError(f"--device-memory: {exc}") from None
    settings = ShardSettings(flags.width, flags.depth, flags.batch or 64, flags.microbatches, memory)
    world = launch.resolve_world(ctx.nproc, ctx.backend)
    if not world.external:
        # planned as `fastpar plan` plans: in this process before the ranks start, the probe's forked peers standing
        # in for the other ranks (after the timing, rank 0 would probe beside ranks that are still leaving)
        wires = {"": world.backend} | ({"_gloo": "gloo"} if world.backend == "fastpar" else {})
        settings = replace(settings, plans=_plans(settings, world.nproc, wires))
    return launch.run_distributed(_rank_main, ctx, settings)


def _run_memory(ctx: BenchContext) -> BenchReport | None:
    from .shard_memory import MemorySettings, memory_rank_main

    flags = ctx.flags
    text = flags.models or ",".join(DEFAULT_MODELS)
    names = MODELS if text == "all" else tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in names if m not in MODELS]
    if unknown or not names:
        raise BenchUsageError(f"--models: unknown {', '.join(unknown) or 'none given'}; of {', '.join(MODELS)} or all")
    settings = MemorySettings(tuple(dict.fromkeys(names)), flags.batch, flags.tiny, flags.checkpointing)
    return launch.run_distributed(memory_rank_main, ctx, settings)
