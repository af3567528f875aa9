"""Which modules FSDP2 wraps as units under ``wrap="auto"``, and their sizes: the one rule that
``fastpar.shard.select_units`` applies and the memory planner prices.

``"auto"`` takes repeated blocks: the children of a ``ModuleList``/``Sequential`` that are two or more
instances of one class with parameters (a transformer's layers, an MLP's Linear stack, also inside a module
with its own ``forward`` such as ``nn.Transformer``), without descending into a block once it is a unit. The
root owns every parameter no unit claims.
"""

from __future__ import annotations

from torch import nn

__all__ = ["repeated_blocks", "unit_numels"]


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


def unit_numels(model: nn.Module) -> tuple[int, list[int]]:
    """(the root unit's own elements, each repeated block's) under ``wrap="auto"``; a tied parameter once, in
    the first unit that holds it (the root when it is shared with the root's own layers)."""
    claimed: set[int] = set()
    units = []
    for name in repeated_blocks(model):
        params = [p for p in model.get_submodule(name).parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in params)
        units.append(sum(p.numel() for p in params))
    root = sum(p.numel() for p in model.parameters() if id(p) not in claimed)
    return root, units
