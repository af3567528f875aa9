"""Turn ``train_data``/``validation_data`` into a per-rank loader that can resume mid-epoch.

Accepted: a folder of class subfolders (``fastpar.data.image_loader``), ``(x, y)`` arrays, a torch
``Dataset``, a factory ``fn(rank, world_size) -> loader``, or a loader object used as given. Every
rank sees a disjoint shard in an order fixed by ``(seed, epoch)``, and training shards have equal
length on every rank so no rank waits in a collective the others never reach.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset


def describe(data: Any) -> str:
    """Which kind of data source ``data`` is: folder | arrays | dataset | factory | loader."""
    if isinstance(data, (str, Path)):
        return "folder"
    if isinstance(data, (tuple, list)) and len(data) == 2 and all(hasattr(a, "__len__") for a in data):
        if len(data[0]) != len(data[1]):
            raise ValueError(f"(x, y) arrays must have the same length, got {len(data[0])} and {len(data[1])}")
        return "arrays"
    if isinstance(data, Dataset) and hasattr(data, "__len__") and not hasattr(data, "__iter__"):
        return "dataset"
    if hasattr(data, "__iter__"):
        return "loader"
    if callable(data):
        return "factory"
    raise TypeError(
        f"training data must be a folder path, (x, y) arrays, a torch Dataset, a loader or a factory "
        f"fn(rank, world_size) -> loader; got {type(data).__name__}"
    )


def check_exists(data: Any, what: str) -> None:
    """Raise FileNotFoundError before any worker starts when a folder source does not exist."""
    if describe(data) == "folder" and not Path(data).is_dir():
        raise FileNotFoundError(
            f"{what}={str(data)!r} is not a folder; pass a folder with one subfolder of images per class"
        )


def make_loader(data: Any, *, train: bool, batch_size: int, rank: int, world_size: int, seed: int,
                image_size: int | None, threads: int | None, device: torch.device) -> Any:  # fmt: skip
    """The loader rank ``rank`` iterates for ``data`` (fastpar.data's loaders for folders, arrays, datasets).

    Training drops the last partial batch (equal, full steps on every rank); validation sees every sample once.
    """
    from .. import data as fpdata

    kind = describe(data)
    common = dict(rank=rank, world_size=world_size, seed=seed, device=device)
    last_batch = "drop" if train else "partial"
    if kind == "folder":
        size = {} if image_size is None else {"size": image_size}
        return fpdata.image_loader(str(data), batch_size, train=train, num_threads=threads, last_batch=last_batch,
                                   **size, **common)  # fmt: skip
    if kind == "arrays":
        x, y = data
        return fpdata.array_loader(x, y, batch_size, shuffle=train, last_batch=last_batch, **common)
    if kind == "dataset":
        return fpdata.iterable_loader(data, batch_size, shuffle=train, last_batch=last_batch, **common)
    if kind == "factory":
        return data(rank, world_size)
    return data  # a loader: used as given (shard it yourself, or pass a factory)


def batches_per_epoch(loader: Any) -> int:
    try:
        return len(loader)
    except TypeError as exc:
        raise TypeError(f"the training loader ({type(loader).__name__}) must have len(): batches per epoch") from exc
