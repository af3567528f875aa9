"""Object-store pieces that need no server: URLs, options, the disk cache (atomic, keyed, limited, shared)."""

from __future__ import annotations

import collections
import hashlib
import os
import pwd
import stat
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
from fastpar.safe_files import UnsafeFolderError


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


def md5_info(n: int, size: int = 1000, suffix: str = "") -> ObjectInfo:
    """An object whose ETag is the MD5 of its bytes (a single-part upload), or a multipart-like one (suffix)."""
    etag = hashlib.md5(payload(n, size)).hexdigest() + suffix
    return ObjectInfo(f"s3://bucket/train/c/{n:05d}.jpg", f"train/c/{n:05d}.jpg", size, etag)


def test_an_entry_of_the_right_size_but_other_bytes_is_fetched_again_when_the_etag_is_its_md5(tmp_path):
    cache = ObjectCache(tmp_path)
    cache.put(md5_info(1), payload(1))
    assert cache.get(md5_info(1)).tobytes() == payload(1)
    cache.path(md5_info(1)).write_bytes(payload(99))  # same size, other bytes: tampered with or damaged
    assert cache.get(md5_info(1)) is None and not cache.path(md5_info(1)).exists()
    fetches = []
    assert cache.fetch_once(md5_info(1), lambda: fetches.append(1) or payload(1)).tobytes() == payload(1)
    assert fetches == [1] and cache.get(md5_info(1)).tobytes() == payload(1)
    # a multipart ETag ("<md5 of part md5s>-<parts>") is not the body's MD5: the size decides
    multipart = md5_info(2, suffix="-3")
    cache.put(multipart, payload(2))
    assert cache.get(multipart).tobytes() == payload(2)
    # an ETag shaped like an MD5 that is not the body's (SSE-KMS): nothing cached that could not be checked
    kms = ObjectInfo("s3://bucket/train/c/k.jpg", "train/c/k.jpg", 1000, "0" * 32)
    with pytest.warns(UserWarning, match="not the MD5 of their bytes"):
        cache.put(kms, payload(3))
    assert cache.get(kms) is None and not cache.path(kms).exists()


def test_symlinks_planted_in_the_cache_folder_are_never_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    root = tmp_path / "cache"
    cache = ObjectCache(root, max_bytes=1 << 20)
    (root / ".size").symlink_to(victim)  # the running total's side file
    cache.put(info(1), payload(1))
    assert victim.read_text() == "precious" and not (root / ".size").is_symlink()
    assert int((root / ".size").read_text()) == 1000

    (root / ".locks").mkdir(exist_ok=True)
    lock_name = cache.path(info(2)).name[:3]
    (root / ".locks" / lock_name).symlink_to(tmp_path / "made-by-the-fetch-lock")
    assert cache.fetch_once(info(2), lambda: payload(2)).tobytes() == payload(2)
    assert not (tmp_path / "made-by-the-fetch-lock").exists()

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    entry_folder = cache.path(info(3)).parent
    assert not entry_folder.exists()  # (its name differs from those of objects 1 and 2)
    entry_folder.symlink_to(elsewhere, target_is_directory=True)  # an entry folder swapped for a link
    with pytest.warns(UserWarning, match="stopped storing objects"):
        cache.put(info(3), payload(3))
    assert list(elsewhere.iterdir()) == []

    planted = ObjectCache(tmp_path / "other")  # an entry that is a link to a file of the right size
    planted.put(info(4), payload(4))
    entry = planted.path(info(4))
    entry.unlink()
    (tmp_path / "decoy").write_bytes(payload(77))
    entry.symlink_to(tmp_path / "decoy")
    assert planted.get(info(4)) is None

    lock_root = tmp_path / "locked"
    locked = ObjectCache(lock_root, max_bytes=1 << 20)
    (lock_root / ".lock").symlink_to(tmp_path / "made-by-the-size-lock")
    with pytest.warns(UserWarning, match="stopped storing objects"):
        locked.put(info(5), payload(5))
    assert not (tmp_path / "made-by-the-size-lock").exists()


def test_a_cache_folder_others_may_write_to_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UnsafeFolderError, match="may be written by every user"):
        ObjectCache(shared)
    team = tmp_path / "team"
    team.mkdir()
    team.chmod(0o770)  # a folder its group may write to: a team's shared cache
    ObjectCache(team).put(info(1), payload(1))
    fresh = ObjectCache(tmp_path / "new" / "cache")
    assert stat.S_IMODE((tmp_path / "new" / "cache").stat().st_mode) == 0o700 and fresh.get(info(1)) is None


@pytest.mark.skipif(os.geteuid() != 0, reason="making a folder of another user's needs root")
def test_a_cache_folder_of_another_user_is_refused(tmp_path):
    nobody = pwd.getpwnam("nobody").pw_uid
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, nobody, -1)
    with pytest.raises(UnsafeFolderError, match="belongs to another user"):
        ObjectCache(theirs)
    link = tmp_path / "link"  # a link another user planted where the cache folder should be
    link.symlink_to(tmp_path / "mine", target_is_directory=True)
    (tmp_path / "mine").mkdir()
    os.lchown(link, nobody, -1)
    with pytest.raises(UnsafeFolderError, match="symbolic link made by another user"):
        ObjectCache(link)
    mine = ObjectCache(tmp_path / "mine")  # an entry another user put into a folder of this user's is not served
    mine.put(info(1), payload(1))
    os.chown(mine.path(info(1)), nobody, -1)
    assert mine.get(info(1)) is None


def test_redact_url_strips_userinfo_and_secret_query_parameters():
    from fastpar.user_errors import redact_url

    assert redact_url("http://alice:s3cret@127.0.0.1:9000/") == "http://***@127.0.0.1:9000/"
    assert redact_url("s3://AKIA:wJalr/K7+x@bucket/k") == "s3://***@bucket/k"  # a secret key may hold '/'
    assert redact_url("https://h/o?X-Amz-Credential=AK&X-Amz-Date=1&X-Amz-Signature=f00") == (
        "https://h/o?X-Amz-Credential=***&X-Amz-Date=1&X-Amz-Signature=***"
    )
    assert redact_url('at "ftp://u:p@h/x" and gs://b/p?token=t&x=1') == 'at "ftp://***@h/x" and gs://b/p?token=***&x=1'
    for plain in ("s3://bucket/c/a@b.jpg", "s3://imgs/train/", "/data/train", "no url: a@b"):
        assert redact_url(plain) == plain
    assert str(ObjectURL.parse("gs://b/p?sig=abc")) == "gs://b/p?sig=***"  # the value runs to its end


def test_a_fifo_planted_as_an_entry_does_not_hang_the_reader(tmp_path):
    cache = ObjectCache(tmp_path)
    cache.put(info(1), payload(1))
    entry = cache.path(info(1))
    entry.unlink()
    os.mkfifo(entry)
    assert cache.get(info(1)) is None  # opening a FIFO for reading would wait for a writer forever
