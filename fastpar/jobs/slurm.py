"""Talking to Slurm directly where submitit's way doesn't fit: whether a controller answers (``sinfo``),
a job's state when accounting is off (``sacct`` fails, so ``scontrol``/``squeue`` answer instead), and the
``sbatch``/``srun`` options that keep a job on the cores it asked for.

submitit reads job states only from ``sacct`` and logs a warning on every poll when it fails; fastpar
asks ``sacct`` once per process and, where it can't answer, never again.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import warnings
from typing import Any

CONTROLLER_TIMEOUT_S = 10.0
QUERY_TIMEOUT_S = 15.0
GONE = "GONE"  # the controller no longer knows the job (ended longer ago than its MinJobAge)


def _run(command: list[str], timeout: float) -> subprocess.CompletedProcess | None:
    """The finished command, or None when it could not run or did not finish within ``timeout``."""
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None


def controller_problem() -> str | None:
    """None when a Slurm controller answers here; else why not, in a few words (asked once per PATH)."""
    return _controller_problem(os.environ.get("PATH", ""))


@functools.lru_cache(maxsize=8)
def _controller_problem(path: str) -> str | None:
    if shutil.which("sinfo", path=path) is None or shutil.which("sbatch", path=path) is None:
        return "Slurm's sinfo/sbatch are not on this machine's PATH"
    done = _run(["sinfo", "-h", "-o", "%P %a"], CONTROLLER_TIMEOUT_S)
    if done is None:
        return f"no Slurm controller answered `sinfo` within {CONTROLLER_TIMEOUT_S:g} s"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"`sinfo` failed: {last}"
    if not done.stdout.strip():
        return "`sinfo` lists no partition"
    return None


def _sacct_works() -> bool:
    return _sacct_answers(os.environ.get("PATH", ""))


@functools.lru_cache(maxsize=8)
def _sacct_answers(path: str) -> bool:
    """False where accounting is off ("Slurm accounting storage is disabled"): asked once, never polled."""
    done = _run(["sacct", "-n", "-X", "-j", "1", "-o", "JobID"], QUERY_TIMEOUT_S)
    return done is not None and done.returncode == 0


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _from_sacct(job_id: str) -> str | None:
    done = _run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "JobID,State"], QUERY_TIMEOUT_S)
    for line in () if done is None else done.stdout.splitlines():
        jid, _, state = line.partition("|")
        if jid == job_id and state:
            return state.split()[0]
    return None


def _from_scontrol(job_id: str) -> str | None:
    done = _run(["scontrol", "-o", "show", "job", job_id], QUERY_TIMEOUT_S)
    if done is None:
        return None
    if done.returncode != 0:
        return GONE if "Invalid job id" in done.stderr else None
    for field in done.stdout.split():
        if field.startswith("JobState="):
            return field.removeprefix("JobState=")
    return None


def job_state(job_id: str) -> str:
    """Slurm's word for the job (PENDING, RUNNING, COMPLETED, FAILED, TIMEOUT, CANCELLED, ...), GONE when the
    controller has forgotten it, UNKNOWN when nobody answered (warned once)."""
    accounting = _sacct_works()
    if accounting and (state := _from_sacct(job_id)) is not None:
        return state
    state = _from_scontrol(job_id)
    if accounting and state in (None, GONE):
        return "UNKNOWN"  # not in accounting yet: it will be soon
    if state is None:
        _warn_once(
            f"Slurm did not answer about job {job_id} (sacct and scontrol both failed); "
            "its state is taken as unknown until it does"
        )
        return "UNKNOWN"
    return state


def job_reason(job_id: str) -> str:
    """The controller's ``Reason`` and time limit for a job, for messages ("" when it doesn't know)."""
    done = _run(["scontrol", "-o", "show", "job", job_id], QUERY_TIMEOUT_S)
    if done is None or done.returncode != 0:
        return ""
    fields = dict(f.partition("=")[::2] for f in done.stdout.split() if "=" in f)
    return ", ".join(f"{k} {fields[k]}" for k in ("JobState", "Reason", "TimeLimit", "RunTime") if k in fields)


def fill_slurm_defaults(params: dict[str, Any]) -> None:
    """Each task on the cores it asked for (``--cpus-per-task``, bound with ``--cpu-bind``), and submitit's
    warning signal early enough to be useful on short time limits (its default, 90 s before the end, would
    arrive at once on a 1-minute job)."""
    params.setdefault("cpus_per_task", 1)
    srun_args = list(params.get("slurm_srun_args") or [])
    if not any(arg.startswith("--cpu-bind") for arg in srun_args):
        srun_args.append("--cpu-bind=cores")
    params["slurm_srun_args"] = srun_args
    limit_s = params.get("timeout_min", 0) * 60
    if "slurm_signal_delay_s" not in params and 0 < limit_s <= 4 * 90:
        params["slurm_signal_delay_s"] = max(5, limit_s // 4)
