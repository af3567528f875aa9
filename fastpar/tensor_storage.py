"""The one storage counter: the bytes a rank really holds for some tensors, used by every memory report
(ZeRO's ``memory_report``, FSDP2's, the pipeline's, the planner's probe, ``fastpar bench``).

A tensor is counted by its storage (``untyped_storage().nbytes()``), each storage once and whole: a view into a
flat bucket counts the bucket, once for all its views; tied parameters count once; a DTensor counts its local
shard; a missing tensor (a ``.grad`` of None) and an empty storage count nothing. Nothing is computed from
shapes, so a report says what an allocator would see (before fragmentation and a caching allocator's reserve).

A storage is known by its device and its memory's address; meta tensors, which all have address 0, by the
storage object itself.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["StorageCounter", "local_tensor", "storage_bytes", "storage_key"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local shard, any other tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """Identity of the memory behind ``t``: the same for all views of one storage (and of a DTensor's shard)."""
    return _key(local_tensor(t).untyped_storage())


def _key(storage: torch.UntypedStorage) -> tuple[str, int]:
    pointer = storage.data_ptr()
    if pointer == 0:  # meta tensors (and empty storages) share address 0: tell them apart by the storage object
        return f"{storage.device}#storage", storage._cdata
    return str(storage.device), pointer


class StorageCounter:
    """Counts storages once across several calls, so a storage goes to the first category that counts it."""

    def __init__(self, exclude: Iterable[torch.Tensor | None] = ()) -> None:
        self.seen: set[tuple[str, int]] = {storage_key(t) for t in exclude if t is not None}

    def count(self, tensors: Iterable[torch.Tensor | None]) -> int:
        """Bytes of the storages of ``tensors`` not counted before."""
        total = 0
        for t in tensors:
            if t is None:
                continue
            storage = local_tensor(t).untyped_storage()
            key = _key(storage)
            if key in self.seen:
                continue
            nbytes = storage.nbytes()
            if nbytes:
                self.seen.add(key)
                total += nbytes
        return total

    def __contains__(self, t: torch.Tensor) -> bool:
        return storage_key(t) in self.seen


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages of ``tensors``."""
    return StorageCounter().count(tensors)
