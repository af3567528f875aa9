"""Building a model on the meta device and materialising only this rank's shards, with exactly the values
that building the full model eagerly with the same seed would have given.

The reference is what a user writes without sharding::

    torch.manual_seed(seed)
    with torch.device(device):
        model = build()          # layers initialise as they are constructed, from the global RNG
    if init_fn is not None:
        model.apply(init_fn)     # post-order, as Module.apply goes

Sharded, ``build()`` (and ``model.apply(init_fn)``) runs under ``torch.device("meta")`` -- no memory -- while
every torch call it makes is recorded (:mod:`.init_record`). FSDP2 shards the meta parameters, ``to_empty``
gives each rank uninitialised storage for its shards only, and the record is replayed on the real device:
the same calls in the same order, so each tensor gets the values and the global RNG the draws of the eager
build -- whatever did the initialising: ``reset_parameters()`` in ``__init__``, modules constructed in
another order than they are registered, a weight tied after construction (the replaced tensor is still
drawn, then dropped), a Hugging Face model's ``post_init``, an ``init_fn`` that touches several modules.
As each model tensor's last call is replayed, this rank keeps its rows and the full value is dropped: a
rank holds its shards plus what the construction has in flight at once (typically one module's own
parameters), never the model.

Why replay rather than a per-parameter generator: the reference draws every tensor in full from the one
global RNG, so a rank's rows of a tensor depend on every draw before it; only drawing the same full tensors
in the same order reproduces them bit for bit. Every rank draws every tensor (the compute is repeated N
times, once, at start).

Refused by name, on every rank, before anything is sharded or drawn: a parameter or buffer the construction
did not make through torch (from NumPy, say); after the replay, a floating tensor no call wrote (made with
``torch.empty`` and never filled).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from .init_record import ConstructionRecord, Unreplayable, named_model_tensors, record_construction

InitFn = Callable[[nn.Module], None]


def build_on_meta(
    build: Callable[[], nn.Module], init_fn: InitFn | None = None
) -> tuple[nn.Module, ConstructionRecord]:
    """``build()`` and ``model.apply(init_fn)`` under ``torch.device("meta")``, recorded: the module tree with
    shapes and dtypes, no storage, and the calls that give it its values."""
    model, record = record_construction(build, init_fn)
    if not isinstance(model, nn.Module):
        raise TypeError(f"the builder returned {type(model).__name__}, not a torch.nn.Module")
    real = [name for name, t in _named_tensors(model) if not t.is_meta]
    if real:
        raise ValueError(
            f"the builder put {real[:3]} on a real device (an explicit device= inside it?): building on meta "
            f"would materialise them in full on every rank. Create tensors without a device argument"
        )
    if record.unmade:
        raise ValueError(
            f"building on the meta device cannot replay how {_listed(record.unmade)} got their values: no torch "
            "call made them (created from NumPy or another library?). Make them with torch, fill them in "
            "init_fn, or pass the model built eagerly (a module instead of a builder)"
        )
    return model, record


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
    model: nn.Module, record: ConstructionRecord, device: torch.device, *, group: object = None
) -> None:
    """Give the meta parameters of a model already sharded by ``fully_shard`` storage on ``device`` for this
    rank's shards only, and the values the eager reference would give them: ``record`` (from
    :func:`build_on_meta`) replayed (the caller seeded the global RNG before building, as the reference does)."""
    from torch.distributed.tensor import DTensor

    model.to_empty(device=device)
    _poison(model)
    final = dict(named_model_tensors(model))

    def keep(name: str, full: torch.Tensor) -> None:
        t = final[name]
        if isinstance(t, DTensor):
            t.to_local().copy_(_rows_of_this_rank(full, t))
        else:
            t.copy_(full)

    try:
        kept = record.replay(device, keep)
    except Unreplayable as exc:
        raise ValueError(
            f"building on the meta device cannot replay the model's construction: it used {exc}. Pass the model "
            "built eagerly (a module instead of a builder)"
        ) from exc
    _check_initialised(model, kept, group)


def _listed(names: list[str]) -> str:
    return f"{names[:5]}{' ...' if len(names) > 5 else ''}"


def device_of(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (local shard for a sharded model)."""
    return _local(next(model.parameters())).device


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters()
    yield from model.named_buffers()


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


def _check_initialised(model: nn.Module, kept: set[str], group: object) -> None:
    missing = []
    for name, t in _named_tensors(model):
        local = _local(t)
        not_set = name not in kept
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
        raise ValueError(
            f"building on the meta device left {_listed(missing)} uninitialised: nothing in the model's "
            "construction or init_fn writes them (made with torch.empty and never filled?). Fill them in "
            "reset_parameters() or init_fn=fn (called as model.apply(fn) would call it), or pass the model built "
            "eagerly (a module instead of a builder)"
        )
