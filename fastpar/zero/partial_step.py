"""Stepping a shard whose parameters have different histories: some without a gradient this step.

torch's optimizers skip a parameter whose ``.grad`` is None (no rank used it since ``zero_grad``): its value and
state stay as they are, and its shared state (AdamW's ``step`` count, hence its bias correction) falls behind
the other parameters'. A shard is one flat tensor with one ``step``, so while every parameter in it steps alike
it is stepped as one (the common case); once they differ, the shard is stepped in runs of consecutive
parameters with the same shared state, each run with its own -- its elementwise state as views of the shard's,
so the arithmetic is the per-parameter optimizer's. A parameter never stepped has no state (the optimizer
initialises it on its first step, as torch does).
"""

from __future__ import annotations

from typing import Any

import torch

from .layout import ShardedBucket

__all__ = ["step_shard"]

_FRESH = None  # a parameter never stepped: no state yet


def step_shard(zb: ShardedBucket, inner: torch.optim.Optimizer, with_grad: set[int], elementwise: set[str]) -> None:
    """One optimizer step on this rank's shard of ``zb``, skipping the parameters not in ``with_grad``."""
    pieces = zb.shard_pieces()  # (slot, start, end) within the shard
    stepping = [slot.index in with_grad for slot, _, _ in pieces]
    if zb.shared_by_slot is None:
        if all(stepping):
            inner.step()
            return
        if not any(stepping):
            return
        state = inner.state.get(zb.shard_param)
        shared = {k: v for k, v in state.items() if k not in elementwise} if state else _FRESH
        zb.shared_by_slot = {slot.index: _copy(shared) for slot, _, _ in pieces}
    runs: list[tuple[int, int, list[int]]] = []  # (start, end, slot indices) with the same shared state
    for (slot, a, b), steps in zip(pieces, stepping, strict=True):
        if not steps:
            continue
        key = _key(zb.shared_by_slot[slot.index])
        if runs and runs[-1][1] == a and _key(zb.shared_by_slot[runs[-1][2][0]]) == key:
            runs[-1] = (runs[-1][0], b, runs[-1][2] + [slot.index])
        else:
            runs.append((a, b, [slot.index]))
    for a, b, members in runs:
        shared = _step_run(zb, inner, a, b, zb.shared_by_slot[members[0]], elementwise)
        for index in members:
            zb.shared_by_slot[index] = _copy(shared)
    keys = {_key(zb.shared_by_slot[slot.index]) for slot, _, _ in pieces}
    if len(keys) == 1 and _FRESH not in keys:  # alike again: one step per shard from now on
        inner.state[zb.shard_param].update(_copy(zb.shared_by_slot[pieces[0][0].index]))
        zb.shared_by_slot = None


def _step_run(
    zb: ShardedBucket, inner: torch.optim.Optimizer, a: int, b: int, shared: dict | None, elementwise: set[str]
) -> dict[str, Any]:
    """Step elements ``[a, b)`` of the shard with ``shared`` state (None: fresh); returns the new shared state."""
    view = torch.nn.Parameter(zb.shard_param.detach().narrow(0, a, b - a))  # the shard's memory
    view.grad = zb.grad_shard.narrow(0, a, b - a)
    full = inner.state.get(zb.shard_param)
    state: dict[str, Any] = {}
    if shared is not _FRESH:
        state = {k: v.narrow(0, a, b - a) for k, v in full.items() if k in elementwise}
        state.update(_copy(shared))
    group = inner.param_groups[0]
    params = group["params"]
    group["params"] = [view]
    inner.state[view] = state
    try:
        inner.step()
    finally:
        group["params"] = params
        new = inner.state.pop(view)
    if shared is _FRESH:  # the optimizer made fresh state for the run: it becomes part of the shard's
        if full is None or not full:
            full = inner.state[zb.shard_param] = {}
        for k, v in new.items():  # in the optimizer's key order: state_dict() and checkpoints take it from here
            if k in elementwise:
                if k not in full:
                    full[k] = torch.zeros(zb.shard_numel, dtype=v.dtype, device=v.device)
                full[k].narrow(0, a, b - a).copy_(v)
            elif k not in full:
                # the shard's state has every key the optimizer keeps, shared ones (``step``) included; while its
                # parameters step apart each has its own value in ``shared_by_slot``, so this one is a placeholder
                # until they are alike again
                full[k] = v.clone() if torch.is_tensor(v) else v
    return {k: v for k, v in new.items() if k not in elementwise}


def _copy(shared: dict | None) -> dict | None:
    if shared is None:
        return None
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in shared.items()}


def _key(shared: dict | None):
    if shared is None:
        return _FRESH
    return tuple(sorted((k, repr(v.tolist()) if torch.is_tensor(v) else repr(v)) for k, v in shared.items()))
