"""The memory plan behind ``sharding="auto"`` and ``memory_budget``: rank 0 asks the planner with a real batch
and the device's memory (or the budget), prints the plan, and every rank gets the same choice -- or the run
is refused before its first step when the strategy asked for can't fit."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from ..user_errors import OptionError


def device_memory(device: torch.device, world_size: int) -> int:
    """Bytes one process may use: the GPU's memory, or on CPU the machine's memory shared by the processes."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(world_size, 1)


# torch optimizer class -> the planner's name for its state (unknown classes: AdamW's two moments, the most)
_OPTIMIZERS = {"AdamW": "adamw", "Adam": "adam", "SGD": "sgd"}


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    name = _OPTIMIZERS.get(type(optimizer).__name__, "adamw")
    if name == "sgd" and any(g.get("momentum", 0) for g in optimizer.param_groups):
        return "sgd-momentum"
    return name


def plan_sharding(
    module: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    objective: Any,
    example_batch: Any,
    strategy: str,
    budget: int | None,
    rank: int,
    world_size: int,
    device: torch.device,
    **planner: Any,
) -> tuple[str, dict[str, Any]]:
    """Collective: ``(strategy, its options)`` every rank agrees on; ``module``, ``optimizer`` and ``example_batch``
    (a batch on the device; ``objective``: the run's :class:`~fastpar.train.batches.Objective`) are needed on
    rank 0 only. ``strategy``: the one asked for ("auto": the planner's choice). ``planner``: the planner's own
    keywords (:func:`~fastpar.costmodel.memory_planner.plan`): ``activation_checkpointing`` (None: priced with and
    without; an answer with ``{"activation_checkpointing": True}`` in its options fits only so) and
    ``fsdp_blocks_per_unit`` (None: it prices groupings of blocks). Raises OptionError on every rank when it can't
    fit the memory."""
    answer: list[Any] = [None]
    if rank == 0:
        answer[0] = _plan_on_rank0(
            module, optimizer, objective, example_batch, strategy, budget, world_size, device, planner
        )
    if world_size > 1:
        dist.broadcast_object_list(answer, src=0)
    kind, value = answer[0]
    if kind == "error":
        raise OptionError("memory_budget" if budget else "sharding", value)
    return value


def _plan_on_rank0(
    module, optimizer, objective, example_batch, strategy, budget, world_size, device, planner
) -> tuple[str, Any]:
    from ..costmodel.memory_planner import STRATEGIES, plan_for_module

    memory = budget or device_memory(device, world_size)
    try:
        probed, inputs, loss = objective.for_planner(module, example_batch)  # module(inputs), then loss
        plan = plan_for_module(
            probed,
            inputs,
            loss=loss,
            devices=world_size,
            device_memory=memory,
            optimizer=optimizer_kind(optimizer),
            device=device.type,
            backend=_cpu_backend(device),
            **planner,
            # a pipeline's last stage computes loss_fn(outputs, targets): not a choice for the other loss forms
            strategies=STRATEGIES if objective.takes_pairs else [s for s in STRATEGIES if s != "pipeline"],
        )
    except Exception as exc:  # the planner's own refusal (a model it can't measure, an option out of range)
        return "error", f"the memory planner could not plan this run: {exc}"
    print(f"fastpar: memory plan ({_gib(memory)} per process):\n{plan.table()}", flush=True)
    if strategy == "auto":
        if plan.choice is None:
            return "error", (
                f"no sharding strategy fits {_gib(memory)} per process ({plan.advice}); raise memory_budget, "
                "use more processes (devices) or a smaller batch_size"
            )
        print(f"fastpar: sharding='auto' chose {plan.choice!r} {plan.choice_options or ''}".rstrip(), flush=True)
        return "ok", (plan.choice, dict(plan.choice_options or {}))
    best = plan.best(strategy)
    if best is not None and not best.fits:
        others = [e.strategy for e in plan.estimates if e.fits]
        instead = f"sharding={others[0]!r} or 'auto'" if others else "more processes (devices) or a smaller batch_size"
        return "error", (
            f"sharding={strategy!r} needs {_gib(best.memory.total)} per process, more than the "
            f"{_gib(plan.usable_memory)} usable of memory_budget={_gib(memory)} (the plan above); use {instead}, "
            "or raise memory_budget"
        )
    return "ok", (strategy, dict(best.options) if best is not None else {})


def _cpu_backend(device: torch.device) -> str | None:
    """The CPU ranks' backend ("gloo" or "fastpar"), whose measured profile prices the plan's collectives."""
    if device.type != "cpu" or not dist.is_initialized():
        return None
    from ..costmodel.planner_comm import CPU_BACKENDS

    name = str(dist.get_backend())
    return name if name in CPU_BACKENDS else None


def _gib(n: float) -> str:
    from ..costmodel.plan_result import fmt_bytes

    return fmt_bytes(n)
