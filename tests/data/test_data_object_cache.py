"""Object-store pieces that need no server: URLs, options, the disk cache (atomic, keyed, limited, shared)."""

from __future__ import annotations

import collections
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from fastpar.data.remote.cache import ObjectCache, parse_size
from fastpar.data.remote.store import ObjectInfo, StoreOptions
from fastpar.data.remote.urls import ObjectURL, is_url, local_path
from fastpar.launcher import spawn


def info(n: int, size: int = 1000, version: str = "v1") -> ObjectInfo:
    return ObjectInfo(f"s3://bucket/train/c/{n:05d}.jpg", f"train/c/{n:05d}.jpg", size, version)


def payload(n: int, size: int = 1000) -> bytes:
    return np.random.default_rng(n).integers(0, 256, size, dtype=np.uint8).tobytes()


def test_urls():
    assert is_url("s3://b/x") and is_url("gs://b") and is_url("memory://b/p")
    assert not is_url("/data/train") and not is_url("file:///data/train") and not is_url(Path("s3://x"))
    assert not is_url("C:\\data") and local_path("file:///data/train") == Path("/data/train")
    url = ObjectURL.parse("s3://my-bucket/train/")
    assert (url.bucket, url.prefix, url.list_prefix, str(url)) == (
        "my-bucket",
        "train",
        "train/",
        "s3://my-bucket/train/",
    )
    assert ObjectURL.parse("s3://my-bucket").list_prefix == ""
    assert ObjectURL.parse("s3a://my-bucket/a/b").scheme == "s3"
    with pytest.raises(ValueError, match="not a valid S3 bucket name"):
        ObjectURL.parse("s3://My_Bucket/train")
    with pytest.raises(ValueError, match="names no bucket"):
        ObjectURL.parse("s3:///train")


def test_store_options_are_checked():
    with pytest.raises(ValueError, match="StoreOptions.retries"):
        StoreOptions(retries=-1)
    with pytest.raises(ValueError, match="StoreOptions.reader"):
        StoreOptions(reader="fast")
    with pytest.raises(ValueError, match="max_requests"):
        StoreOptions(max_requests=0)
    o = StoreOptions(backoff_s=0.2, max_backoff_s=1.0)
    waits = [o.backoff(a) for a in range(6)]
    assert 0.1 <= waits[0] <= 0.2 and 0.5 <= waits[-1] <= 1.0  # doubling, capped, half of it random


def test_parse_size():
    assert parse_size("50G") == 50 << 30 and parse_size("1.5M") == 3 << 19 and parse_size(123) == 123
    assert parse_size("2KiB") == 2048 and parse_size(None) is None
    with pytest.raises(ValueError, match="cache size"):
        parse_size("lots")


def test_cache_round_trip_is_keyed_by_url_etag_and_size(tmp_path):
    cache = ObjectCache(tmp_path / "c")
    assert cache.get(info(1)) is None
    cache.put(info(1), payload(1))
    assert cache.get(info(1)).tobytes() == payload(1)
    assert cache.get(info(1, version="v2")) is None  # the object changed in the store: not served stale
    assert cache.get(info(2)) is None
    files = [p for p in (tmp_path / "c").rglob("*") if p.is_file() and not p.name.startswith(".")]
    assert len(files) == 1 and not any(p.name.startswith(".tmp-") for p in (tmp_path / "c").rglob("*"))


def test_cache_ignores_a_wrong_size_file_and_a_writer_that_died(tmp_path):
    cache = ObjectCache(tmp_path)
    cache.put(info(1), payload(1))
    cache.path(info(1)).write_bytes(b"truncated")  # not through put(): never produced by the cache itself
    assert cache.get(info(1)) is None
    # a crashed writer leaves only a temporary file, never a partial entry
    stale = cache.path(info(3)).parent / ".tmp-crashed"
    stale.parent.mkdir(exist_ok=True)
    stale.write_bytes(b"partial")
    assert cache.get(info(3)) is None
    os.utime(stale, (0, 0))
    limited = ObjectCache(tmp_path, max_bytes=2500)
    for n in range(4):
        limited.put(info(10 + n), payload(10 + n))
    assert not stale.exists()  # eviction sweeps temporaries older than an hour


def test_cache_size_limit_evicts_least_recently_used(tmp_path):
    cache = ObjectCache(tmp_path, max_bytes=5500)
    for n in range(5):
        cache.put(info(n), payload(n))
        os.utime(cache.path(info(n)), (1000 + n, 1000 + n))  # put order = age order, whatever the clock
    assert cache.get(info(0)) is not None  # a hit makes entry 0 the most recently used
    cache.put(info(5), payload(5))  # 6000 > 5500: evict down to 90% (4950): the two oldest go
    assert cache.size() <= 5500
    kept = [n for n in range(6) if cache.get(info(n)) is not None]
    assert kept == [0, 3, 4, 5]
    assert ObjectCache(tmp_path, max_bytes=500).put(info(9), payload(9)) is None  # larger than the limit: skipped
    assert cache.get(info(9)) is None


def test_an_object_wanted_by_several_at_once_is_fetched_once(tmp_path):
    """Three caches on one folder (as three ranks) want the same objects at the same moment: one store
    request each, every caller gets the bytes; the lock files are neither entries nor evicted."""
    calls, start = collections.Counter(), threading.Barrier(3)

    def slow_fetch(n: int) -> bytes:
        calls[n] += 1
        time.sleep(0.05)  # long enough that the others arrive while it is in flight
        return payload(n, 3000)

    def rank(_: int) -> list[bytes]:
        cache = ObjectCache(tmp_path, max_bytes=1 << 20)
        start.wait()
        return [cache.fetch_once(info(n, 3000), lambda n=n: slow_fetch(n)).tobytes() for n in range(6)]

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(rank, range(3)))
    assert all(got == [payload(n, 3000) for n in range(6)] for got in results)
    assert calls == {n: 1 for n in range(6)}
    cache = ObjectCache(tmp_path, max_bytes=1 << 20)
    assert (tmp_path / ".locks").is_dir() and cache.size() == 6 * 3000
    assert int((tmp_path / ".size").read_text()) == 6 * 3000
    assert ObjectCache(tmp_path)._evict(0) == 0 and any((tmp_path / ".locks").iterdir())


def test_fetch_once_errors_reach_the_caller_and_release_the_lock(tmp_path):
    cache = ObjectCache(tmp_path)

    def failing() -> bytes:
        raise OSError("the store said no")

    with pytest.raises(OSError, match="the store said no"):
        cache.fetch_once(info(1), failing)
    assert cache.get(info(1)) is None
    assert cache.fetch_once(info(1), lambda: payload(1)).tobytes() == payload(1)  # not left locked
    assert cache.fetch_once(info(1), failing).tobytes() == payload(1)  # cached: no fetch at all


def test_cache_write_failure_warns_once_and_reads_go_on(tmp_path):
    cache = ObjectCache(tmp_path)
    cache.put(info(1), payload(1))
    for n in (2, 3):  # a file where the entry's folder should be: writing fails, even as root
        blocker = cache.path(info(n)).parent
        if not blocker.exists():
            blocker.write_bytes(b"")
    with pytest.warns(UserWarning, match="stopped storing objects") as record:
        cache.put(info(2), payload(2))
        cache.put(info(3), payload(3))  # no second warning, no error
    assert len(record) == 1
    assert cache.get(info(1)).tobytes() == payload(1) and cache.get(info(2)) is None


def _hammer(rank: int, world_size: int, root: str, limit: int) -> int:
    """Every rank writes and reads the same 40 objects at once through one shared cache."""
    cache = ObjectCache(root, max_bytes=limit)
    wrong = 0
    for round_ in range(3):
        for n in range(40):
            k = (n + rank * 7 + round_) % 40
            got = cache.get(info(k, 3000))
            if got is None:
                cache.put(info(k, 3000), payload(k, 3000))
            elif got.tobytes() != payload(k, 3000):
                wrong += 1
    return wrong


@pytest.mark.slow
@pytest.mark.parametrize("limit", [None, 60_000])
def test_cache_shared_by_ranks_never_serves_a_partial_object(tmp_path, limit):
    wrong = spawn(_hammer, 3, str(tmp_path), limit, backend=None, timeout=240)
    assert wrong == [0, 0, 0]
    cache = ObjectCache(tmp_path, max_bytes=limit)
    if limit is not None:
        assert cache.size() <= limit and int((tmp_path / ".size").read_text()) >= cache.size()
    assert not [p for p in tmp_path.rglob(".tmp-*")]
    for n in range(40):
        got = cache.get(info(n, 3000))
        assert got is None or got.tobytes() == payload(n, 3000)
