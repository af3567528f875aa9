"""Turn ``train_data``/``validation_data`` into a per-rank loader that can resume mid-epoch.

Accepted: a folder of class subfolders or an object-store URL such as ``s3://bucket/prefix``
(``fastpar.data.image_loader``; ``TrainingOptions.data_cache_dir`` caches the objects), ``(x, y)`` arrays, a torch
``Dataset``, a factory ``fn(rank, world_size) -> loader``, or a loader object. Every rank sees a disjoint
shard in an order fixed by ``(seed, epoch)``, and training shards have equal length on every rank so no
rank waits in a collective the others never reach.

Loaders built before the workers exist know nothing of the ranks, so they are re-planned per rank:
a fastpar loader made for one process gets this rank's shard of the same plan, and a torch
``DataLoader`` over a map-style dataset with its default sampler keeps its dataset, batch size,
collate function and workers but draws its batches from fastpar's plan (sharded, seeded, resumable).
Other loaders (custom samplers, iterable datasets) are used as given: shard them yourself or pass a factory.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, RandomSampler, SequentialSampler

from ..data.loader import PlannedLoader
from ..data.remote.urls import ObjectURL, is_url, local_path
from ..data.sharding import ShardSpec


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
    if hasattr(data, "__iter__") and not isinstance(data, type):  # a loader class is a factory, not a loader
        return "loader"
    if callable(data):
        return "factory"
    raise TypeError(
        f"training data must be a folder path, (x, y) arrays, a torch Dataset, a loader or a factory "
        f"fn(rank, world_size) -> loader; got {type(data).__name__}"
    )


def check_exists(data: Any, what: str) -> None:
    """Raise FileNotFoundError before any worker starts when a folder source does not exist (an object-store
    URL is checked for its form here; rank 0 lists it once the workers run)."""
    if describe(data) == "folder" and is_url(data):
        ObjectURL.parse(str(data))
    elif describe(data) == "folder" and not local_path(data).is_dir():
        raise FileNotFoundError(
            f"{what}={str(data)!r} is not a folder; pass a folder with one subfolder of images per class"
        )


def make_loader(
    data: Any,
    *,
    train: bool,
    batch_size: int,
    rank: int,
    world_size: int,
    seed: int,
    image_size: int | None,
    threads: int | None,
    device: torch.device,
    cache_dir: str | None = None,
) -> Any:
    """The loader rank ``rank`` iterates for ``data`` (fastpar.data's loaders for folders, arrays, datasets).

    Training drops the last partial batch (equal, full steps on every rank); validation sees every sample once.
    """
    from .. import data as fpdata

    kind = describe(data)
    common = dict(rank=rank, world_size=world_size, seed=seed, device=device)
    last_batch = "drop" if train else "partial"
    if kind == "folder":
        size = {} if image_size is None else {"size": image_size}
        cache = {"cache_dir": cache_dir} if cache_dir is not None and is_url(data) else {}
        return fpdata.image_loader(
            str(data), batch_size, train=train, num_threads=threads, last_batch=last_batch, **size, **cache, **common
        )
    if kind == "arrays":
        x, y = data
        return fpdata.array_loader(x, y, batch_size, shuffle=train, last_batch=last_batch, **common)
    if kind == "dataset":
        return fpdata.iterable_loader(data, batch_size, shuffle=train, last_batch=last_batch, **common)
    if kind == "factory":
        return data(rank, world_size)
    return _replan(data, train=train, last_batch=last_batch, **common)


def _replan(
    loader: Any, *, train: bool, last_batch: str, rank: int, world_size: int, seed: int, device: torch.device
) -> Any:
    if isinstance(loader, PlannedLoader):
        if loader.spec.world_size == world_size:
            return loader  # already made for this world size (e.g. with explicit rank/world_size)
        if loader.spec.world_size != 1:
            raise ValueError(
                f"the given fastpar loader was made for world_size={loader.spec.world_size}, but this run has "
                f"{world_size} processes; make it without rank/world_size (or pass a factory fn(rank, world_size))"
            )
        mine = copy.copy(loader)  # same data and backend, this rank's shard of the same plan
        mine.spec = dataclasses.replace(loader.spec, rank=rank, world_size=world_size)
        mine.epoch, mine.batch, mine._resume = 0, 0, False
        return mine
    if callable(getattr(loader, "for_rank", None)):  # e.g. fastpar.data.token_loader: re-planned by itself
        return loader.for_rank(rank, world_size)
    if _plannable(loader):
        shuffle = isinstance(loader.sampler, RandomSampler)
        spec = ShardSpec(len(loader.dataset), loader.batch_size, rank, world_size, seed, shuffle, last_batch)
        return PlannedDataLoader(spec, loader)
    if world_size > 1 and train:
        warnings.warn(
            f"train_data is a {type(loader).__name__} with a custom sampler or an iterable dataset: every process "
            "iterates it as given. Shard it yourself, or pass a factory fn(rank, world_size) -> loader",
            stacklevel=3,
        )
    return loader


def _plannable(loader: Any) -> bool:
    """A torch DataLoader whose batches are just "batch_size samples of a map-style dataset, maybe shuffled"."""
    return (
        isinstance(loader, DataLoader)
        and not isinstance(loader.dataset, IterableDataset)
        and loader.batch_size is not None
        and type(loader.batch_sampler) is BatchSampler
        and type(loader.sampler) in (SequentialSampler, RandomSampler)
        and not getattr(loader.sampler, "replacement", False)
    )


class PlannedDataLoader(PlannedLoader):
    """A user's torch DataLoader driven by fastpar's plan: this rank's batches, seeded, resumable.

    Each epoch iterates a DataLoader with the user's dataset, collate function, workers and pinning,
    and a batch sampler that is this rank's planned index lists.
    """

    def __init__(self, spec, loader: DataLoader) -> None:
        super().__init__(spec)
        self.dataset = loader.dataset
        self._kwargs = dict(
            collate_fn=loader.collate_fn,
            num_workers=loader.num_workers,
            pin_memory=loader.pin_memory,
            timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn,
            multiprocessing_context=loader.multiprocessing_context,
        )
        if loader.num_workers > 0:
            self._kwargs["prefetch_factor"] = loader.prefetch_factor

    def _iterate(self, epoch: int, batches: list) -> Iterator[Any]:
        index_lists = [indices.tolist() for indices, _ in batches]
        yield from DataLoader(self.dataset, batch_sampler=index_lists, **self._kwargs)


def batches_per_epoch(loader: Any) -> int:
    try:
        return len(loader)
    except TypeError as exc:
        raise TypeError(f"the training loader ({type(loader).__name__}) must have len(): batches per epoch") from exc
