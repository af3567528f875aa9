"""Names of the shared-memory segments of the "fastpar" backend, and the sweep that removes those a crash left.

A segment lives in /dev/shm only from the moment rank 0 creates it until every rank has mapped it (then rank 0
unlinks the name; the memory goes away with the last mapping). Only a crash inside that window leaves a name
behind. The name says who made it, in a form that stays true across containers sharing one /dev/shm:
``fastpar.<uid>.<boot id>.<pid namespace>.<pid>.<process start time>.<group>.<n>-<random>``. Every other part can
be read from /proc by any local user; the random part keeps them from creating the name first, and a name that
exists anyway (``EEXIST``) is retried under a new one (:func:`create_segment`). The next group created on the
machine removes this user's names whose creator is gone for sure: made in an earlier boot, or in this process's
PID namespace by a process that no longer runs. A name made in another PID namespace (another container) is left
alone, since its pid means nothing here.
"""

from __future__ import annotations

import errno
import itertools
import os
import re
import secrets
from collections.abc import Callable
from pathlib import Path

SHM_DIR = Path("/dev/shm")
_PREFIX = "fastpar"
_counter = itertools.count()
_CREATE_ATTEMPTS = 8


def _start_time(pid: int | str) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), None when it is gone:
    with the pid it names one process, even after the pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the command name may contain spaces and parentheses
    return fields[19]


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")
    except OSError:
        return "noboot"


def _pid_namespace() -> str:
    """This process's PID namespace: its inode, unique among the namespaces alive on the machine."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "nons"


def creator_tag(pid: int | None = None, start: str | None = None) -> str:
    """``<boot id>.<pid namespace>.<pid>.<start time>`` of this process (or of ``pid`` started at ``start`` in this
    process's namespace): the part of a segment name that says who made it."""
    if pid is None:
        pid, start = os.getpid(), _start_time("self")  # /proc/self: right even where /proc is another namespace's
    return f"{_boot_id()}.{_pid_namespace()}.{pid}.{start}"


def segment_name(group: str) -> str:
    """A new segment name for ``group`` of this job, unique on the machine (``shm_open`` form, with the slash)."""
    tag = re.sub(r"[^A-Za-z0-9_-]", "_", group)[:48] or "group"
    return f"/{_PREFIX}.{os.geteuid()}.{creator_tag()}.{tag}.{next(_counter)}-{secrets.token_hex(8)}"


def _name_taken(error: RuntimeError) -> bool:
    """Whether the extension's create error is EEXIST (its messages end in ``(errno N)``)."""
    return f"(errno {errno.EEXIST})" in str(error)


def create_segment(create: Callable[[str], object], group: str) -> str:
    """Call ``create(name)`` with a new :func:`segment_name` until one is not taken; returns the name created.

    A taken name is another user's squat (or a collision of 64 random bits): creation is ``O_EXCL``, so nothing
    of theirs is opened, and a fresh name keeps the group on shared memory. Other errors pass through.
    """
    for attempt in range(_CREATE_ATTEMPTS):
        name = segment_name(group)
        try:
            create(name)
            return name
        except RuntimeError as error:
            if not _name_taken(error) or attempt == _CREATE_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def _creator_gone(name: str) -> bool:
    """True only when the process that made segment ``name`` surely no longer runs."""
    parts = name.split(".")
    if len(parts) == 10 and parts[8].startswith("b") and parts[9].startswith("r"):
        parts = parts[:8]  # a shared buffer of the segment's group (shared_buffers.py): its segment's creator
    if len(parts) != 8:
        return False  # not in the expected form (another version's): leave it
    _, _, boot, namespace, pid, start, _, _ = parts
    here = _boot_id()
    if "noboot" in (boot, here):
        return False
    if boot != here:
        return True  # made before the last reboot (a /dev/shm that outlived it)
    if namespace != _pid_namespace() or namespace == "nons":
        return False  # another container's process: its pid cannot be looked up here
    return _start_time(pid) != start


def sweep_stale_segments(directory: Path = SHM_DIR) -> list[str]:
    """Remove this user's fastpar segments whose creating process surely no longer exists; returns their names."""
    removed = []
    mine = f"{_PREFIX}.{os.geteuid()}."
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed
    for path in entries:
        if not path.name.startswith(mine) or not _creator_gone(path.name):
            continue
        try:
            path.unlink()
            removed.append(path.name)
        except OSError:  # removed by another rank's sweep meanwhile, or not ours
            pass
    return removed


def list_segments(directory: Path = SHM_DIR) -> list[str]:
    """This user's fastpar segment names in /dev/shm (for tests and diagnostics)."""
    mine = f"{_PREFIX}.{os.geteuid()}."
    try:
        return sorted(p.name for p in directory.iterdir() if p.name.startswith(mine))
    except OSError:
        return []
