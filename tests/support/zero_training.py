"""Training loops shared by the ZeRO tests (imported by spawned ranks): the same seeded model and inputs,
trained with torch's DDP + a plain optimizer, fastpar's DDP + a plain optimizer, or fastpar's DDP +
``ShardedOptimizer`` (``shard_gradients=True``: ZeRO-2)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from ddp_models import MLP, MODELS, make_input  # noqa: E402


class NeverUsed(MLP):
    """The MLP plus a layer no forward uses (found by ``find_unused_parameters=True`` every step)."""

    def __init__(self):
        super().__init__()
        self.never = torch.nn.Linear(16, 8)


class UsedFromStepOne(torch.nn.Module):
    """``NeverUsed`` after a layer every rank uses from step 1 on only (registered first: the start of the
    bucket, rank 0's shard): in step 0 it has no gradient, so it steps once less than the layers beside it in
    its bucket; ``body.never`` is never stepped."""

    def __init__(self):
        super().__init__()
        self.late = torch.nn.Linear(16, 16)
        self.body = NeverUsed()

    def forward(self, x, step=0, rank=0):
        return self.body(x + self.late(x) if step >= 1 else x, step, rank)


MODELS = {**MODELS, "never_used": NeverUsed, "used_from_step_one": UsedFromStepOne}

OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.01}),
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}),
}


def param_groups(module: torch.nn.Module, groups: str):
    """``"one"``: model.parameters(); ``"no_decay_bias"``: weights with weight decay, 1-D tensors without
    (and another lr), the usual transformer recipe -- two groups interleaved in every bucket."""
    if groups == "one":
        return module.parameters()
    decay = [p for p in module.parameters() if p.ndim > 1]
    rest = [p for p in module.parameters() if p.ndim <= 1]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0, "lr": 3e-3}]


def build(
    impl: str,
    kind: str,
    opt: str,
    *,
    groups: str = "one",
    grad_dtype=None,
    exchange: str = "auto",
    overlap: bool = True,
    channels_last: bool = False,
    ddp_args: dict | None = None,
    shard_gradients: bool = False,
    torch_group=None,
):
    """(wrapped model, optimizer) for ``impl`` in torch | fastpar | zero, from seed 0 (``shard_gradients``: zero's
    stage 2; ``torch_group``: the process group of torch's DDP, e.g. gloo when the default group is fastpar's)."""
    import fastpar

    cls, kwargs = OPTIMIZERS[opt]
    torch.manual_seed(0)
    module = MODELS[kind]()
    if channels_last:
        module = module.to(memory_format=torch.channels_last)
    ddp_args = dict(ddp_args or {})
    if impl == "torch":
        model = torch.nn.parallel.DistributedDataParallel(module, process_group=torch_group, **ddp_args)
        return model, cls(param_groups(model.module, groups), **kwargs)
    model = fastpar.DDP(module, grad_dtype=grad_dtype, **ddp_args)
    if impl == "fastpar":
        return model, cls(param_groups(model.module, groups), **kwargs)
    sharded = fastpar.ShardedOptimizer(
        model,
        cls,
        param_groups(model.module, groups),
        exchange=exchange,
        overlap=overlap,
        shard_gradients=shard_gradients,
        **kwargs,
    )
    return model, sharded


def clip(impl: str, model, optimizer, max_norm: float, exact: bool = True) -> float:
    if impl == "zero":
        return optimizer.clip_grad_norm_(max_norm, exact=exact).item()
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()


def train_steps(
    impl: str,
    model,
    optimizer,
    kind: str,
    gen: torch.Generator,
    rank: int,
    steps: int,
    *,
    start: int = 0,
    max_norm: float | None = None,
    exact_clip: bool = True,
    channels_last: bool = False,
    accumulate: int = 1,
    sync_backwards: int = 1,
    torch_clip: bool = False,
) -> list[float]:
    """``steps`` optimizer steps, each of ``accumulate - 1`` backwards under ``no_sync`` then ``sync_backwards``
    synchronised ones (each adds onto the reduced gradient, as autograd onto DDP's ``.grad``); returns the
    gradient norms when clipping (``torch_clip``: with ``torch.nn.utils.clip_grad_norm_`` whatever ``impl``)."""
    norms = []
    for step in range(start, start + steps):
        optimizer.zero_grad()
        for micro in range(accumulate - 1 + sync_backwards):
            x = make_input(kind, gen, channels_last)
            if micro < accumulate - 1:
                with model.no_sync():
                    model(x, step=step, rank=rank).float().square().mean().backward()
            else:
                model(x, step=step, rank=rank).float().square().mean().backward()
        if max_norm is not None:
            norms.append(clip("torch" if torch_clip else impl, model, optimizer, max_norm, exact_clip))
        optimizer.step()
    return norms


def params_of(model) -> dict[str, torch.Tensor]:
    """Parameters (not buffers: BatchNorm statistics differ per rank) after waiting for any gather."""
    module = model.module
    state = module.state_dict()  # waits for in-flight all-gathers (state_dict pre-hooks)
    names = {n for n, _ in module.named_parameters()}
    return {k: v.detach().clone() for k, v in state.items() if k in names}


def run_case(
    rank: int,
    impl: str,
    kind: str,
    opt: str,
    *,
    steps: int = 20,
    max_norm: float | None = None,
    exact_clip: bool = True,
    accumulate: int = 1,
    sync_backwards: int = 1,
    channels_last: bool = False,
    torch_clip: bool = False,
    **build_args,
) -> dict:
    model, optimizer = build(impl, kind, opt, channels_last=channels_last, **build_args)
    gen = torch.Generator().manual_seed(100 + rank)  # inputs differ per rank
    norms = train_steps(
        impl,
        model,
        optimizer,
        kind,
        gen,
        rank,
        steps,
        max_norm=max_norm,
        exact_clip=exact_clip,
        channels_last=channels_last,
        accumulate=accumulate,
        sync_backwards=sync_backwards,
        torch_clip=torch_clip,
    )
    return {"params": params_of(model), "norms": norms}


def resume_case(
    rank: int,
    impl: str,
    kind: str,
    opt: str,
    model_state: dict,
    optimizer_state: dict,
    *,
    steps: int = 10,
    **build_args,
) -> dict:
    """Load a model and a full optimizer state into a fresh ``impl`` run, train ``steps`` more steps."""
    model, optimizer = build(impl, kind, opt, **build_args)
    model.module.load_state_dict(model_state)
    optimizer.load_state_dict(copy.deepcopy(optimizer_state))  # as from a file: torch's optimizers keep the tensors
    gen = torch.Generator().manual_seed(200 + rank)
    train_steps(impl, model, optimizer, kind, gen, rank, steps, start=steps)
    return params_of(model)
