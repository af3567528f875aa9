"""Names of the shared-memory segments of the "fastpar" backend, and the sweep that removes those a crash left.

A segment lives in /dev/shm only from the moment rank 0 creates it until every rank has mapped it (then rank 0
unlinks the name; the memory goes away with the last mapping). Only a crash inside that window leaves a name
behind. The name says who made it: ``fastpar.<uid>.<pid>.<process start time>.<group>.<n>``, so the next group
created on the machine removes those whose creator is gone (same user only; /dev/shm is sticky anyway).
"""

from __future__ import annotations

import itertools
import os
import re
from pathlib import Path

SHM_DIR = Path("/dev/shm")
_PREFIX = "fastpar"
_counter = itertools.count()


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), None when it is gone:
    with the pid it names one process, even after the pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the command name may contain spaces and parentheses
    return fields[19]


def segment_name(group: str) -> str:
    """A new segment name for ``group`` of this job, unique on the machine (``shm_open`` form, with the slash)."""
    pid = os.getpid()
    tag = re.sub(r"[^A-Za-z0-9_-]", "_", group)[:48] or "group"
    return f"/{_PREFIX}.{os.geteuid()}.{pid}.{_start_time(pid)}.{tag}.{next(_counter)}"


def _creator_alive(name: str) -> bool:
    parts = name.split(".")
    try:
        pid = int(parts[2])
    except (IndexError, ValueError):
        return True  # not one of ours in the expected form: leave it
    return _start_time(pid) == parts[3]


def sweep_stale_segments(directory: Path = SHM_DIR) -> list[str]:
    """Remove this user's fastpar segments whose creating process no longer exists; returns their names."""
    removed = []
    mine = f"{_PREFIX}.{os.geteuid()}."
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed
    for path in entries:
        if not path.name.startswith(mine) or _creator_alive(path.name):
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
