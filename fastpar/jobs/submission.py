"""``fastpar.submit``: run a function in the background (MATLAB's ``parfeval``), here or on a cluster, and
get a future for it; and ``start_job``, the one path every fastpar job (submit, batch, sweep trial) takes
into submitit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from . import proctree
from .executor import check_resources, fill_local_gpus, make_executor, resolve_cluster, submitit
from .future import JobFuture
from .private_files import private_folder, private_umask
from .store import JobRecord, jobs_root, new_job_folder, now_iso
from .task import JobCall, pack_call


class JobSubmitError(RuntimeError):
    """The cluster refused to take the job (sbatch failed): the message says why and what was asked for."""


def describe(target: Any) -> str:
    """A short name for a function or script, for job lists."""
    if isinstance(target, (str, Path)):
        return str(target)
    module = getattr(target, "__module__", None)
    name = getattr(target, "__qualname__", None) or type(target).__name__
    return f"{module}.{name}" if module and module != "__main__" else name


def start_job(
    payload: bytes,
    *,
    kind: str,
    name: str,
    what: str,
    cluster: str,
    params: dict[str, Any],
    root: str | Path | None = None,
    folder: Path | None = None,
    slot: Any = None,
    result_from: str = "task0",
    threads_from_cores: bool = False,
) -> JobFuture:
    """Submit the packed call to ``cluster`` (resolved) with ``params`` (checked); the job's folder is
    ``folder`` or a new one under the jobs root."""
    if folder is None:
        job_id, folder = new_job_folder(jobs_root(root))
    else:
        private_folder(folder)
        job_id = folder.name
    executor = make_executor(folder, cluster, {**params, "name": params.get("name", name)})
    # The job's files (the pickled call, logs, results) are private: submitit writes them under this umask,
    # which the job's controller inherits (Slurm passes it on to the batch job); the user's function runs
    # with the umask the user had (JobCall restores it around the call).
    try:
        with private_umask() as user_umask:
            job = executor.submit(JobCall(payload, folder.resolve(), slot, threads_from_cores, user_umask))
    except submitit.core.utils.FailedJobError as exc:  # sbatch said no: its reason, in one line
        reason = " ".join(str(exc).split()) or "no reason given"
        raise JobSubmitError(
            f"{cluster} refused the job {name!r}: {reason}. Resources asked for: "
            f"{', '.join(f'{k}={v!r}' for k, v in params.items() if k != 'name')}"
        ) from None
    record = JobRecord(
        id=job_id,
        name=name,
        kind=kind,
        cluster=cluster,
        folder=str(folder.resolve()),
        cluster_job_id=str(job.job_id),
        num_tasks=job.num_tasks,
        result_from=result_from,
        submitted=now_iso(),
        what=what,
        resources={k: v for k, v in params.items() if k != "name"},
        slot=dataclasses.asdict(slot) if slot is not None else None,
    )
    if cluster == "local":
        controller = proctree.read_proc(int(job.job_id))
        record.controller_start_ticks = controller.start_ticks if controller else None
        record.process_marker = getattr(executor, "process_marker", None)
    record.save()
    return JobFuture(record, job)


def submit(
    fn: Callable[..., Any],
    *args: Any,
    resources: Mapping[str, Any] | None = None,
    cluster: str = "auto",
    name: str | None = None,
    root: str | Path | None = None,
) -> JobFuture:
    """Run ``fn(*args)`` in a job of its own and return its :class:`~fastpar.jobs.JobFuture` at once.

    ``resources``: submitit's parameters (``timeout_min``, ``gpus_per_node``, ``cpus_per_task``, ``mem_gb``,
    ``slurm_partition``, ...). Locally the job sees every GPU this session sees unless ``gpus_per_node``
    says otherwise. ``cluster``: "auto" (Slurm when there is one, else this machine), "local" or "slurm".
    ``root``: the jobs folder (default ``$FASTPAR_JOBS_DIR`` or ``~/.fastpar/jobs``). The job keeps running
    when this process exits; ``fastpar.jobs.load(future.id)`` finds it again.
    """
    payload = pack_call(fn, args)  # first: an object that can't travel is an error before anything exists
    cluster = resolve_cluster(cluster)
    params = check_resources(resources)
    if params.get("nodes", 1) > 1 or params.get("tasks_per_node", 1) > 1:
        raise ValueError("fastpar.submit runs one process; for several nodes or tasks use fastpar.batch(..., nodes=N)")
    if cluster == "local":
        fill_local_gpus(params, "fastpar.submit")
    return start_job(
        payload,
        kind="submit",
        name=name or getattr(fn, "__name__", "job"),
        what=describe(fn),
        cluster=cluster,
        params=params,
        root=root,
    )
