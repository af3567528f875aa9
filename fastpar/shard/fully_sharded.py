"""Fully sharded (ZeRO-3) training: a model turned into FSDP2 units with fastpar's policies.

The sharding itself is torch's ``fully_shard`` (``torch.distributed.fsdp``): each parameter becomes a
DTensor holding this rank's rows; a unit all-gathers its parameters before its forward and backward and
reduce-scatters its gradients after its backward, on any process group backend (gloo, the fastpar backend,
NCCL). fastpar decides what torch leaves to the caller: which modules are units (:mod:`.wrap_policy`), the
precision (:mod:`.precision`), building on the meta device so no rank holds the full model
(:mod:`.meta_init`), resharding and prefetching, and reports the bytes a rank holds.

The optimizer is a plain torch optimizer over ``model.parameters()`` (DTensors): each rank steps its shard.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..costmodel.fsdp_units import check_blocks_per_unit, group_units
from ..tensor_storage import storage_bytes
from .meta_init import InitFn, build_on_meta, materialize_shards
from .precision import PrecisionSpec, precision_policy
from .wrap_policy import WrapPolicy, select_units

ModelOrBuilder = nn.Module | Callable[[], nn.Module]


def fully_shard_model(
    model_or_builder: ModelOrBuilder,
    *,
    group: dist.ProcessGroup | None = None,
    wrap: WrapPolicy = "auto",
    mixed_precision: PrecisionSpec = None,
    reshard_after_forward: bool | int = True,
    device: torch.device | str | None = None,
    seed: int = 0,
    init_fn: InitFn | None = None,
    prefetch: int | None = None,
    blocks_per_unit: int = 1,
) -> nn.Module:
    """Shard a model over ``group`` with FSDP2 and return it (the same module object, now an ``FSDPModule``).

    - ``model_or_builder``: a callable building the model is called under ``torch.device("meta")`` after
      ``torch.manual_seed(seed)``; only this rank's shards are then materialised on ``device``, with the
      values the full model built eagerly from ``seed`` would hold (see :mod:`fastpar.shard.meta_init`).
      A module already built is sharded in place (``seed`` is unused; ``init_fn``, if given, is applied
      with ``model.apply`` before sharding).
    - ``group``: the process group to shard over (default: the world).
    - ``wrap``: which modules become units (:func:`~fastpar.shard.select_units`): ``"auto"`` (repeated
      blocks), block classes or class names, a minimum parameter count, ``"root"``, or a callable.
    - ``mixed_precision``: ``None``, ``"bf16"``, ``"fp16"`` (GPUs) or a ``MixedPrecisionPolicy``; its
      ``output_dtype`` applies to the root (the model's output), the units pass activations on in the
      compute dtype.
    - ``reshard_after_forward``: free each unit's gathered parameters after its forward (``True``: least
      memory, one more all-gather per unit in backward), keep them (``False``: ZeRO-2-like memory, fewer
      collectives), or an ``int``: reshard to groups of that many ranks (a divisor of the group size).
      With ``True`` the root and the last unit to run keep their parameters after forward: backward starts
      with them, so resharding them would only gather them again.
    - ``device``: where the shards live; default: the model's device, else the current CUDA device on
      NCCL, else the CPU.
    - ``init_fn``: ``init_fn(module)`` for every module after ``reset_parameters()``, as ``model.apply`` calls it.
    - ``prefetch``: all-gather the next ``prefetch`` units explicitly while one unit computes, forward and
      backward, in the order the units run (0: torch's implicit backward prefetch only). ``None`` (default): 1
      on CPU ranks, where the gathers ahead are issued asynchronously (``async_op=True``; CPU tensors have no
      streams, so without it nothing overlaps), 0 on GPUs, where torch's streams overlap them already.

    - ``blocks_per_unit``: group this many consecutive units of one container (``wrap``'s blocks) into one FSDP2
      unit (``fully_shard([a, b])``): one all-gather and one reduce-scatter for them together. Fewer collectives,
      each unit's fixed cost paid fewer times; more gathered at once. The results are the same bit for bit.
      ``fastpar.plan`` prices the groupings and ``TrainingOptions(sharding="auto")`` uses the fastest that fits.

    The order the units run in is recorded at the first forward (``model._fastpar_unit_order``, a grouped unit named
    by its blocks joined with ``+``): where it is not the registration order (an encoder-decoder registered
    decoder first, a ``ModuleDict``), the prefetch lists and the unit kept after forward follow it from then on. A unit that runs twice or not at all in that forward
    leaves the registration order in place.

    On gloo, parameters are all-gathered and gradients reduce-scattered by point-to-point exchanges
    (:mod:`.gloo_exchange`): faster there, and the same sums bit for bit as gloo's all-reduce.

    Raises ``ValueError`` (:class:`~fastpar.shard.WrapError` for the units) before anything is sharded when
    the model, the units or the precision can't work, saying what to change.
    """
    from torch.distributed.fsdp import fully_shard

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "fully_shard_model needs a process group: call torch.distributed.init_process_group first "
            '("fastpar" or "gloo" for CPU ranks, "nccl" for GPUs), or use fastpar.Trainer'
        )
    group = group if group is not None else dist.group.WORLD
    _check_reshard(reshard_after_forward, dist.get_world_size(group))
    if prefetch is not None and (not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0):
        raise ValueError(f"prefetch={prefetch!r}: give the number of units to all-gather ahead (0 or more), or None")
    check_blocks_per_unit(blocks_per_unit)

    on_meta = not isinstance(model_or_builder, nn.Module)
    if on_meta:
        if not callable(model_or_builder):
            raise TypeError(
                f"fully_shard_model takes a torch.nn.Module or a callable that builds one, "
                f"got {type(model_or_builder).__name__}"
            )
        device = _resolve_device(device, None, group)
        policy = precision_policy(mixed_precision, device)  # checked before building anything
        torch.manual_seed(seed)
        model, record = build_on_meta(model_or_builder, init_fn)  # init_fn is recorded with the construction
    else:
        model = model_or_builder
        if any(t.is_meta for t in model.parameters()):
            raise ValueError(
                "the model's parameters are on the meta device: pass the function that builds it instead, and "
                "fully_shard_model materialises this rank's shards"
            )
        device = _resolve_device(device, model, group)
        policy = precision_policy(mixed_precision, device)
    units = select_units(model, wrap)
    groups = group_units(units[:-1], blocks_per_unit)
    if not on_meta and init_fn is not None:
        model.apply(init_fn)

    mesh = _mesh(group, device)
    members = [[model.get_submodule(name) for name in group] for group in groups]
    inner = [group[0] for group in members]  # a group's modules share one FSDP2 state: set through the first
    # The output dtype applies where the model's output leaves: between units activations stay in the compute
    # dtype (a unit whose output were cast back would hand the next unit inputs its parameters don't match).
    unit_policy = dataclasses.replace(policy, output_dtype=None)
    for i, unit in enumerate(members):
        # The last unit's backward follows its forward at once: resharding it would only gather it again.
        keep = reshard_after_forward is True and i == len(members) - 1
        fully_shard(
            unit if len(unit) > 1 else unit[0],
            mesh=mesh,
            reshard_after_forward=False if keep else reshard_after_forward,
            mp_policy=unit_policy,
        )
    # torch's default for the root (None) keeps it gathered after forward: backward needs it first.
    root_reshard = None if reshard_after_forward is True else reshard_after_forward
    fully_shard(model, mesh=mesh, reshard_after_forward=root_reshard, mp_policy=policy)
    if dist.get_backend(group) == "gloo":
        from .gloo_exchange import PointToPointAllGather, PointToPointReduceScatter

        for unit in [*inner, model]:
            unit.set_custom_reduce_scatter(PointToPointReduceScatter())
            unit.set_custom_all_gather(PointToPointAllGather())
    if on_meta:
        materialize_shards(model, record, device, group=group)
    if prefetch is None:  # CPU ranks have no streams: only an asynchronous gather ahead overlaps with compute
        prefetch = 1 if device.type == "cpu" else 0
    if prefetch:
        _set_prefetch(inner, prefetch)
        if device.type == "cpu":  # a synchronous prefetch on CPU would only move the wait
            model._set_unshard_async_op(True)
    _follow_execution_order(
        model, members, ["+".join(g) for g in groups], prefetch, keep_last=reshard_after_forward is True
    )
    return model


def _check_reshard(reshard_after_forward: bool | int, world: int) -> None:
    if isinstance(reshard_after_forward, bool):
        return
    if not isinstance(reshard_after_forward, int) or reshard_after_forward < 1 or world % reshard_after_forward:
        raise ValueError(
            f"reshard_after_forward={reshard_after_forward!r}: give True, False, or a number of ranks that divides "
            f"the group's {world}"
        )


def fsdp_memory_report(model: nn.Module) -> dict[str, int]:
    """This rank's bytes of the fully sharded model's ``"parameters"`` (its shards, FSDP2's padding included)
    and ``"gradients"`` (the shards of ``.grad`` after a backward, 0 after ``zero_grad()``), counted from the
    local tensors' storages (a storage shared by several tensors counts once)."""
    return {
        "parameters": storage_bytes(p for p in model.parameters()),
        "gradients": storage_bytes(p.grad for p in model.parameters() if p.grad is not None),
    }


def _resolve_device(device, model: nn.Module | None, group) -> torch.device:
    if device is not None:
        return torch.device(device)
    if model is not None:
        first = next(model.parameters(), None)
        if first is not None and first.device.type != "cpu":
            return first.device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _mesh(group, device: torch.device):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, device.type)


def _follow_execution_order(
    model: nn.Module, members: list[list[nn.Module]], names: list[str], prefetch: int, keep_last: bool
) -> None:
    """At the first forward, record the order the units (``members``: each unit's modules) run in; where it is not
    the registration order, prefetch in that order and keep the unit that runs last gathered after forward
    (instead of the last registered)."""
    inner = [group[0] for group in members]
    ran: list[int] = []

    def entered(i: int) -> None:
        if not ran or ran[-1] != i:  # a grouped unit's modules one after another: the unit ran once
            ran.append(i)

    handles = [
        module.register_forward_pre_hook(lambda _m, _a, i=i: entered(i))
        for i, group in enumerate(members)
        for module in group
    ]

    def start(_module, _args) -> None:
        ran.clear()  # a forward that raised before its end recorded part of an order

    def done(_module, _args, _output) -> None:
        for handle in (*handles, *roots):
            handle.remove()
        if sorted(ran) != list(range(len(inner))):
            return  # a unit ran twice or not at all: no single order to follow, the registration order stays
        model._fastpar_unit_order = [names[i] for i in ran]
        if ran == sorted(ran):
            return
        order = [inner[i] for i in ran]
        if prefetch:
            for unit in inner:
                unit.set_modules_to_forward_prefetch([])
                unit.set_modules_to_backward_prefetch([])
            _set_prefetch(order, prefetch)
        if keep_last:  # takes effect from the next forward (this one kept the last registered unit)
            inner[-1].set_reshard_after_forward(True, recurse=False)
            order[-1].set_reshard_after_forward(False, recurse=False)

    roots = [model.register_forward_pre_hook(start), model.register_forward_hook(done)]


def _set_prefetch(units: list[nn.Module], depth: int) -> None:
    """Explicit prefetch: unit i gathers units i+1..i+depth in forward, and i-1..i-depth in backward."""
    for i, unit in enumerate(units):
        ahead = units[i + 1 : i + 1 + depth]
        if ahead:
            unit.set_modules_to_forward_prefetch(ahead)
        behind = list(reversed(units[max(0, i - depth) : i]))
        if behind:
            unit.set_modules_to_backward_prefetch(behind)
