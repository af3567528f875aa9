"""Building a model on the meta device and materialising only this rank's shards, with exactly the values
that building the full model eagerly with the same seed would have given.

The reference is what a user writes without sharding::

    torch.manual_seed(seed)
    with torch.device(device):
        model = build()          # every layer's reset_parameters() draws from the global RNG
    if init_fn is not None:
        model.apply(init_fn)     # post-order, as Module.apply goes

Sharded, ``build()`` runs under ``torch.device("meta")`` (no memory), FSDP2 shards the meta parameters, and
``to_empty`` gives each rank uninitialised storage for its shards only. Then the initialisation is replayed:

1. every module that owns parameters or buffers directly and has ``reset_parameters()`` is visited in
   post-order (the order in which torch's layers initialise while a model is constructed: a parent runs its
   own ``reset_parameters`` after its children are built). Each of its parameters is swapped for a
   full-size scratch tensor on the device, ``reset_parameters()`` fills them from the global RNG, exactly
   as in the reference, and this rank keeps its rows; the scratch is dropped.
2. with ``init_fn``, every module again in post-order: its parameters' full values are all-gathered
   (``full_tensor()``, so an ``init_fn`` that overwrites only some of them keeps the rest), ``init_fn``
   runs on them, and this rank keeps its rows.

Why replay rather than a per-parameter generator: the reference draws every tensor in full from the one
global RNG, so a rank's rows of a tensor depend on every draw before it; only drawing the same full tensors
in the same order reproduces them bit for bit. Every rank draws every tensor (the compute is repeated N
times, once, at start), but holds at most **one module's own parameters in full** at a time, plus its
shards: peak = model / N + the largest module's direct parameters (an embedding or a Linear), never the
model. The global RNG ends in the reference's state, so dropout and data drawn afterwards match too.

What this needs from a model (else it is refused with the tensors named): every parameter and floating
buffer is set by some module's ``reset_parameters()`` or by ``init_fn`` (``init_fn(module)`` sets the
module's own tensors, as functions given to ``Module.apply`` do). A buffer computed in ``__init__`` (rotary
tables) is not replayable: fill it in ``init_fn`` or pass the model built eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

InitFn = Callable[[nn.Module], None]


def build_on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` under ``torch.device("meta")``: the module tree with shapes and dtypes, no storage."""
    with torch.device("meta"):
        model = build()
    if not isinstance(model, nn.Module):
        raise TypeError(f"the builder returned {type(model).__name__}, not a torch.nn.Module")
    real = [name for name, t in _named_tensors(model) if not t.is_meta]
    if real:
        raise ValueError(
            f"the builder put {real[:3]} on a real device (an explicit device= inside it?): building on meta "
            f"would materialise them in full on every rank. Create tensors without a device argument"
        )
    return model


def build_eager(
    build: Callable[[], nn.Module], *, device: torch.device | str = "cpu", seed: int = 0, init_fn: InitFn | None = None
) -> nn.Module:
    """The reference: the full model built on ``device`` from ``seed`` (what a rank without sharding holds)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = build()
    if init_fn is not None:
        model.apply(init_fn)
    return model


def materialize_shards(
    model: nn.Module, device: torch.device, *, init_fn: InitFn | None = None, group: object = None
) -> None:
    """Give the meta parameters of a model already sharded by ``fully_shard`` storage on ``device`` for this
    rank's shards only, and initialise them as the eager reference would (the caller seeded the global RNG
    before building, as the reference does)."""
    model.to_empty(device=device)
    _poison(model)
    covered: set[int] = set()
    modules = _post_order(model)
    for _, module in modules:
        if _owns_tensors(module) and callable(getattr(module, "reset_parameters", None)):
            with _full_size_parameters(module, gather=False):
                module.reset_parameters()
            covered.update(id(t) for _, t in _own_tensors(module))
    if init_fn is not None:
        for _, module in modules:
            with _full_size_parameters(module, gather=True):
                init_fn(module)
            covered.update(id(t) for _, t in _own_tensors(module))
    _check_initialised(model, covered, init_fn is not None, group)


def device_of(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (local shard for a sharded model)."""
    return _local(next(model.parameters())).device


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters()
    yield from model.named_buffers()


def _post_order(module: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    out: list[tuple[str, nn.Module]] = []
    for name, child in module.named_children():
        out.extend(_post_order(child, f"{prefix}.{name}" if prefix else name))
    out.append((prefix, module))
    return out


def _own_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    own = [(n, p) for n, p in module._parameters.items() if p is not None]
    own += [(n, b) for n, b in module._buffers.items() if b is not None]
    return own


def _owns_tensors(module: nn.Module) -> bool:
    return bool(_own_tensors(module))


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def _poison(model: nn.Module) -> None:
    """NaN in every floating tensor (so a tensor no initialiser wrote is caught), zero in the integer ones
    (the value torch's integer buffers, such as BatchNorm's batch counter, start at)."""
    for _, t in _named_tensors(model):
        local = _local(t)
        local.fill_(float("nan") if local.is_floating_point() or local.is_complex() else 0)


def _rows_of_this_rank(full: torch.Tensor, sharded: torch.Tensor) -> torch.Tensor:
    """This rank's rows of ``full`` under FSDP2's dim-0 sharding (torch.chunk: ceil(n / N) rows a rank, the last
    ranks shorter or empty)."""
    from torch.distributed.tensor import Shard

    placements = tuple(sharded.placements)
    if placements != (Shard(0),):
        raise NotImplementedError(f"materialising a parameter placed as {placements}; FSDP2's default is Shard(0)")
    mesh = sharded.device_mesh
    world, rank = mesh.size(), mesh.get_local_rank()
    n = full.size(0)
    chunk = -(-n // world)
    start = min(rank * chunk, n)
    rows = full[start : min(start + chunk, n)]
    local = sharded.to_local()
    if rows.shape != local.shape:  # torch changed its sharding: refuse rather than write wrong rows
        raise RuntimeError(f"rows {tuple(rows.shape)} of a {tuple(full.shape)} tensor vs local shard {local.shape}")
    return rows


@contextmanager
def _full_size_parameters(module: nn.Module, *, gather: bool) -> Iterator[None]:
    """Swap ``module``'s own sharded parameters for full-size tensors for the duration, then keep this rank's
    rows. ``gather``: start from the current full values (all-gathered); else uninitialised scratch."""
    from torch.distributed.tensor import DTensor

    swapped: dict[str, DTensor] = {}
    for name, p in list(module._parameters.items()):
        if isinstance(p, DTensor):
            if gather:
                full = p.full_tensor().detach().clone()  # collective: every rank visits modules in one order
            else:
                full = torch.full(p.shape, float("nan"), dtype=p.dtype, device=p.to_local().device)
            module._parameters[name] = nn.Parameter(full, requires_grad=p.requires_grad)
            swapped[name] = p
    try:
        yield
    finally:
        with torch.no_grad():
            for name, sharded in swapped.items():
                full = module._parameters[name]  # reset_parameters may have assigned a new Parameter
                sharded.to_local().copy_(_rows_of_this_rank(full.detach(), sharded))
                module._parameters[name] = sharded


def _check_initialised(model: nn.Module, covered: set[int], have_init_fn: bool, group: object) -> None:
    missing = []
    for name, t in _named_tensors(model):
        local = _local(t)
        not_set = id(t) not in covered
        if not not_set and (local.is_floating_point() or local.is_complex()):
            not_set = bool(torch.isnan(local).any())
        if not_set:
            missing.append(name)
    # Every rank must raise, or the others would wait in the first step's collective: agree on the verdict.
    import torch.distributed as dist

    flag = torch.tensor([len(missing)], device=device_of(model))
    dist.all_reduce(flag, group=group)  # a sum: every backend has it
    if flag.item() and not missing:
        missing = ["(tensors on another rank)"]
    if missing:
        hint = "" if have_init_fn else " Pass init_fn=fn, called as model.apply(fn) would call it, to set them,"
        raise ValueError(
            f"building on the meta device left {missing[:5]}{' ...' if len(missing) > 5 else ''} uninitialised: no "
            f"reset_parameters() of their module{' or init_fn' if have_init_fn else ''} sets them.{hint} or pass "
            f"the model built eagerly (a module instead of a builder)"
        )
