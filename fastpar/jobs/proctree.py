"""Every process of a local job, found and stopped together (Linux ``/proc``).

A local job's controller starts in a session of its own with a marker in its environment (``MARKER_ENV``,
a random value recorded in ``job.json``) that every process it starts inherits. A process is the job's
when it carries that marker, or descends from one that does; the controller's session counts too, once the
controller itself is proven (it carries the marker and started at the recorded time — a pid alone may
have been reused, and a ``job.json`` may have been written by anyone who could write the folder).
Environments are read from ``/proc/PID/environ``, which only the process's owner (and root) can read, so
another user's process is never taken for the job's.

To stop a job, the whole set is frozen first (SIGSTOP: nothing can start another process or exit and
orphan its children mid-way), re-scanned until no new member appears, then killed (SIGKILL) — no orphans
are left behind. When any signal fails half-way, every process frozen so far is resumed (SIGCONT) before
the error is raised: a failed cancel never leaves a process stopped.
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
    """True while process ``pid``, the one that started at ``start_ticks``, is alive (never for None: a pid
    alone may belong to any later process)."""
    proc = read_proc(pid)
    return proc is not None and proc.alive and start_ticks is not None and proc.start_ticks == start_ticks


def has_marker(pid: int, marker: str) -> bool:
    """True when process ``pid`` started with ``MARKER_ENV=marker`` in its environment."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone, or another user's
        return False
    return f"{MARKER_ENV}={marker}".encode() in environ.split(b"\0")


class JobProcessesError(RuntimeError):
    """The job's processes can't be told apart from others (no marker recorded), or a signal to one of
    them failed; nothing is left stopped, and the message says what was done."""


def controller_mismatch(pid: int, start_ticks: int | None, marker: str | None) -> str | None:
    """Why process ``pid`` is not a job's running controller (recorded start time ``start_ticks``, marker
    ``marker``); None when it is."""
    proc = read_proc(pid)
    if proc is None or not proc.alive:
        return f"process {pid} is not running"
    if start_ticks is None or marker is None:
        return f"job.json records no start time or marker for process {pid}, so it can't be told apart from others"
    if proc.start_ticks != start_ticks:
        return f"process {pid} started at another time than the job's controller (a later process with its pid)"
    if not has_marker(pid, marker):
        return f"process {pid} does not carry the job's marker ({MARKER_ENV}): it is not the job's"
    return None


def job_processes(leader: int, start_ticks: int | None = None, marker: str | None = None) -> list[Proc]:
    """Living processes of the job whose controller is ``leader`` (a session leader) and whose marker is
    ``marker``: those carrying the marker, their descendants and, when the controller is proven (marker
    and ``start_ticks``), its session. Without a marker, none. The calling process is never included."""
    if not marker:
        return []
    procs = snapshot()
    members = {p.pid for p in procs.values() if has_marker(p.pid, marker)}
    if controller_mismatch(leader, start_ticks, marker) is None:
        members |= {leader} | {p.pid for p in procs.values() if p.session == leader}
    grew = True
    while grew:  # descendants, whatever session they started
        new = {p.pid for p in procs.values() if p.ppid in members} - members
        members |= new
        grew = bool(new)
    members.discard(os.getpid())
    return [procs[pid] for pid in sorted(members) if procs[pid].alive]


def _signal(pids: list[int], sig: int, done: set[int]) -> None:
    """Send ``sig`` to ``pids``, adding each signalled one to ``done`` as it goes (so that a failure half-way
    leaves ``done`` exact)."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            continue
        done.add(pid)


def _resume(pids: set[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except OSError:  # gone, or not ours to signal: nothing left to resume
            pass


def kill_job(
    leader: int, start_ticks: int | None = None, timeout_s: float = 10.0, marker: str | None = None
) -> list[int]:
    """Freeze, then kill every process of the job; return their pids. Raises JobProcessesError when the job
    has no marker to find its processes by, or a signal fails (everything frozen is resumed first), and
    TimeoutError naming the processes still alive after ``timeout_s``."""
    if not marker:
        raise JobProcessesError(
            f"job.json records no process marker for job {leader}, so its processes can't be told apart from "
            "others; nothing was signalled (stop them yourself, e.g. with kill after checking `ps -s` and `ps -f`)"
        )
    frozen: set[int] = set()
    try:
        while True:  # freeze until a scan finds nobody new (a process may fork between scan and SIGSTOP)
            found = [p.pid for p in job_processes(leader, start_ticks, marker) if p.pid not in frozen]
            if not found:
                break
            _signal(found, signal.SIGSTOP, frozen)
        _signal(sorted(frozen), signal.SIGKILL, set())
    except BaseException as exc:
        _resume(frozen)
        if isinstance(exc, OSError):
            raise JobProcessesError(
                f"could not signal a process of job {leader} ({type(exc).__name__}: {exc}); the processes "
                f"stopped so far ({sorted(frozen)}) were resumed, the job goes on"
            ) from exc
        raise
    deadline = time.monotonic() + timeout_s
    while True:
        left = [pid for pid in frozen if (p := read_proc(pid)) is not None and p.alive]
        if not left:
            return sorted(frozen)
        if time.monotonic() > deadline:
            raise TimeoutError(f"processes {left} of job {leader} are still alive {timeout_s:.0f} s after SIGKILL")
        time.sleep(0.05)
