"""The jobs' policy on top of ``fastpar.safe_files``: job folders and files only their owner can read (folders
0700, files 0600), every write through a fresh temporary name renamed over the target.

A job folder holds the pickled call with its arguments, the pickled result, logs and metrics; reading a
pickle someone else wrote runs their code, so these folders are not shared, and a folder that exists but
belongs to another user is refused rather than written into.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from ..safe_files import ForeignFolderError, atomic_file, create_new, foreign_owner

__all__ = ["check_owned", "private_folder", "private_umask", "touch_private", "write_private"]

FOLDER_MODE = 0o700
FILE_MODE = 0o600
PRIVATE_UMASK = 0o077


def private_folder(path: str | Path, *, tighten: bool = True) -> Path:
    """Create ``path`` (and missing parents) as a 0700 folder, or check that the existing one is ours.
    ``tighten``: an existing folder of ours gets mode 0700 too (job folders; not a user-chosen parent)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=FOLDER_MODE)
    info = check_owned(path)  # a link to a folder of ours (a jobs root on scratch space) is fine
    if not stat.S_ISDIR(info.st_mode):
        raise NotADirectoryError(f"{path} exists and is not a folder; remove it or choose another jobs folder")
    if tighten and stat.S_IMODE(info.st_mode) != FOLDER_MODE:
        os.chmod(path, FOLDER_MODE)
    return path


def check_owned(path: str | Path) -> os.stat_result:
    """``path``'s stat when it (what its name leads to) belongs to this user; ForeignFolderError naming its
    owner otherwise. Root's folders are not trusted here: a job's pickles run whatever their writer chose."""
    found = foreign_owner(path, check_link=False)
    if found is not None:
        raise ForeignFolderError(
            f"{path} belongs to user id {found[0]}, not to you (id {os.geteuid()}); fastpar reads and writes job "
            "files only in folders you own. Remove it, or pick another folder (--dir / FASTPAR_JOBS_DIR / folder=)"
        )
    return os.stat(path)


def write_private(path: str | Path, data: bytes | str) -> None:
    """Write ``data`` to ``path`` (mode 0600) through a fresh temporary file renamed over it."""
    with atomic_file(path, FILE_MODE, durable=False) as fh:
        fh.write(data.encode() if isinstance(data, str) else data)


def touch_private(path: str | Path) -> None:
    """Create ``path`` empty with mode 0600 unless it exists (never following a link at its name), so that
    later appends by any writer keep it private."""
    with contextlib.suppress(FileExistsError):
        os.close(create_new(path, FILE_MODE))


@contextlib.contextmanager
def private_umask() -> Iterator[int]:
    """Files created inside (by this process and the processes it starts) are private to their owner; yields
    the umask that was in force, for code that should run with it again. The umask is process-wide: a file
    another thread creates meanwhile is private too, never wider."""
    previous = os.umask(PRIVATE_UMASK)
    try:
        yield previous
    finally:
        os.umask(previous)
