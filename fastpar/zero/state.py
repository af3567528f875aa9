"""ZeRO checkpoints in the plain optimizer's format: per-parameter state, gathered from the shards, and
loaded back into shards -- for any world size, since a full state knows nothing of the layout.

A shard's state holds *elementwise* entries (one value per element: ``exp_avg``, ``momentum_buffer``,
the same shape as the shard) and *shared* ones (``step``: one value for the whole shard). Gathering
concatenates each elementwise entry's shards and cuts out every parameter (in its own strides, as a
plain optimizer keeps it); a shared entry is given to each parameter of the bucket, or, where the
parameters of a shard stepped apart (some had no gradient in some steps: partial_step.py), each its own,
and a parameter never stepped gets no entry. Loading does the reverse, and keeps per-parameter shared
entries where the parameters of a shard differ in them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .layout import ShardedBucket

__all__ = ["gather_full_state", "shard_state"]


def gather_full_state(
    sharded: Sequence[ShardedBucket],
    inner: Sequence[torch.optim.Optimizer],
    elementwise: set[str],
    index_of: dict[int, int],
    group: dist.ProcessGroup,
    dst: int,
) -> dict[int, dict[str, Any]] | None:
    """Collective: ``{parameter index: state}`` on rank ``dst`` (None on the others). ``index_of``: id of each
    parameter -> its index in the plain optimizer's ``state_dict``; ``elementwise``: the per-element keys. A
    parameter never stepped (no gradient yet) has no entry, as in a plain optimizer."""
    rank, world_size = group.rank(), group.size()
    keys, shared = _agree(sharded, inner, elementwise, group)
    full: dict[int, dict[str, Any]] = {}
    for zb, optimizer, bucket_keys in zip(sharded, inner, keys, strict=True):
        state = optimizer.state.get(zb.shard_param, {})
        per_param: list[dict[str, Any]] = [{} for _ in zb.slots]
        for key, dtype in bucket_keys:
            if dtype is None:  # shared: from the parameter's own entry, below
                continue
            value = state.get(key)
            if value is None:  # this rank's parameters in the bucket were never stepped
                value = torch.zeros(zb.shard_numel, dtype=dtype, device=zb.param_flat.device)
            pieces = [torch.empty_like(value) for _ in range(world_size)] if rank == dst else None
            dist.gather(value.contiguous(), pieces, group=group, group_dst=dst)
            if rank != dst:
                continue
            whole = torch.cat(pieces)
            for entry, slot in zip(per_param, zb.slots, strict=True):
                entry[key] = slot.layout_view(whole).clone()
        if rank != dst:
            continue
        for entry, slot in zip(per_param, zb.slots, strict=True):
            own = shared.get(slot.index)
            if own is None:  # never stepped: no state, as in a plain optimizer
                continue
            ordered = {}  # in the optimizer's own key order
            for key, dtype in bucket_keys:
                if dtype is not None:
                    ordered[key] = entry[key]
                elif key in own:
                    ordered[key] = own[key].clone() if torch.is_tensor(own[key]) else own[key]
            full[index_of[id(slot.param)]] = ordered
    return full if rank == dst else None


def _agree(sharded, inner, elementwise: set[str], group) -> tuple[list[list[tuple[str, torch.dtype | None]]], dict]:
    """Every rank: the state keys of each bucket in the optimizer's order, with the dtype of the elementwise ones
    (None: shared), from any rank that has state; and each parameter's shared state
    (``step``; None: never stepped), from the ranks whose shards hold it -- parameters of one bucket may have
    stepped apart (partial_step.py), and one rank's shard may hold only parameters never stepped."""
    keys: list[dict[str, torch.dtype | None]] = []
    shared: dict[int, dict | None] = {}
    for zb, optimizer in zip(sharded, inner, strict=True):
        state = optimizer.state.get(zb.shard_param, {})
        keys.append({k: v.dtype if k in elementwise else None for k, v in state.items()})
        for slot, _, _ in zb.shard_pieces():
            if zb.shared_by_slot is not None:
                shared[slot.index] = zb.shared_by_slot[slot.index]
            else:
                shared[slot.index] = {k: v for k, v in state.items() if k not in elementwise} if state else None
    everyone: list = [None] * group.size()
    dist.all_gather_object(everyone, (keys, shared), group=group)
    agreed_keys = [dict() for _ in sharded]
    agreed_shared: dict[int, dict | None] = {}
    for their_keys, their_shared in everyone:
        for mine, theirs in zip(agreed_keys, their_keys, strict=True):
            if not mine:
                mine.update(theirs)
        for index, value in their_shared.items():
            if agreed_shared.get(index) is None:
                agreed_shared[index] = value
    return [list(k.items()) for k in agreed_keys], agreed_shared


def shard_state(
    zb: ShardedBucket, full: dict[int, dict[str, Any]], elementwise: set[str], index_of: dict[int, int]
) -> tuple[dict[str, Any] | None, dict[int, dict | None] | None]:
    """This rank's shard of the bucket's state from a full per-parameter ``full`` state: (the shard's state or
    None, the per-parameter shared state or None). The second is given when the parameters in this shard
    differ in their shared entries (``step``) or some have no state -- a plain optimizer that skipped them in
    some steps -- and is what partial_step.py steps them with (``ShardedBucket.shared_by_slot``)."""
    entries = {slot.index: full.get(index_of[id(slot.param)]) for slot in zb.slots}
    have = [slot for slot in zb.slots if entries[slot.index]]
    if not have:
        return None, None
    keys = list(entries[have[0].index])
    for slot in have:
        missing = [k for k in keys if k not in entries[slot.index]] + [k for k in entries[slot.index] if k not in keys]
        if missing:
            raise ValueError(
                f"fastpar ZeRO: the optimizer state of {slot.name} and of {have[0].name} differ in {missing[0]!r} "
                "(one has it, the other not); load the state of this model's optimizer"
            )
    shard: dict[str, Any] = {}
    for key in keys:
        if key not in elementwise:
            continue
        first = entries[have[0].index][key]
        whole = torch.zeros(zb.bucket.numel, dtype=first.dtype, device=zb.param_flat.device)
        for slot in have:
            value = entries[slot.index][key]
            if value.shape != slot.param.shape:
                raise ValueError(
                    f"fastpar ZeRO: the optimizer state {key!r} of {slot.name} has shape {list(value.shape)}, "
                    f"the parameter {list(slot.param.shape)}; load the state of this model's optimizer"
                )
            slot.layout_view(whole).copy_(value)
        shard[key] = zb.region(whole, zb.rank).clone()
    shared_by_slot: dict[int, dict | None] = {}
    for slot, _, _ in zb.shard_pieces():
        entry = entries[slot.index]
        shared_by_slot[slot.index] = {k: _clone(v) for k, v in entry.items() if k not in elementwise} if entry else None
    values = list(shared_by_slot.values())
    uniform = values and all(v is not None for v in values) and all(_same_shared(values[0], v) for v in values)
    source = values[0] if uniform else entries[have[0].index]  # stepping apart, the shard's own is not used
    state = {k: shard[k] if k in elementwise else _clone(source[k]) for k in keys}  # in the optimizer's key order
    return state, None if uniform else shared_by_slot


def _clone(value: Any) -> Any:
    return value.clone() if torch.is_tensor(value) else value


def _same_shared(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)


def _same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) and torch.is_tensor(b):
        return a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))
    return a == b
