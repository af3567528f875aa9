"""ZeRO-1/2 optimizer state as reshardable checkpoint entries: each rank's slice of each parameter's state,
with its global offset, so a checkpoint written at N ranks loads at M (whose padding and cuts differ).

A ZeRO rank owns one contiguous slice of every flat bucket; a slice crosses parameters. Per parameter (by
its name in the model) the elementwise state (``exp_avg``, ``momentum_buffer``: one value per element) is
saved as a 1-D tensor of the parameter's ``numel`` in its memory order (row-major for contiguous
parameters), each rank writing the piece its slice holds (:func:`fastpar.shard.checkpoint.flat_pieces`);
the shared state (``step``) is written by every rank holding a piece (DCP keeps one copy). A parameter
never stepped has no entry, as in a plain optimizer. Nothing is gathered: no rank ever holds more than
its own slices.
"""

from __future__ import annotations

from typing import Any

import torch

from ..shard import checkpoint as sharded
from ..zero import ShardedOptimizer

__all__ = ["load_zero_state", "zero_state"]


def _names(optimizer: ShardedOptimizer) -> dict[int, str]:
    return {id(p): name for name, p in optimizer.model.module.named_parameters()}


def _owners(zb, slot) -> list[tuple[int, int, int]]:
    """Every rank's ``(rank, offset in the parameter, length)`` of ``slot``'s elements in bucket ``zb``."""
    ranges = []
    for rank in range(zb.world_size):
        start, end = rank * zb.shard_numel, (rank + 1) * zb.shard_numel
        a, b = max(slot.offset, start), min(slot.offset + slot.numel, end)
        if a < b:
            ranges.append((rank, a - slot.offset, b - a))
    return ranges


def _shared_of(zb, state: dict[str, Any], slot_index: int, elementwise: set[str]) -> dict[str, Any] | None:
    """The shared state (``step``) of one parameter of this rank's slice; None: never stepped."""
    if zb.shared_by_slot is not None:
        return zb.shared_by_slot.get(slot_index)
    return {k: v for k, v in state.items() if k not in elementwise} if state else None


def zero_state(optimizer: ShardedOptimizer) -> dict[str, Any]:
    """This rank's part of the optimizer's checkpoint, in the nesting of ``get_state_dict``'s optimizer state:
    ``{"state": {name: {key: value}}, "param_groups": [{..., "params": [names]}]}``."""
    optimizer.wait_for_params()
    names, elementwise = _names(optimizer), optimizer._elementwise_keys
    state: dict[str, dict[str, Any]] = {}
    for zb, inner in zip(optimizer._sharded, optimizer._inner, strict=True):
        shard_state = inner.state.get(zb.shard_param, {})
        for slot, a, b in zb.shard_pieces():
            shared = _shared_of(zb, shard_state, slot.index, elementwise)
            if shared is None:
                continue
            entry: dict[str, Any] = {}
            for key, value in shard_state.items():
                if key in elementwise:
                    offset = zb.start + a - slot.offset
                    entry[key] = sharded.flat_pieces(value[a:b], offset, _owners(zb, slot), slot.numel)
            # the parameter's own shared state: where the slice's parameters stepped apart, the slice's own
            # ``step`` is nobody's (partial_step.py keeps theirs per parameter)
            entry.update(shared)
            state[names[id(slot.param)]] = entry
    return {"state": state, "param_groups": _groups(optimizer, names)}


def _groups(optimizer: ShardedOptimizer, names: dict[int, str]) -> list[dict[str, Any]]:
    return [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
        for g in optimizer.param_groups
    ]


def load_zero_state(optimizer: ShardedOptimizer, path, group=None) -> None:
    """Collective: fill ``optimizer``'s slices (and hyperparameters) from checkpoint folder ``path``, written
    by a ZeRO run at any world size. The model's parameters are loaded separately (they are replicated)."""
    optimizer.wait_for_params()
    names, elementwise = _names(optimizer), optimizer._elementwise_keys
    saved = sharded.saved_entries(path)
    keys_of: dict[str, dict[str, Any]] = {}  # parameter name -> {state key: its storage metadata}
    for key, meta in saved.items():
        if len(key) == 4 and key[:2] == ("optim", "state"):
            keys_of.setdefault(key[2], {})[key[3]] = meta
    skeleton: dict[str, dict[str, Any]] = {}
    for zb in optimizer._sharded:
        for slot, a, b in zb.shard_pieces():
            name = names[id(slot.param)]
            entry = {}
            for key, meta in keys_of.get(name, {}).items():
                if key in elementwise:
                    piece = torch.zeros(b - a, dtype=meta.properties.dtype, device=zb.param_flat.device)
                    entry[key] = sharded.flat_pieces(piece, zb.start + a - slot.offset, _owners(zb, slot), slot.numel)
                elif hasattr(meta, "size"):
                    entry[key] = torch.zeros(meta.size, dtype=meta.properties.dtype)
                else:
                    entry[key] = None  # a saved Python value: DCP puts it here
            if entry:
                skeleton[name] = entry
    loaded = {"state": skeleton, "param_groups": _groups(optimizer, names)}
    sharded.load_sharded({"optim": loaded}, path, group)
    for saved_group, group_ in zip(loaded["param_groups"], optimizer.param_groups, strict=True):
        group_.update({k: v for k, v in saved_group.items() if k != "params"})
    for zb, inner in zip(optimizer._sharded, optimizer._inner, strict=True):
        shard_state, zb.shared_by_slot = _shard_state(zb, skeleton, names, elementwise)
        hyper = {k: v for k, v in optimizer.param_groups[zb.group_index].items() if k != "params"}
        inner.load_state_dict(
            {"state": {0: shard_state} if shard_state else {}, "param_groups": [{**hyper, "params": [0]}]}
        )


def _shard_state(zb, loaded, names, elementwise) -> tuple[dict[str, Any] | None, dict[int, dict | None] | None]:
    """One bucket slice's optimizer state from the loaded pieces, as ShardedOptimizer keeps it: one state
    for the slice, plus per-parameter shared state where its parameters stepped apart (partial_step.py)."""
    pieces = zb.shard_pieces()
    entries = {slot.index: loaded.get(names[id(slot.param)]) for slot, _, _ in pieces}
    have = [slot for slot, _, _ in pieces if entries[slot.index]]
    if not have:
        return None, None
    first = entries[have[0].index]
    state: dict[str, Any] = {}
    for key, value in first.items():
        if key in elementwise:
            flat = torch.zeros(zb.shard_numel, dtype=sharded.local_piece(value).dtype, device=zb.param_flat.device)
            for slot, a, b in pieces:
                entry = entries[slot.index]
                if entry:
                    flat[a:b].copy_(sharded.local_piece(entry[key]))
            state[key] = flat
    shared = {
        slot.index: (
            {k: v for k, v in entries[slot.index].items() if k not in elementwise} if entries[slot.index] else None
        )
        for slot, _, _ in pieces
    }
    values = list(shared.values())
    uniform = all(v is not None for v in values) and all(_same(values[0], v) for v in values)
    source = values[0] if uniform else shared[have[0].index]
    state.update({k: (v.clone() if torch.is_tensor(v) else v) for k, v in source.items()})
    state = {k: state[k] for k in first}  # in the optimizer's own key order
    return state, None if uniform else shared


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)
