"""A local disk cache of fetched objects, shared by every rank (and run) that points at the same folder.

Layout: ``cache_dir/<2 hex>/<sha256 of url, ETag and size>``. An object changed in the store has a new
ETag, so a new entry: a stale copy is never served. Writes go to a new temporary file in the same folder
and are renamed into place (atomic on POSIX), so a reader sees a whole object or none.

What it trusts: ``cache_dir`` itself, which must be this user's and not writable by every user
(``UnsafeFolderError`` otherwise; its group may write, for a cache a team shares). Inside it nothing is
taken on trust: every name is opened without following symlinks and relative to a folder descriptor
(``fastpar.safe_files``), the subfolders must be this user's, and an entry is served only when it
is a regular file of this user's of the object's size whose MD5 equals the object's ETag when the ETag is
one (a single-part upload's; a multipart ETag holds a '-', other stores' versions are not MD5s: then the
size and owner decide). An entry that fails is deleted and the object fetched again. An object whose
ETag looks like an MD5 but is not its bytes' (SSE-KMS and SSE-C encrypted objects) cannot be checked,
so it is read from the store each time, with one warning.

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
import stat
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ...safe_files import TMP_PREFIX, UnsafeFolderError, folder_problem, open_own_folder, read_own_file, replace_file
from ...user_errors import redact_url
from .store import ObjectInfo

_TMP_PREFIX = TMP_PREFIX
_ENTRY = re.compile(r"[0-9a-f]{64}")
_SUBFOLDER = re.compile(r"[0-9a-f]{2}")
_MD5 = re.compile(r"[0-9a-f]{32}")
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
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
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            problem = folder_problem(self.root, group_may_write=True)
        except OSError as exc:
            raise OSError(f"cannot create cache_dir {self.root}: {exc}") from exc
        if problem:
            raise UnsafeFolderError(
                f"cache_dir {self.root} {problem}: whoever may write there could choose the data you train on. "
                "Pass a folder of your own that other users cannot write to"
            )
        self._disabled = ""  # why writing stopped (a full or read-only disk): reads go on
        self._warned_unverifiable = False

    def path(self, info: ObjectInfo) -> Path:
        digest = hashlib.sha256(f"{info.url}\n{info.version}\n{info.size}".encode()).hexdigest()
        return self.root / digest[:2] / digest

    @contextmanager
    def _folder(self, name: str | None = None, *, create: bool = False) -> Iterator[int]:
        """A descriptor of the cache folder, or of its subfolder ``name`` (this user's, no symlink)."""
        root = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if name is None:
                yield root
                return
            sub = open_own_folder(name, dir_fd=root, create=create)
            try:
                yield sub
            finally:
                os.close(sub)
        finally:
            os.close(root)

    def get(self, info: ObjectInfo) -> np.ndarray | None:
        path = self.path(info)
        try:
            with self._folder(path.parent.name) as folder:
                body = read_own_file(path.name, dir_fd=folder)
                if body is None:
                    return None
                if len(body) != info.size or not _matches_etag(body, info):  # damaged, or not what we stored
                    os.unlink(path.name, dir_fd=folder)
                    return None
                if self.max_bytes is not None:
                    try:
                        os.utime(path.name, dir_fd=folder, follow_symlinks=False)  # least recently used goes first
                    except OSError:
                        pass  # evicted by another rank since the read: the bytes are already here
        except (FileNotFoundError, UnsafeFolderError):
            return None
        return np.frombuffer(body, dtype=np.uint8)

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
            with self._folder(_LOCKS, create=True) as locks:
                lock = _open_lock(self.path(info).name[:3], locks)
        except OSError:  # a read-only cache folder, a planted link: fetch without the lock
            yield
            return
        with os.fdopen(lock, "rb") as held:
            try:
                fcntl.flock(held, fcntl.LOCK_EX)
            except OSError:  # a file system without flock: at worst a duplicate fetch
                pass
            yield  # closing the file releases the lock

    def put(self, info: ObjectInfo, data: bytes) -> None:
        if self._disabled or (self.max_bytes is not None and info.size > self.max_bytes):
            return
        if not _matches_etag(data, info):
            self._warn_unverifiable(info)
            return
        path = self.path(info)
        try:
            with self._folder(path.parent.name, create=True) as folder:
                replace_file(path.name, data, dir_fd=folder)
            if self.max_bytes is not None:
                self._account(len(data))
        except OSError as exc:  # disk full, read-only, quota, a planted link: train on without the cache, say so
            self._disabled = str(exc)
            warnings.warn(
                f"object cache {self.root} stopped storing objects ({exc}); reading on from the store", stacklevel=2
            )

    def _warn_unverifiable(self, info: ObjectInfo) -> None:
        if not self._warned_unverifiable:
            self._warned_unverifiable = True
            warnings.warn(
                f"objects such as {redact_url(info.url)} have an ETag that is not the MD5 of their bytes (encrypted with SSE-KMS "
                "or SSE-C?): a cached copy of them could not be checked, so they are read from the store each time",
                stacklevel=3,
            )

    @contextmanager
    def _locked(self):
        with self._folder() as root:
            lock = _open_lock(".lock", root)
        with os.fdopen(lock, "rb") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(held, fcntl.LOCK_UN)

    def _account(self, added: int) -> None:
        """Add ``added`` bytes to the shared total; over the limit, evict the least recently used."""
        with self._locked(), self._folder() as root:
            try:
                total = int(read_own_file(".size", dir_fd=root) or b"x") + added
            except ValueError:  # missing, unreadable or not ours: count the files
                total = self.size()
            if total > self.max_bytes:
                total = self._evict(int(self.max_bytes * 0.9))
            replace_file(".size", str(total).encode(), dir_fd=root)

    def _entries(self) -> list[os.DirEntry]:
        """Entries and temporary files, in this user's subfolders named like the cache's (nothing else is
        counted or evicted, whatever else the folder holds)."""
        entries, me = [], os.geteuid()
        for sub in os.scandir(self.root):
            if _SUBFOLDER.fullmatch(sub.name) and sub.is_dir(follow_symlinks=False) and sub.stat().st_uid == me:
                entries.extend(
                    e
                    for e in os.scandir(sub.path)
                    if (_ENTRY.fullmatch(e.name) or e.name.startswith(_TMP_PREFIX)) and e.is_file(follow_symlinks=False)
                )
        return entries

    def size(self) -> int:
        """Bytes held now (entries only, counted from the files)."""
        return sum(e.stat().st_size for e in self._entries() if not e.name.startswith(_TMP_PREFIX))

    def _evict(self, target: int) -> int:
        """Delete least recently used entries until at most ``target`` bytes are left; returns the bytes left."""
        now, entries = time.time(), []
        for entry in self._entries():
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if entry.name.startswith(_TMP_PREFIX):
                if now - st.st_mtime > _STALE_TMP_S:  # left by a writer that crashed
                    Path(entry.path).unlink(missing_ok=True)
                continue
            entries.append((st.st_mtime, st.st_size, entry.path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= target:
                break
            Path(path).unlink(missing_ok=True)
            total -= size
        return total


def _open_lock(name: str, dir_fd: int) -> int:
    """A descriptor of the lock file ``name`` in ``dir_fd`` (made 0600 when missing; a symlink is refused)."""
    fd = os.open(name, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o600, dir_fd=dir_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{name} in the cache folder is not a regular file")
    return fd


def _matches_etag(body: bytes, info: ObjectInfo) -> bool:
    """Whether ``body`` is the object ``info`` lists, as far as its ETag tells: the MD5 for a single-part
    upload's ETag (32 hex digits); anything else (a multipart ETag "<md5>-<parts>", another store's version)
    tells nothing, and then the size must do."""
    etag = info.version.strip('"').lower()
    if not _MD5.fullmatch(etag):
        return True
    return hashlib.md5(body, usedforsecurity=False).hexdigest() == etag
