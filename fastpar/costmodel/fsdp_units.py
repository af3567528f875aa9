"""Which modules FSDP2 wraps as units under ``wrap="auto"``, where a parameter shared across units goes, and the
units' sizes: the rules ``fastpar.shard.select_units`` applies and the memory planner prices.

``"auto"`` takes repeated blocks: the children of a ``ModuleList``/``Sequential`` that are two or more
instances of one class with parameters (a transformer's layers, an MLP's Linear stack, also inside a module
with its own ``forward`` such as ``nn.Transformer``), without descending into a block once it is a unit. The
root owns every parameter no unit claims.

``blocks_per_unit`` groups consecutive blocks of one container into one unit (FSDP2's ``fully_shard([a, b])``):
one all-gather and one reduce-scatter for the group. Each unit costs a fixed time whatever its size (hooks,
messages, waits for the peers), so on CPU ranks, where that cost is milliseconds, fewer units are faster -- up to
:data:`CPU_UNIT_BYTES`: glibc serves larger blocks from fresh mappings, so a larger unit's gather buffer and
gradient are page-faulted in again at every step. The planner prices the groupings within that cap that leave at
least two units, and keeps the fastest.
"""

from __future__ import annotations

from torch import nn

__all__ = [
    "CPU_UNIT_BYTES",
    "check_blocks_per_unit",
    "group_units",
    "innermost_unit",
    "place_shared_parameters",
    "repeated_blocks",
    "unit_layout",
    "unit_numels",
]

# glibc's largest mmap threshold on 64-bit hosts (DEFAULT_MMAP_THRESHOLD_MAX): a block above it is mapped afresh
CPU_UNIT_BYTES = 32 * 1024 * 1024


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def repeated_blocks(model: nn.Module) -> list[str]:
    """Qualified names of the children of containers that repeat one parametrised class, in module order."""
    found: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            by_class: dict[type, list[str]] = {}
            for name, child in module.named_children():
                if _has_params(child):
                    by_class.setdefault(type(child), []).append(name)
            repeated = {cls for cls, names in by_class.items() if len(names) >= 2}
            if repeated:
                for name, child in module.named_children():
                    if type(child) in repeated:
                        found.append(f"{prefix}{name}")
                    else:
                        visit(f"{prefix}{name}.", child)
                return
        for name, child in module.named_children():
            visit(f"{prefix}{name}.", child)

    visit("", model)
    return found


def unit_layout(model: nn.Module) -> tuple[list[str], list[int], int]:
    """(each unit's name, each unit's elements, the root's own elements) under ``wrap="auto"``, after a shared
    parameter's placement (:func:`place_shared_parameters`); a tied parameter once, in the unit that holds it."""
    import warnings

    with warnings.catch_warnings():  # fully_shard_model says it when it shards; a plan only counts
        warnings.simplefilter("ignore")
        names = [u for u in place_shared_parameters(model, [*repeated_blocks(model), ""]) if u]
    claimed: set[int] = set()
    units = []
    for name in names:
        params = [p for p in model.get_submodule(name).parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in params)
        units.append(sum(p.numel() for p in params))
    root = sum(p.numel() for p in model.parameters() if id(p) not in claimed)
    return names, units, root


def unit_numels(model: nn.Module) -> tuple[int, list[int]]:
    """(the root unit's own elements, each unit's) under ``wrap="auto"``: :func:`unit_layout` without the names."""
    _, sizes, root = unit_layout(model)
    return root, sizes


def check_blocks_per_unit(blocks_per_unit: object) -> None:
    """Raise ``ValueError`` unless ``blocks_per_unit`` is a count of blocks (an int, 1 or more)."""
    if not isinstance(blocks_per_unit, int) or isinstance(blocks_per_unit, bool) or blocks_per_unit < 1:
        raise ValueError(f"blocks_per_unit={blocks_per_unit!r}: give the number of blocks a unit holds (1 or more)")


def group_units(units: list[str], blocks_per_unit: int) -> list[list[str]]:
    """``units`` (not the root) in groups of up to ``blocks_per_unit`` consecutive siblings: units of one parent
    module, next to each other in ``units``. A group never spans two containers (an encoder's last layer and a
    decoder's first run at different times)."""
    check_blocks_per_unit(blocks_per_unit)
    groups: list[list[str]] = []
    for name in units:
        parent = name.rpartition(".")[0]
        last = groups[-1] if groups else None
        if last is not None and len(last) < blocks_per_unit and last[-1].rpartition(".")[0] == parent:
            last.append(name)
        else:
            groups.append([name])
    return groups


def innermost_unit(module_name: str, unit_set: set[str]) -> str:
    """The innermost of ``unit_set`` around module ``module_name`` (the root ``""`` when none is)."""
    parts = module_name.split(".") if module_name else []
    for cut in range(len(parts), 0, -1):
        candidate = ".".join(parts[:cut])
        if candidate in unit_set:
            return candidate
    return ""


def place_shared_parameters(model: nn.Module, units: list[str]) -> list[str]:
    """``units`` without those that would split a shared parameter: a parameter registered by modules in different
    units (a tied embedding and head wrapped apart, blocks sharing a layer) belongs to their nearest common
    ancestor unit (the root at least), so every unit below it that holds a use is left unwrapped -- a unit frees
    its gathered parameters after its forward, and another unit would compute with a shard. Says so in a
    warning naming the parameter and the units."""
    kept = list(units)
    dropped: dict[str, list[str]] = {}  # unit -> the shared parameters that unwrapped it
    while True:
        unit_set = set(kept)
        users: dict[int, list[tuple[str, str]]] = {}  # id(param) -> [(param name, unit)]
        for module_name, module in model.named_modules(remove_duplicate=False):
            unit = innermost_unit(module_name, unit_set)
            for pname, p in module.named_parameters(recurse=False, remove_duplicate=False):
                users.setdefault(id(p), []).append((f"{module_name}.{pname}" if module_name else pname, unit))
        split = [uses for uses in users.values() if len({unit for _, unit in uses}) > 1]
        if not split:
            break
        for uses in split:
            ancestor = _common_unit([unit for _, unit in uses], unit_set)
            for _, unit in uses:
                if unit != ancestor and unit in kept:
                    kept.remove(unit)
                    dropped.setdefault(unit, []).append(uses[0][0])
    if dropped:
        import warnings

        parts = "; ".join(f"{unit} (shares {', '.join(dict.fromkeys(names))})" for unit, names in dropped.items())
        warnings.warn(
            f"fully_shard_model: not wrapping {parts} as units: a parameter shared with another unit is placed in "
            "their common ancestor unit (the root holds what no wrapped unit does), gathered for its whole forward "
            "and backward. Untie the parameter to shard those modules apart",
            UserWarning,
            stacklevel=3,
        )
    return kept


def _common_unit(units: list[str], unit_set: set[str]) -> str:
    """The innermost unit around every one of ``units`` (the root ``""`` when no other is)."""
    parts = [u.split(".") if u else [] for u in units]
    common = []
    for level in zip(*parts, strict=False):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    return innermost_unit(".".join(common), unit_set)
