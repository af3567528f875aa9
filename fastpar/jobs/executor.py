"""submitit's executors, chosen and configured for fastpar jobs: local processes on a laptop or a single
machine, Slurm one argument away.

``cluster``: ``"auto"`` (Slurm when a Slurm controller answers ``sinfo``, else local), ``"local"``, ``"slurm"`` or ``"debug"``
(in this process, for stepping through a job in a debugger). Resources are submitit's parameters:
the shared ones (``timeout_min``, ``gpus_per_node``, ``cpus_per_task``, ``nodes``, ``tasks_per_node``,
``mem_gb``, ``name``) and cluster-specific ones with their prefix (``slurm_partition``, ``slurm_account``,
``slurm_qos``, ``slurm_constraint``, ``slurm_setup``, ...), passed through unchanged.

One change to submitit's local executor: the job's controller starts in a session of its own, detached
from the submitter's output, so the job survives Ctrl-C and the closing of the terminal that submitted
it, and :mod:`.proctree` can find and stop every process it started.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import threading
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._optional import require
from . import proctree, slurm

submitit = require("submitit", extra="jobs", purpose="fastpar jobs (sweep, submit, batch)")
from submitit.local import local as _submitit_local  # noqa: E402 - after the check that names the extra

CLUSTERS = ("auto", "local", "slurm", "debug")
DEFAULT_TIMEOUT_MIN = 24 * 60  # submitit's own defaults (2 min locally, 5 on Slurm) would kill a training
_LOCAL_ONLY = ("visible_gpus", "setup", "signal_delay_s")
_MINIMUM = {"nodes": 1, "tasks_per_node": 1, "timeout_min": 1, "cpus_per_task": 1, "gpus_per_node": 0}


def resolve_cluster(cluster: str) -> str:
    """``"auto"`` -> ``"slurm"`` when a Slurm controller answers, else ``"local"`` (said in one line when Slurm's
    tools are here but nobody answers); ``"slurm"`` without a controller is an error."""
    if cluster not in CLUSTERS:
        raise ValueError(f"cluster must be one of {', '.join(CLUSTERS)}, got {cluster!r}")
    if cluster not in ("auto", "slurm"):
        return cluster
    problem = slurm.controller_problem()
    if cluster == "slurm" and problem:
        raise SlurmUnavailableError(
            f"cluster='slurm', but {problem}; submit from a Slurm login node whose controller answers `sinfo`, "
            "or use cluster='local' to run the job here"
        )
    if cluster == "auto" and problem:
        if shutil.which("sinfo") or shutil.which("srun"):
            _say_once(f"fastpar: no working Slurm here ({problem}); running jobs on this machine")
        return "local"
    return "slurm"


class SlurmUnavailableError(RuntimeError):
    """cluster='slurm' was asked for, but no Slurm controller answers on this machine."""


_said: set[str] = set()


def _say_once(line: str) -> None:
    if line not in _said:
        _said.add(line)
        print(line, file=sys.stderr)


def check_resources(resources: Mapping[str, Any] | None) -> dict[str, Any]:
    """Check resource names and types against the installed submitit; return them with fastpar's defaults."""
    params = dict(resources or {})
    shared = submitit.AutoExecutor._typed_parameters()  # name -> type
    slurm_only = submitit.SlurmExecutor._valid_parameters()
    problems = []
    for key, value in params.items():
        prefix, _, rest = key.partition("_")
        if key in shared:
            wanted = (int, float) if shared[key] is float else shared[key]
            if not isinstance(value, wanted) or (wanted is int and isinstance(value, bool)):
                problems.append(f"{key} must be {shared[key].__name__}, got {value!r}")
        elif not ((prefix == "slurm" and rest in slurm_only) or (prefix == "local" and rest in _LOCAL_ONLY)):
            problems.append(f"unknown resource {key!r}")
    for key, minimum in _MINIMUM.items():
        value = params.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < minimum:
            problems.append(f"{key} must be at least {minimum}, got {value!r}")
    if (
        isinstance(params.get("mem_gb"), (int, float))
        and not isinstance(params["mem_gb"], bool)
        and params["mem_gb"] <= 0
    ):
        problems.append(f"mem_gb must be above 0, got {params['mem_gb']!r}")
    for key, value in params.items():  # Slurm's own counts (slurm_cpus_per_gpu, slurm_mem_per_cpu, ...)
        if key.startswith("slurm_") and isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
            problems.append(f"{key} must not be negative, got {value!r}")
    if problems:
        raise ValueError(
            f"bad resources: {'; '.join(problems)}. Shared resources: {', '.join(sorted(shared))}; Slurm-only ones "
            f"take a slurm_ prefix ({', '.join('slurm_' + k for k in sorted(slurm_only)[:6])}, ...; see submitit's "
            "SlurmExecutor); local-only ones: " + ", ".join("local_" + k for k in _LOCAL_ONLY)
        )
    params.setdefault("timeout_min", DEFAULT_TIMEOUT_MIN)
    return params


def local_gpus() -> int:
    from ..train.environment import gpu_count

    return gpu_count()


def check_local_gpus(wanted: int, what: str) -> None:
    """Refuse to ask this machine for more GPUs than it has."""
    have = local_gpus()
    if wanted > have:
        raise ValueError(
            f"{what} asks for {wanted} GPU(s), but this machine has {have}; ask for at most {have}, "
            "or submit to a cluster that has them (cluster='slurm', slurm_partition=...)"
        )


def fill_local_gpus(params: dict[str, Any], what: str) -> None:
    """A local job: refuse more GPUs than this machine has; without ``gpus_per_node`` the job sees every GPU
    this session sees (submitit's local default, 0, would hide them all)."""
    if "gpus_per_node" in params:
        check_local_gpus(params["gpus_per_node"], f"{what}(gpus_per_node={params['gpus_per_node']})")
    else:
        params["gpus_per_node"] = local_gpus()


class _ControllerSubprocess(types.ModuleType):
    """``subprocess`` as submitit's local module sees it while fastpar submits: the controller's Popen starts
    a new session and writes to the job's ``controller.log``, not to the submitter's stdout — a shell's
    ``id=$(python submit.py)`` would otherwise wait for the job to close that pipe."""

    def __init__(self, log: Any, marker: str) -> None:
        super().__init__("subprocess")
        self._log, self._marker = log, marker

    def Popen(self, *args: Any, env: Mapping[str, str] | None = None, **kwargs: Any) -> subprocess.Popen:  # noqa: N802
        env = {**(os.environ if env is None else env), proctree.MARKER_ENV: self._marker}
        return subprocess.Popen(
            *args,
            env=env,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            **kwargs,
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)


_SUBMIT_LOCK = threading.Lock()


class SessionLocalExecutor(submitit.LocalExecutor):
    """submitit's LocalExecutor whose job controllers start in sessions of their own, detached from the
    submitting process's terminal and output, carrying a marker (``process_marker``) in their environment
    that every process they start inherits, so that cancel finds even those that left the session."""

    process_marker: str | None = None

    def _submit_command(self, command: str) -> Any:
        self.process_marker = secrets.token_hex(8)
        with _SUBMIT_LOCK, open(Path(self.folder) / "controller.log", "ab") as log:
            # seen only by submitit's local module
            _submitit_local.subprocess = _ControllerSubprocess(log, self.process_marker)
            try:
                return super()._submit_command(command)
            finally:
                _submitit_local.subprocess = subprocess


def make_executor(folder: str | Path, cluster: str, params: Mapping[str, Any]) -> Any:
    """A submitit executor writing into ``folder`` for ``cluster`` (resolved) with ``params`` (checked)."""
    if cluster == "local":
        executor = SessionLocalExecutor(folder)
        shared = submitit.AutoExecutor._typed_parameters()
        local = {k: v for k, v in params.items() if k in shared}
        local.update({k.removeprefix("local_"): v for k, v in params.items() if k.startswith("local_")})
        executor.update_parameters(**local)
        return executor
    params = dict(params)
    if cluster == "slurm":
        slurm.fill_slurm_defaults(params)
    executor = submitit.AutoExecutor(folder, cluster=cluster)
    executor.update_parameters(**params)
    return executor
