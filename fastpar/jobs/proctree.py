"""Every process of a local job, found and stopped together (Linux ``/proc``).

A local job's controller starts in a session of its own, so whatever it starts stays in that session even
after its parent dies and it is re-parented to init. Some launchers give their children new sessions
(torch's elastic agent does for program workers), so a job's processes are the session's members plus
every descendant of any of them. A process that left the session and lost its parent (``setsid`` plus a
double fork, as daemons do) is found by the marker every process of the job inherits in its environment
(``MARKER_ENV``, set on the controller when it starts). To stop a job, the whole set is frozen first (SIGSTOP: nothing can start
another process or exit and orphan its children mid-way), re-scanned until no new member appears, then
killed (SIGKILL) — no orphans are left behind.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

MARKER_ENV = "FASTPAR_JOB_MARKER"


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    session: int
    start_ticks: int  # since boot, in clock ticks: tells a reused pid apart
    state: str  # R, S, D, T, Z, ...

    @property
    def alive(self) -> bool:
        return self.state not in ("Z", "X")


def read_proc(pid: int) -> Proc | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # "pid (comm) state ppid pgrp session ... starttime(22nd field)": comm may hold spaces and parentheses
    fields = text[text.rindex(")") + 2 :].split()
    return Proc(pid, int(fields[1]), int(fields[3]), int(fields[19]), fields[0])


def snapshot() -> dict[int, Proc]:
    procs = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (proc := read_proc(int(entry.name))) is not None:
            procs[proc.pid] = proc
    return procs


def is_running(pid: int, start_ticks: int | None) -> bool:
    """True while process ``pid`` (the one that started at ``start_ticks``, when given) is alive."""
    proc = read_proc(pid)
    return proc is not None and proc.alive and (start_ticks is None or proc.start_ticks == start_ticks)


def has_marker(pid: int, marker: str) -> bool:
    """True when process ``pid`` started with ``MARKER_ENV=marker`` in its environment."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone, or another user's
        return False
    return f"{MARKER_ENV}={marker}".encode() in environ.split(b"\0")


def job_processes(leader: int, start_ticks: int | None = None, marker: str | None = None) -> list[Proc]:
    """Living processes of the job whose controller is ``leader`` (a session leader): the leader, its
    session's members, the processes carrying the job's ``marker`` and their descendants. The calling
    process is never included."""
    procs = snapshot()
    root = procs.get(leader)
    members = {p.pid for p in procs.values() if p.session == leader}
    if marker:
        members |= {p.pid for p in procs.values() if p.pid not in members and has_marker(p.pid, marker)}
    if root is not None and (start_ticks is None or root.start_ticks == start_ticks):
        members.add(leader)
    grew = True
    while grew:  # descendants, whatever session they started
        new = {p.pid for p in procs.values() if p.ppid in members} - members
        members |= new
        grew = bool(new)
    members.discard(os.getpid())
    return [procs[pid] for pid in sorted(members) if procs[pid].alive]


def _signal(pids: set[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def kill_job(
    leader: int, start_ticks: int | None = None, timeout_s: float = 10.0, marker: str | None = None
) -> list[int]:
    """Freeze, then kill every process of the job; return their pids. Raises TimeoutError naming the
    processes still alive after ``timeout_s``."""
    frozen: set[int] = set()
    while True:  # freeze until a scan finds nobody new (a process may fork between scan and SIGSTOP)
        found = {p.pid for p in job_processes(leader, start_ticks, marker)} - frozen
        if not found:
            break
        _signal(found, signal.SIGSTOP)
        frozen |= found
    _signal(frozen, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while True:
        left = [pid for pid in frozen if (p := read_proc(pid)) is not None and p.alive]
        if not left:
            return sorted(frozen)
        if time.monotonic() > deadline:
            raise TimeoutError(f"processes {left} of job {leader} are still alive {timeout_s:.0f} s after SIGKILL")
        time.sleep(0.05)
