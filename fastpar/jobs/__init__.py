"""``fastpar.jobs``: many trainings at once (``sweep``), training in the background (``submit`` → a
future), batch jobs on a cluster (``batch``) — all through submitit's executors: local processes here,
Slurm with ``cluster="slurm"`` (or automatically on a Slurm login node).

Names load on first use, so the trainer can import the progress channel without submitit installed.
"""

from __future__ import annotations

import importlib

__all__ = [
    "JobFailedError",
    "JobFuture",
    "JobNotFoundError",
    "SweepResult",
    "UnpicklableError",
    "batch",
    "job_dir",
    "jobs_root",
    "list_jobs",
    "load",
    "plan_slots",
    "report",
    "submit",
    "sweep",
]

_LAZY = {
    "JobFailedError": "fastpar.jobs.future",
    "JobFuture": "fastpar.jobs.future",
    "load": "fastpar.jobs.future",
    "JobNotFoundError": "fastpar.jobs.store",
    "jobs_root": "fastpar.jobs.store",
    "list_jobs": "fastpar.jobs.store",
    "SweepResult": "fastpar.jobs.results",
    "UnpicklableError": "fastpar.jobs.task",
    "batch": "fastpar.jobs.batchjob",
    "job_dir": "fastpar.jobs.channel",
    "report": "fastpar.jobs.channel",
    "plan_slots": "fastpar.jobs.slots",
    "submit": "fastpar.jobs.submission",
    "sweep": "fastpar.jobs.sweeper",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'fastpar.jobs' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
