"""Talking to Slurm directly where submitit's way doesn't fit: whether a controller answers (``sinfo``),
a job's state when accounting is off (``sacct`` fails, so ``scontrol``/``squeue`` answer instead), and the
``sbatch``/``srun`` options that keep a job on the cores it asked for.

submitit reads job states only from ``sacct`` and logs a warning on every poll when it fails; fastpar
asks ``sacct`` once per process and, where it can't answer, never again.
"""

from __future__ import annotations

import functools
import os
import re
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


def task_cpus() -> tuple[int, ...] | None:
    """The CPUs Slurm allocated to this task on this node, or None outside a Slurm job step (or when the
    controller does not say). Where the cluster binds tasks (``TaskPlugin=task/affinity`` or ``task/cgroup``)
    this is the task's affinity already; where it does not (``task/none``, Debian's default), every task may run
    on every core, so fastpar pins a trial to these itself and trials on one node stay on their own cores.

    Read from the job's allocation (``scontrol show job -d``: ``CPU_IDs`` per node), this task's share of it
    (``SLURM_LOCALID`` x ``SLURM_CPUS_PER_TASK``), kept to the CPUs this process may use. Slurm numbers CPUs in
    its own (socket, core, thread) order, equal to the kernel's on nodes without SMT; where they differ the
    trials still get disjoint CPUs, though not always whole cores."""
    job_id, node = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURMD_NODENAME")
    if not job_id or not node or not hasattr(os, "sched_getaffinity"):
        return None
    done = _run(["scontrol", "show", "job", "-d", job_id], QUERY_TIMEOUT_S)
    allocated = None if done is None or done.returncode != 0 else node_cpu_ids(done.stdout, node)
    if not allocated:
        return None
    per_task = int(os.environ.get("SLURM_CPUS_PER_TASK", "0") or 0)
    local_id = int(os.environ.get("SLURM_LOCALID", "0") or 0)
    if per_task > 0 and len(allocated) >= (local_id + 1) * per_task:
        allocated = allocated[local_id * per_task : (local_id + 1) * per_task]
    usable = os.sched_getaffinity(0)
    mine = tuple(cpu for cpu in allocated if cpu in usable)
    return mine or None


def node_cpu_ids(show_job: str, node: str) -> list[int]:
    """The ``CPU_IDs`` that ``scontrol show job -d`` lists for ``node`` (its ``Nodes=`` may be a host list like
    ``n[1-3,5]``), sorted; empty when the node is not listed."""
    from ..topology.model import parse_cpu_list

    for match in re.finditer(r"\bNodes=(\S+)\s+CPU_IDs=([\d,\-]+)", show_job):
        if node in _host_names(match.group(1)):
            return sorted(parse_cpu_list(match.group(2)))
    return []


def _host_names(host_list: str) -> list[str]:
    """``"n[1-3,5],login"`` -> ``["n1", "n2", "n3", "n5", "login"]`` (Slurm's host list notation, zero padding
    kept)."""
    names = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", host_list):
        if plain:
            names.append(plain)
            continue
        for part in ranges.split(","):
            first, _, last = part.partition("-")
            width = len(first)
            names += [f"{prefix}{i:0{width}d}" for i in range(int(first), int(last or first) + 1)]
    return names


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
