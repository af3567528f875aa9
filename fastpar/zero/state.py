"""ZeRO checkpoints in the plain optimizer's format: per-parameter state, gathered from the shards, and
loaded back into shards -- for any world size, since a full state knows nothing of the layout.

A shard's state holds *elementwise* entries (one value per element: ``exp_avg``, ``momentum_buffer``,
the same shape as the shard) and *shared* ones (``step``: one value for the whole shard). Gathering
concatenates each elementwise entry's shards and cuts out every parameter (in its own strides, as a
plain optimizer keeps it); a shared entry is given to each parameter of the bucket. Loading does the
reverse; parameters of one bucket must then agree on their shared entries (a plain optimizer that
skipped some parameters in some steps has different ``step`` counts, which one shard cannot hold).
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
) -> dict[str, Any] | None:
    """This rank's shard of the bucket's state from a full per-parameter ``full`` state; None: no state."""
    entries = [full.get(index_of[id(slot.param)]) for slot in zb.slots]
    have = [slot.name for slot, entry in zip(zb.slots, entries, strict=True) if entry]
    if not have:
        return None
    if len(have) != len(zb.slots):
        lacking = [slot.name for slot, entry in zip(zb.slots, entries, strict=True) if not entry]
        raise ValueError(
            f"fastpar ZeRO: the optimizer state has entries for {have[0]} but none for {lacking[0]}, which "
            f"share a shard (bucket {zb.index}); a shard is stepped as one, so its parameters need state alike. "
            "Was the state saved by an optimizer that skipped some parameters (no gradient) in some steps?"
        )
    keys = list(entries[0])
    shard: dict[str, Any] = {}
    for key in keys:
        values = [entry.get(key) for entry in entries]
        missing = [slot.name for slot, v in zip(zb.slots, values, strict=True) if v is None]
        if missing:
            raise ValueError(f"fastpar ZeRO: the optimizer state of {missing[0]} has no {key!r}, but {have[0]}'s has")
        if key in elementwise:
            whole = torch.zeros(zb.bucket.numel, dtype=values[0].dtype, device=zb.param_flat.device)
            for slot, value in zip(zb.slots, values, strict=True):
                if value.shape != slot.param.shape:
                    raise ValueError(
                        f"fastpar ZeRO: the optimizer state {key!r} of {slot.name} has shape {list(value.shape)}, "
                        f"the parameter {list(slot.param.shape)}; load the state of this model's optimizer"
                    )
                slot.layout_view(whole).copy_(value)
            shard[key] = zb.region(whole, zb.rank).clone()
            continue
        first = values[0]
        for slot, value in zip(zb.slots, values, strict=True):
            if not _same(first, value):
                raise ValueError(
                    f"fastpar ZeRO: the optimizer state {key!r} is {_show(first)} for {zb.slots[0].name} but "
                    f"{_show(value)} for {slot.name}; they share a shard (bucket {zb.index}), which holds one "
                    f"{key!r}. Was the state saved by an optimizer that skipped some parameters in some steps?"
                )
        shard[key] = first.clone() if torch.is_tensor(first) else first
    return shard


def _same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) and torch.is_tensor(b):
        return a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))
    return a == b


def _show(value: Any) -> str:
    return str(value.item()) if torch.is_tensor(value) and value.numel() == 1 else repr(value)
