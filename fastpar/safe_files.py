"""Reading and writing files in folders other local users may also reach (``/tmp``, a shared scratch, project
folder or cache): the one owner of these rules, for checkpoints, training outputs, the object cache and jobs.

Each rule closes a way for another user to make fastpar write (or read) where they choose:

- a file is created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (``create_new``: never opened through whatever
  already sits at the name: a symlink planted there would redirect the write); a whole file is written under a
  fresh, unguessable name and renamed over its final name (``atomic_file``, ``replace_file``: a rename replaces
  a planted link, it never follows it);
- a folder that exists and belongs to another user is refused, not written into (its owner could swap its
  files at will): ``owned_by_another_user`` is the one ownership rule, and the callers' policies are its
  parameters (root-owned folders accepted for training outputs, a group-writable shared cache);
- private files get their mode at creation, never the default umask's 0644 for a moment first.

``UnsafeFolderError`` is the base of every refusal; ``FolderOwnedByAnotherUserError`` (training outputs) and
``ForeignFolderError`` (job folders) are its kinds.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from .user_errors import UserError

__all__ = [
    "TMP_PREFIX",
    "FolderOwnedByAnotherUserError",
    "ForeignFolderError",
    "UnsafeFolderError",
    "atomic_file",
    "create_exclusive",
    "create_new",
    "folder_mode_for",
    "folder_problem",
    "foreign_owner",
    "fsync_folder",
    "make_folder",
    "open_new",
    "open_own_folder",
    "owned_by_another_user",
    "read_own_file",
    "refuse_foreign_folder",
    "replace_file",
    "write_new",
]

# Files open with these flags never follow a symlink at their name and never reuse an existing file.
_EXCLUSIVE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
# The temporary names of ``replace_file``: a cache that finds one left by a crash knows it may delete it.
TMP_PREFIX = ".tmp-"


class UnsafeFolderError(UserError, PermissionError):
    """A folder fastpar would read from or write into belongs to another user, or other users may write there."""


class FolderOwnedByAnotherUserError(UnsafeFolderError):
    """A folder fastpar was asked to write into belongs to another user: refused before anything is written."""


class ForeignFolderError(UnsafeFolderError):
    """A folder fastpar would write job files into exists and belongs to another user (or is a link)."""


# --- who owns a folder ------------------------------------------------------------------------------------
def owned_by_another_user(info: os.stat_result, *, root_may_own: bool = False) -> bool:
    """The one ownership rule: ``info`` belongs neither to this user nor, when ``root_may_own``, to root (root
    can replace any file anyway, as ssh reasons: ``/tmp`` or an admin's shared scratch)."""
    return info.st_uid != os.geteuid() and not (root_may_own and info.st_uid == 0)


def foreign_owner(path: str | Path, *, root_may_own: bool = False, check_link: bool = True) -> tuple[int, bool] | None:
    """``(uid, is_link)`` of whoever else owns ``path``, or None when it is this user's. ``check_link``: a
    symlink at the name counts too unless this user or root made it (its maker could point it elsewhere at
    will); then what the name leads to must be this user's (or root's, when ``root_may_own``).
    FileNotFoundError when ``path`` (or what a link there leads to) is missing."""
    if check_link:
        link = os.lstat(path)
        if stat.S_ISLNK(link.st_mode) and owned_by_another_user(link, root_may_own=True):
            return link.st_uid, True
    info = os.stat(path)
    return (info.st_uid, False) if owned_by_another_user(info, root_may_own=root_may_own) else None


def refuse_foreign_folder(folder: str | Path, described: str) -> None:
    """Raise FolderOwnedByAnotherUserError when ``folder`` -- or a symlink standing at its name -- belongs to
    another user. ``described`` names it for the message (``"TrainingOptions.output_dir='runs'"``). Folders of
    root are accepted (``/tmp``, an admin's shared scratch): root can replace any file anyway, as ssh reasons."""
    folder = Path(folder)
    try:
        found = foreign_owner(folder, root_may_own=True)
    except FileNotFoundError:
        return
    if found is not None:
        raise FolderOwnedByAnotherUserError(
            f"{described}: the folder {str(folder.absolute())!r} belongs to another user ({_user_name(found[0])}), "
            "who could replace the files written there; choose a folder of your own (create it yourself, or name "
            "one that does not exist yet)"
        )


def folder_problem(path: str | Path, *, group_may_write: bool = False) -> str | None:
    """Why the existing folder ``path`` is unsafe to use, as the end of a sentence ("... is a file"), or None.

    Unsafe: not a folder; owned by another user; writable by other users (and by its group unless
    ``group_may_write``); a symlink made by another user (a link of this user's or root's is followed)."""
    found = foreign_owner(path)
    if found is not None and found[1]:
        return f"is a symbolic link made by another user (uid {found[0]})"
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if found is not None:
        return f"belongs to another user (uid {found[0]})"
    if st.st_mode & stat.S_IWOTH:
        return f"may be written by every user (mode {stat.S_IMODE(st.st_mode):04o})"
    if st.st_mode & stat.S_IWGRP and not group_may_write:
        return f"may be written by its group (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _user_name(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name}, uid {uid}"
    except (ImportError, KeyError):
        return f"uid {uid}"


def make_folder(folder: str | Path, mode: int | None = None) -> bool:
    """Create ``folder`` and its missing parents; True when ``folder`` itself was created here. A folder created
    here gets exactly ``mode`` (None: the umask's default); an existing one keeps its own."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(folder, 0o700 if mode is not None else 0o777)  # private from the start when a mode is asked
    except FileExistsError:
        if not folder.is_dir():
            raise NotADirectoryError(f"{folder} exists and is not a folder") from None
        return False
    if mode is not None:  # through a handle on the folder made here: never a link swapped in since
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
    return True


def open_own_folder(name: str | Path, *, dir_fd: int | None = None, create: bool = True) -> int:
    """A descriptor of the folder ``name`` (in ``dir_fd`` when given), made 0700 when missing and ``create``.
    Raises UnsafeFolderError for a symlink or a folder of another user, FileNotFoundError when missing."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=dir_fd)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeFolderError(f"{name} is a symbolic link or a file where fastpar keeps a folder") from exc
        raise
    if owned_by_another_user(os.fstat(fd)):
        os.close(fd)
        raise UnsafeFolderError(f"folder {name} belongs to another user")
    return fd


# --- new files, never through a link -----------------------------------------------------------------------
def create_new(name: str | Path, mode: int = 0o600, *, dir_fd: int | None = None) -> int:
    """The one way a file is created: ``name`` (in ``dir_fd`` when given) made here and opened for writing,
    ``mode`` masked by the umask; FileExistsError if anything, a symlink included, already sits at that name."""
    return os.open(name, _EXCLUSIVE, mode, dir_fd=dir_fd)


def open_new(path: str | Path, mode: int = 0o600) -> int:
    """``path`` created here and opened for writing, with exactly ``mode``: FileExistsError if anything, a
    symlink included, already sits at that name."""
    fd = create_new(path, 0o600)
    os.fchmod(fd, mode)
    return fd


def write_new(name: str | Path, data: bytes, *, dir_fd: int | None = None, mode: int = 0o600) -> None:
    """Create ``name`` with ``data``; FileExistsError if anything (a file, a symlink) is there already."""
    fd = create_new(name, mode, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except BaseException:
        os.unlink(name, dir_fd=dir_fd)
        raise


def create_exclusive(
    folder: str | Path, prefix: str, suffix: str = "", mode: int = 0o600, *, dir_fd: int | None = None
) -> tuple[int, Path]:
    """A new file in ``folder`` (relative to ``dir_fd`` when given) named ``prefix<random>suffix``, opened for
    writing; returns (fd, path). ``mode`` is masked by the umask, like every ``open``; callers that need an
    exact mode ``fchmod``."""
    folder = Path(folder)
    for _ in range(100):
        path = folder / f"{prefix}{secrets.token_hex(8)}{suffix}"
        try:
            return create_new(path, mode, dir_fd=dir_fd), path
        except FileExistsError:  # someone else's file at this random name: draw again
            continue
    raise FileExistsError(f"could not create a new file named {prefix}*{suffix} in {folder}")


# --- whole files: a random temporary name renamed over the target -----------------------------------------
@contextlib.contextmanager
def atomic_file(
    path: str | Path,
    mode: int | None = 0o600,
    *,
    dir_fd: int | None = None,
    temp_prefix: str | None = None,
    durable: bool = True,
) -> Iterator[IO[bytes]]:
    """Write ``path`` whole or not at all: yields a binary file on a new temporary file beside ``path``
    (``temp_prefix<random>``, ``.<name>.tmp-<random>`` by default), then renames it over ``path`` (a reader
    sees the old or the new bytes; a symlink at ``path`` is replaced, never followed). ``mode``: the file's
    exact mode (None: the umask's default for a new file, like ``open(path, "w")``). ``durable``: fsync the
    file before the rename and the folder after it. ``dir_fd``: ``path`` is relative to that folder. An
    exception leaves ``path`` as it was."""
    path = Path(path)
    prefix = temp_prefix if temp_prefix is not None else f".{path.name}.tmp-"
    fd, tmp = create_exclusive(path.parent, prefix, mode=0o600 if mode is not None else 0o666, dir_fd=dir_fd)
    try:
        if mode is not None:
            os.fchmod(fd, mode)  # exactly as asked: a shared mode is not narrowed by the umask
        with os.fdopen(fd, "wb") as fh:
            yield fh
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        if durable:  # make the rename itself durable
            if dir_fd is None:
                fsync_folder(path.parent)
            else:
                os.fsync(dir_fd)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)


def replace_file(
    name: str | Path, data: bytes, *, dir_fd: int | None = None, mode: int = 0o600, durable: bool = False
) -> None:
    """Write ``data`` to ``name`` atomically under a random ``TMP_PREFIX`` name in the same folder (see
    ``atomic_file``); not fsynced unless ``durable``: a cache entry lost in a crash is fetched again."""
    with atomic_file(name, mode, dir_fd=dir_fd, temp_prefix=TMP_PREFIX, durable=durable) as fh:
        fh.write(data)


def read_own_file(name: str | Path, *, dir_fd: int | None = None) -> bytes | None:
    """The bytes of the regular file ``name`` if this user owns it; None when it is missing, a symlink, not a
    regular file, or another user's."""
    try:
        # O_NONBLOCK: a FIFO planted at the name must not hang the reader (no effect on a regular file)
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW, dir_fd=dir_fd)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a symlink
            return None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or owned_by_another_user(st):
            return None
        return f.read()


def fsync_folder(folder: str | Path) -> None:
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def folder_mode_for(file_mode: int) -> int:
    """The mode of a folder holding files of ``file_mode``: the owner's rwx, and search (x) for whoever may
    read the files (0o640 files -> a 0o750 folder)."""
    read = file_mode & 0o044
    return stat.S_IRWXU | read | (read >> 2)
