"""The bytes a rank really holds for some tensors: each storage counted once and whole (a view into a flat
bucket counts the bucket), a DTensor by its local shard, missing tensors (a ``.grad`` of None) skipped."""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["storage_bytes"]


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    from torch.distributed.tensor import DTensor

    seen: set[tuple[str, int]] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        key = (str(local.device), storage.data_ptr())
        if storage.nbytes() and key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total
