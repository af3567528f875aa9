"""Where the encoded image bytes of a planned batch come from: local files, or objects in a store.

Both backends read through one of these, so DALI and the DataLoader see the same bytes for the same
plan. ``read(indices)`` returns one uint8 array per sample; ``batches(index_lists)`` yields ``read`` of
each list in order, fetching ahead where that pays (objects: ``prefetch_batches`` batches in flight, so
the next batches download while this one decodes).
"""

from __future__ import annotations

import os
import threading
import warnings
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from .folder import ImageFolder, scan_image_folder
from .remote.cache import ObjectCache
from .remote.folder import ObjectImageFolder, list_once
from .remote.store import FsspecStore, S3Store, StoreOptions, StoreStats, open_store
from .remote.urls import is_url, local_path


class LocalFiles:
    """Files on a local disk, read in the calling thread (reading is far cheaper than decoding them)."""

    def __init__(self, paths: Sequence[str]):
        self.names = list(paths)

    def read(self, indices: Iterable[int]) -> list[np.ndarray]:
        return [np.fromfile(self.names[i], dtype=np.uint8) for i in indices]

    def batches(self, index_lists: Iterable[Sequence[int]]) -> Iterator[list[np.ndarray]]:
        for indices in index_lists:
            yield self.read(indices)

    def describe(self) -> str:
        return "local files"


class ObjectFiles:
    """Objects of one store, fetched by ``max_requests`` threads per process, through an optional cache.

    Picklable: a DataLoader worker or spawned rank gets the plan and options, and makes its own client
    and threads on first use (neither survives a fork).
    """

    def __init__(
        self, folder: ObjectImageFolder, store: S3Store | FsspecStore, cache: ObjectCache | None, options: StoreOptions
    ):
        self.names, self.objects = folder.files, folder.objects
        self.store, self.cache, self.options = store, cache, options
        self._executor: ThreadPoolExecutor | None = None
        self._pid = -1
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_executor=None, _pid=-1, _lock=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def stats(self) -> StoreStats:
        """This process's requests, retries, bytes and cache hits/misses."""
        return self.store.stats

    def _pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None or self._pid != os.getpid():
                self._executor = ThreadPoolExecutor(self.options.max_requests, thread_name_prefix="fastpar-fetch")
                self._pid = os.getpid()
            return self._executor

    def cached(self, index: int) -> np.ndarray | None:
        """The object's bytes if the cache holds them (a local file read: no thread needed)."""
        if self.cache is None:
            return None
        data = self.cache.get(self.objects[index])
        self.stats.add(**({"cache_hits": 1} if data is not None else {"cache_misses": 1}))
        return data

    def fetch(self, index: int) -> np.ndarray:
        """One object's bytes from the store (cached on the way when there is a cache)."""
        info = self.objects[index]
        if self.cache is not None:  # once across the ranks sharing the cache
            return self.cache.fetch_once(info, lambda: self.store.get(info))
        return np.frombuffer(self.store.get(info), dtype=np.uint8)

    def _start(self, indices: Iterable[int]) -> list[np.ndarray | Future]:
        """Each object's bytes from the cache, or a download started in the pool."""
        pool, started = self._pool(), []
        for i in indices:
            data = self.cached(i)
            started.append(data if data is not None else pool.submit(self.fetch, i))
        return started

    @staticmethod
    def _wait(started: list[np.ndarray | Future]) -> list[np.ndarray]:
        return [item.result() if isinstance(item, Future) else item for item in started]

    def read(self, indices: Iterable[int]) -> list[np.ndarray]:
        return self._wait(self._start(indices))

    def batches(self, index_lists: Iterable[Sequence[int]]) -> Iterator[list[np.ndarray]]:
        pending: deque[list[np.ndarray | Future]] = deque()
        lists = iter(index_lists)

        def submit() -> None:
            indices = next(lists, None)
            if indices is not None:
                pending.append(self._start(indices))

        for _ in range(self.options.prefetch_batches + 1):
            submit()
        try:
            while pending:
                started = pending.popleft()
                submit()
                yield self._wait(started)
        finally:  # an abandoned pass (break, an error) leaves no downloads queued behind it
            for started in pending:
                for item in started:
                    if isinstance(item, Future):
                        item.cancel()

    def describe(self) -> str:
        cache = f", cache {self.cache.root}" if self.cache is not None else ""
        return f"{self.store.url.scheme} client, {self.options.max_requests} requests at once{cache}"


def open_image_source(
    root: str | Path,
    *,
    strict: bool,
    world_size: int,
    cache_dir: str | Path | None,
    cache_max_bytes: int | str | None,
    storage: StoreOptions,
) -> tuple[ImageFolder, LocalFiles | ObjectFiles]:
    """The image folder at ``root`` and where its bytes come from: local files, or objects of a store
    (listed once across the ranks, see :func:`list_once`) through an optional local cache."""
    if cache_max_bytes is not None and cache_dir is None:
        raise ValueError("cache_max_bytes limits the cache in cache_dir; pass cache_dir too")
    if not is_url(root):
        if cache_dir is not None:
            warnings.warn(f"cache_dir is for object-store data; {root} is a local folder, read as it is", stacklevel=3)
        folder = scan_image_folder(local_path(root), strict=strict)
        return folder, LocalFiles(folder.files)
    cache = ObjectCache(cache_dir, cache_max_bytes) if cache_dir is not None else None
    store = open_store(str(root), storage)
    folder = list_once(store, strict=strict, world_size=world_size)
    return folder, ObjectFiles(folder, store, cache, storage)
