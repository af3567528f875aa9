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


def _fits(plan: Any, name: str) -> bool | None:
    """Whether the plan says ``name`` fits (None when the plan does not say)."""
    fits = getattr(plan, "fits", None)
    if callable(fits):
        return bool(fits(name))
    for row in getattr(plan, "rows", None) or getattr(plan, "estimates", None) or ():
        row_name = getattr(row, "strategy", None) or getattr(row, "name", None)
        if row_name == name:
            return bool(getattr(row, "fits", True))
    return None


def plan_sharding(
    module: torch.nn.Module,
    example_batch: Any,
    strategy: str,
    budget: int | None,
    rank: int,
    world_size: int,
    device: torch.device,
) -> tuple[str, dict[str, Any]]:
    """Collective: ``(strategy, its options)`` every rank agrees on. ``strategy``: the one asked for ("auto":
    the planner's choice). Raises OptionError on every rank when it can't fit the memory."""
    answer: list[Any] = [None]
    if rank == 0:
        answer[0] = _plan_on_rank0(module, example_batch, strategy, budget, world_size, device)
    if world_size > 1:
        dist.broadcast_object_list(answer, src=0)
    kind, value = answer[0]
    if kind == "error":
        raise OptionError("memory_budget" if budget else "sharding", value)
    return value


def _plan_on_rank0(module, example_batch, strategy, budget, world_size, device) -> tuple[str, Any]:
    from ..costmodel.memory_planner import plan_for_module

    memory = budget or device_memory(device, world_size)
    try:
        plan = plan_for_module(module, example_batch, devices=world_size, device_memory=memory)
    except Exception as exc:  # the plan's own refusal (no strategy fits, a model it can't measure)
        return "error", f"the memory planner refused this run: {exc}"
    print(f"fastpar: memory plan for {world_size} process(es), {memory / 2**30:.2f} GiB each:\n{plan}", flush=True)
    if strategy == "auto":
        if plan.choice is None:
            return "error", (
                f"no sharding strategy fits {memory / 2**30:.2f} GiB per process (the plan above); raise "
                "memory_budget, use more processes (devices), or a smaller batch_size"
            )
        print(f"fastpar: sharding='auto' chose {plan.choice!r}", flush=True)
        return "ok", (plan.choice, dict(plan.choice_options or {}))
    if _fits(plan, strategy) is False:
        return "error", (
            f"sharding={strategy!r} does not fit {memory / 2**30:.2f} GiB per process (the plan above); choose a "
            f"strategy the plan says fits (sharding='auto' picks one), raise memory_budget or use more processes"
        )
    options = dict(plan.choice_options or {}) if plan.choice == strategy else {}
    return "ok", (strategy, options)
