"""A local disk cache of fetched objects, shared by every rank (and run) that points at the same folder.

Layout: ``cache_dir/<2 hex>/<sha256 of url, ETag and size>``. An object changed in the store has a new
ETag, so a new entry: a stale copy is never served. Writes go to a temporary file in the same folder and
are renamed into place (atomic on POSIX), so a reader sees a whole object or none.

One fetch per object: ``fetch_once`` holds an ``flock`` on one of ``cache_dir/.locks/<3 hex>`` while it
fetches, so a rank (or thread) that needs the same object at the same moment (e.g. one rank's validation
and another's next epoch read ahead) waits for that copy instead of asking the store again. A lock is
shared by the objects whose names start alike (4096 of them), which at worst makes two different
fetches take turns; a holder that dies releases it with its process.

Size limit (``max_bytes``): a running total shared through ``cache_dir/.size`` under an ``flock`` lock;
when a write takes it over the limit, the least recently used entries (by mtime, refreshed on every
hit) are deleted down to 90% of it, and the total is recounted from the files. A rank that deletes an
entry another rank is about to read costs that rank one refetch, never an error.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import tempfile
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from .store import ObjectInfo

_TMP_PREFIX = ".tmp-"
_LOCKS = ".locks"  # the fetch locks' folder (a dot folder: never an entry, never evicted)
_STALE_TMP_S = 3600.0  # a temporary file this old belongs to a writer that died
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(size: int | str | None) -> int | None:
    """``None`` (no limit), a number of bytes, or a string such as ``"50G"`` / ``"500M"``."""
    if size is None or (isinstance(size, int) and not isinstance(size, bool)):
        if size is not None and size < 1:
            raise ValueError(f"cache_max_bytes must be positive, got {size}")
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", str(size), re.IGNORECASE)
    if not match:
        raise ValueError(f"cannot read cache size {size!r}: use bytes or a K/M/G/T suffix, e.g. '50G'")
    return max(1, int(float(match.group(1)) * _UNITS[match.group(2).upper()]))


class ObjectCache:
    """``get(info)`` the cached bytes of an object or None; ``put(info, data)`` after fetching it."""

    def __init__(self, root: str | Path, max_bytes: int | str | None = None):
        self.root = Path(root).expanduser()
        self.max_bytes = parse_size(max_bytes)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OSError(f"cannot create cache_dir {self.root}: {exc}") from exc
        self._disabled = ""  # why writing stopped (a full or read-only disk): reads go on

    def path(self, info: ObjectInfo) -> Path:
        digest = hashlib.sha256(f"{info.url}\n{info.version}\n{info.size}".encode()).hexdigest()
        return self.root / digest[:2] / digest

    def get(self, info: ObjectInfo) -> np.ndarray | None:
        path = self.path(info)
        try:
            data = np.fromfile(path, dtype=np.uint8)
        except (FileNotFoundError, NotADirectoryError):
            return None
        if data.size != info.size:  # cannot happen through put(); someone edited the cache
            return None
        if self.max_bytes is not None:
            try:
                os.utime(path)  # least recently used goes first
            except OSError:
                pass  # evicted by another rank since the read: the bytes are already here
        return data

    def fetch_once(self, info: ObjectInfo, fetch: Callable[[], bytes]) -> np.ndarray:
        """The object's bytes: from the cache, or from ``fetch()`` (then stored), fetched once by every process
        that shares this folder: a caller that finds another fetching it waits and reads that copy."""
        with self._fetching(info):
            data = self.get(info)  # fetched by someone else while this caller waited
            if data is not None:
                return data
            body = fetch()
            self.put(info, body)
            return np.frombuffer(body, dtype=np.uint8)

    @contextmanager
    def _fetching(self, info: ObjectInfo):
        if self._disabled:  # nothing stored for the waiters to read: each fetches for itself
            yield
            return
        try:
            (self.root / _LOCKS).mkdir(exist_ok=True)
            lock = open(self.root / _LOCKS / self.path(info).name[:3], "a+b")  # noqa: SIM115 (closed below)
        except OSError:  # a read-only cache folder: fetch without the lock
            yield
            return
        with lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)
            except OSError:  # a file system without flock: at worst a duplicate fetch
                pass
            yield  # closing the file releases the lock

    def put(self, info: ObjectInfo, data: bytes) -> None:
        if self._disabled or (self.max_bytes is not None and info.size > self.max_bytes):
            return
        path = self.path(info)
        try:
            path.parent.mkdir(exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_TMP_PREFIX)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            if self.max_bytes is not None:
                self._account(len(data))
        except OSError as exc:  # disk full, read-only, quota: train on without the cache, say so once
            self._disabled = str(exc)
            warnings.warn(
                f"object cache {self.root} stopped storing objects ({exc}); reading on from the store", stacklevel=2
            )

    @contextmanager
    def _locked(self):
        with open(self.root / ".lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _account(self, added: int) -> None:
        """Add ``added`` bytes to the shared total; over the limit, evict the least recently used."""
        ledger = self.root / ".size"
        with self._locked():
            try:
                total = int(ledger.read_text() or 0) + added
            except (FileNotFoundError, ValueError):
                total = self.size()
            if total > self.max_bytes:
                total = self._evict(int(self.max_bytes * 0.9))
            ledger.write_text(str(total))

    def _entries(self) -> list[os.DirEntry]:
        entries = []
        for sub in os.scandir(self.root):
            if sub.is_dir(follow_symlinks=False) and not sub.name.startswith("."):  # .locks holds no entries
                entries.extend(e for e in os.scandir(sub.path) if e.is_file(follow_symlinks=False))
        return entries

    def size(self) -> int:
        """Bytes held now (entries only, counted from the files)."""
        return sum(e.stat().st_size for e in self._entries() if not e.name.startswith(_TMP_PREFIX))

    def _evict(self, target: int) -> int:
        """Delete least recently used entries until at most ``target`` bytes are left; returns the bytes left."""
        now, entries = time.time(), []
        for entry in self._entries():
            try:
                stat = entry.stat()
            except FileNotFoundError:
                continue
            if entry.name.startswith(_TMP_PREFIX):
                if now - stat.st_mtime > _STALE_TMP_S:  # left by a writer that crashed
                    Path(entry.path).unlink(missing_ok=True)
                continue
            entries.append((stat.st_mtime, stat.st_size, entry.path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= target:
                break
            Path(path).unlink(missing_ok=True)
            total -= size
        return total
