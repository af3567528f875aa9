"""Which modules of a model become FSDP2 units, and whether FSDP2 can shard the model that way.

A unit is a module handed to ``fully_shard``: its parameters are all-gathered together before its forward
and backward and reduce-scattered together after its backward. Fewer, larger units mean fewer collectives
(less latency per step); more, smaller units mean less memory held unsharded at a time. The choices:

- ``"auto"``: repeated blocks. The children of a ``ModuleList``/``Sequential`` that are two or more
  instances of one class with parameters (the layers of a transformer, the Linear stack of an MLP); the
  search does not descend into a block once it is a unit. No repeated blocks: the root is the only unit.
- a class, a class name, or a sequence of them: every module of those classes (``wrap=[Block]``).
- an ``int``: every module whose parameters not yet in a smaller unit number at least that many, bottom-up
  (torch's size-based policy).
- ``"root"`` (or ``None``): one unit, the whole model.
- a callable ``module -> bool``.

The root is always a unit, wrapped last (it owns whatever no unit below it claims). Everything FSDP2 would
reject or fail on in the first step is refused here, before anything is sharded: a model without
parameters, a unit class absent from the model, a module that is already sharded. A parameter shared by
modules in different units (a unit frees its gathered parameters after its forward, so the other unit would
compute with a shard) is not refused: it is placed in the nearest unit around all its users, and the units
below that holding a use are left unwrapped (a warning says which).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

# the rules the planner prices too: which blocks "auto" takes, where a shared parameter goes
from ..costmodel.fsdp_units import innermost_unit as _innermost_unit
from ..costmodel.fsdp_units import place_shared_parameters as _place_shared_parameters
from ..costmodel.fsdp_units import repeated_blocks as _repeated_blocks

WrapPolicy = str | int | type | Sequence[type | str] | Callable[[nn.Module], bool] | None


class WrapError(ValueError):
    """The model cannot be fully sharded with the requested units; the message says what to change."""


def select_units(model: nn.Module, wrap: WrapPolicy = "auto") -> list[str]:
    """Qualified names of the modules that become units, in the order to wrap them: every module after the
    units nested in it, the root (``""``) last. Raises :class:`WrapError` for a model FSDP2 can't shard so."""
    _check_model(model)
    if wrap is None or wrap == "root":
        chosen: list[str] = []
    elif wrap == "auto":
        chosen = _repeated_blocks(model)
    elif isinstance(wrap, str):
        chosen = _by_class(model, [wrap])
    elif isinstance(wrap, bool):
        raise WrapError(f"wrap={wrap!r}: give 'auto', 'root', block classes, a parameter count or a callable")
    elif isinstance(wrap, int):
        chosen = _by_size(model, wrap)
    elif isinstance(wrap, type):
        chosen = _by_class(model, [wrap])
    elif isinstance(wrap, Sequence):
        chosen = _by_class(model, list(wrap))
    elif callable(wrap):
        chosen = [name for name, module in model.named_modules() if name and wrap(module)]
    else:
        raise WrapError(f"wrap={wrap!r}: give 'auto', 'root', block classes, a parameter count or a callable")
    units = _wrap_order(model, chosen)
    return _place_shared_parameters(model, units)


def _check_model(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise WrapError(f"expected a torch.nn.Module (or a callable that builds one), got {type(model).__name__}")
    from torch.distributed.fsdp import FSDPModule

    sharded = [name or "<root>" for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if sharded:
        raise WrapError(
            f"module(s) {sharded[:3]} are already sharded by fully_shard; pass the model before sharding it, once"
        )
    if next(model.parameters(), None) is None:
        raise WrapError(
            f"{type(model).__name__} has no parameters: there is nothing to shard. Train it without sharding."
        )


def _has_own_subtree_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _by_class(model: nn.Module, classes: list[type | str]) -> list[str]:
    for cls in classes:
        if not isinstance(cls, (type, str)):
            raise WrapError(f"wrap: {cls!r} is not a module class or a class name")
    wanted = {cls for cls in classes if isinstance(cls, type)} | {cls for cls in classes if isinstance(cls, str)}

    def matches(module: nn.Module) -> bool:
        return type(module) in wanted or type(module).__name__ in wanted

    present = {type(m) for m in model.modules()}
    present_names = {cls.__name__ for cls in present}
    missing = [c if isinstance(c, str) else c.__name__ for c in classes if c not in present and c not in present_names]
    if missing:
        some = sorted(present_names - {"ModuleList", "Sequential", "ModuleDict"})[:12]
        raise WrapError(
            f"wrap: no module of class {missing} in {type(model).__name__}; its module classes are {some}. "
            f"Name one of those, or use wrap='auto'"
        )
    chosen = [name for name, m in model.named_modules() if name and matches(m)]
    empty = [name for name in chosen if not _has_own_subtree_params(model.get_submodule(name))]
    if empty:
        raise WrapError(
            f"wrap: module(s) {empty[:3]} of the requested class(es) have no parameters, so they cannot be units; "
            f"name the blocks that hold the weights"
        )
    return chosen


def _by_size(model: nn.Module, min_params: int) -> list[str]:
    if min_params < 1:
        raise WrapError(f"wrap={min_params}: a parameter count must be at least 1")
    chosen: list[str] = []
    claimed: set[int] = set()

    def visit(prefix: str, module: nn.Module) -> None:  # post-order: smaller units first
        for name, child in module.named_children():
            visit(f"{prefix}{name}.", child)
        name = prefix[:-1]
        if not name:
            return
        free = [p for p in module.parameters() if id(p) not in claimed]
        if sum(p.numel() for p in free) >= min_params:
            chosen.append(name)
            claimed.update(id(p) for p in free)

    visit("", model)
    return chosen


def _wrap_order(model: nn.Module, chosen: list[str]) -> list[str]:
    """Post-order over the model (a unit after the units nested in it), the root last, duplicates dropped."""
    chosen_set = set(chosen) - {""}
    order = [name for name, _ in _post_order(model) if name in chosen_set]
    return [*order, ""]


def _post_order(module: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    out: list[tuple[str, nn.Module]] = []
    for name, child in module.named_children():
        out.extend(_post_order(child, f"{prefix}{name}" if not prefix else f"{prefix}.{name}"))
    out.append((prefix, module))
    return out


def unit_of_each_parameter(model: nn.Module, units: list[str]) -> dict[str, str]:
    """Parameter name -> the unit that owns it (the innermost unit around the module that registers it)."""
    owner: dict[str, str] = {}
    unit_set = set(units)
    for module_name, module in model.named_modules(remove_duplicate=False):
        unit = _innermost_unit(module_name, unit_set)
        for pname, _ in module.named_parameters(recurse=False, remove_duplicate=False):
            owner[f"{module_name}.{pname}" if module_name else pname] = unit
    return owner


def count_parameters(module: nn.Module) -> int:
    """Distinct parameters' elements of ``module`` (a tied parameter counts once)."""
    return sum(p.numel() for p in module.parameters())


def describe_units(model: nn.Module, units: list[str]) -> list[tuple[str, int]]:
    """(unit name, parameter elements the unit owns) in wrap order: what each all-gather moves (unsharded)."""
    owner = unit_of_each_parameter(model, units)
    seen: set[int] = set()
    sizes = dict.fromkeys(units, 0)
    named = dict(model.named_parameters(remove_duplicate=False))
    for name, unit in owner.items():
        p = named[name]
        if id(p) not in seen:
            seen.add(id(p))
            sizes[unit] += p.numel()
    return [(unit, sizes[unit]) for unit in units]
