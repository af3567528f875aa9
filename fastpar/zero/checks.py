"""What ZeRO refuses, before the first step, with what to do instead.

A sharded optimizer steps one flat slice per bucket instead of each parameter, so the optimizer must be
*elementwise*: each element's update depends only on that element's gradient and state and on the
group's scalar hyperparameters (SGD, Adam, AdamW, Adagrad, RMSprop, ...). That is checked by running the
class itself, with each group's hyperparameters, on a few small tensors and on the same values as one
flat tensor: an optimizer that looks at whole parameters (shapes, norms, factored moments: Adafactor,
Muon, LARS/LAMB-style trust ratios) gives other numbers or refuses the flat tensor. Optimizers whose
``step`` needs a closure re-evaluating the loss (LBFGS) are refused by their signature.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "check_elementwise",
    "check_parameter_coverage",
    "describe_group",
    "refuse_closure_optimizer",
    "refuse_incompatible_model",
]

_PROBE_SHAPES = ((5, 7), (3,), (2, 3, 4))
_PROBE_STEPS = 3


def describe_group(index: int, names: Sequence[str]) -> str:
    shown = ", ".join(names[:4]) + (f", ... ({len(names) - 4} more)" if len(names) > 4 else "")
    return f"param group {index} ({shown or 'no parameters'})"


def refuse_incompatible_model(model: object, shard_gradients: object) -> None:
    """A fastpar DDP model, and at stage 2 one whose gradients need not be bucket views."""
    from ..ddp.distributed import DistributedDataParallel

    if not isinstance(shard_gradients, bool):
        raise TypeError(f"shard_gradients must be True (ZeRO-2) or False (ZeRO-1), got {shard_gradients!r}")
    stage = "ZeRO-2, shard_gradients=True" if shard_gradients else "ZeRO-1"
    if not isinstance(model, DistributedDataParallel):
        hint = ""
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            hint = " (torch's DistributedDataParallel reduces whole buckets in C++, out of fastpar's reach)"
        raise TypeError(
            f"ShardedOptimizer ({stage}) needs a fastpar.DistributedDataParallel model (it replaces the model's "
            f"all-reduce with a reduce-scatter), got {type(model).__name__}{hint}; wrap the module with "
            "fastpar.DistributedDataParallel instead"
        )
    if shard_gradients and model.reducer.alias_divides:
        raise ValueError(
            "ShardedOptimizer(shard_gradients=True) keeps no full-size gradient bucket, so gradients cannot be "
            "bucket views, but the model was built with gradient_as_bucket_view=True. Leave gradient_as_bucket_view "
            "unset in fastpar.DistributedDataParallel, or use shard_gradients=False (ZeRO-1)"
        )


def refuse_closure_optimizer(optimizer_class: type) -> None:
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}")
    closure = inspect.signature(optimizer_class.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ValueError(
            f"fastpar ZeRO cannot shard {optimizer_class.__name__}: its step() needs a closure that re-evaluates "
            "the loss over whole parameters (e.g. LBFGS's line search). Use an elementwise optimizer (SGD, Adam, "
            "AdamW, ...) with ZeRO, or keep this one unsharded"
        )


def check_elementwise(
    optimizer_class: type,
    hyperparameters: dict[str, Any],
    ctor_kwargs: dict[str, Any],
    group_label: str,
    device: torch.device,
) -> set[str]:
    """Raise ValueError naming ``group_label`` unless ``optimizer_class`` with these hyperparameters updates a
    flat tensor exactly as it updates the same elements as separate parameters (within rounding). Returns
    the state keys that hold one value per element (``exp_avg``, ``momentum_buffer``, ...)."""
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(shape, generator=gen).to(device) for shape in _PROBE_SHAPES]
    grads = [[torch.randn(shape, generator=gen).to(device) for shape in _PROBE_SHAPES] for _ in range(_PROBE_STEPS)]
    separate = [torch.nn.Parameter(v.clone()) for v in values]
    flat = torch.nn.Parameter(torch.cat([v.reshape(-1) for v in values]))
    problem = ""
    fused = None
    try:
        per_param = optimizer_class([{**hyperparameters, "params": separate}], **ctor_kwargs)
        fused = optimizer_class([{**hyperparameters, "params": [flat]}], **ctor_kwargs)
        for step_grads in grads:
            for p, g in zip(separate, step_grads, strict=True):
                p.grad = g.clone()
            flat.grad = torch.cat([g.reshape(-1) for g in step_grads])
            per_param.step()
            fused.step()
        expected = torch.cat([p.detach().reshape(-1) for p in separate])
        if not torch.allclose(flat.detach(), expected, rtol=1e-5, atol=1e-6):
            worst = (flat.detach() - expected).abs().max().item()
            problem = f"stepping one flat tensor gives other values than stepping each parameter (up to {worst:.3g})"
    except Exception as exc:  # the class refused a flat tensor, or these hyperparameters
        problem = f"it cannot step a flat tensor with these hyperparameters ({type(exc).__name__}: {exc})"
    if problem:
        raise ValueError(
            f"fastpar ZeRO cannot shard {group_label} with {optimizer_class.__name__}: {problem}. ZeRO steps one "
            "flat slice per bucket, so the update must be elementwise (as in SGD, Adam, AdamW, Adagrad, RMSprop); "
            "an optimizer that uses whole-parameter shapes or norms must stay unsharded"
        )
    state = fused.state[flat]
    return {key for key, value in state.items() if torch.is_tensor(value) and value.shape == flat.shape}


def check_parameter_coverage(
    group_params: Sequence[Sequence[torch.Tensor]], reduced: dict[int, str], names: dict[int, str]
) -> dict[int, int]:
    """``{id(parameter): group index}`` for every reduced parameter. ``reduced``: id -> name of the parameters
    DDP reduces (trainable); ``names``: id -> name of every model parameter. Frozen parameters in a group
    are allowed (never stepped, as in torch); a parameter that is not the model's, or a reduced one in no
    group, is refused by name."""
    group_of: dict[int, int] = {}
    for index, params in enumerate(group_params):
        labels = [names.get(id(p), "?") for p in params]
        for p in params:
            if id(p) not in names:
                raise ValueError(
                    f"fastpar ZeRO: {describe_group(index, labels)} holds a tensor of shape {list(p.shape)} that is "
                    "not a parameter of the DDP model; ZeRO shards the model's gradient buckets, so every group may "
                    "only hold the model's parameters (optimize other tensors with a separate optimizer)"
                )
            if id(p) in reduced:
                group_of[id(p)] = index
    missing = [name for pid, name in reduced.items() if pid not in group_of]
    if missing:
        shown = ", ".join(missing[:5]) + (f", ... ({len(missing) - 5} more)" if len(missing) > 5 else "")
        raise ValueError(
            f"fastpar ZeRO: {len(missing)} trainable parameter(s) of the model are in no param group: {shown}. ZeRO "
            "reduce-scatters every trainable parameter's gradient, so its optimizer must step them all: add them "
            "to a group, or set requires_grad=False on parameters that should not train"
        )
    return group_of
