"""``JobFuture``: a submitted job as a ``concurrent.futures.Future`` — ``done()``, ``result(timeout)``,
``exception()``, ``cancel()``, ``add_done_callback`` and ``concurrent.futures.wait/as_completed`` work as
for a thread pool's futures — plus ``state()``, ``progress()``, ``logs()`` and the job's id and folder.

One watcher thread per process polls the unfinished futures (every ``POLL_S``) and completes each when
its job ends: with the function's return value, or its exception (the original type, when it could be
pickled, with the job's traceback attached as a note). A future made by ``load(job_id)`` in a fresh
process watches a job some other process submitted.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from pathlib import Path
from typing import Any

from . import channel, proctree, slurm
from .executor import submitit
from .store import JobRecord, find_job, jobs_root
from .task import exception_path

POLL_S = 0.5
CANCELLED_MARKER = "cancelled"
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED")


class JobFailedError(RuntimeError):
    """A job ended without a result: its function raised something that can't be re-raised here, it was
    killed, or the cluster stopped it. The message names the job and shows its traceback or log tail."""


def _slurm_state(state: str) -> str:
    word = state.split()[0] if state else "UNKNOWN"
    if word in ("PENDING", "REQUEUED", "CONFIGURING", "UNKNOWN", "RESIZING", "SUSPENDED"):
        return "PENDING"
    if word in ("RUNNING", "COMPLETING", "COMPLETED"):  # COMPLETED without a result yet: the file is on its way
        return "RUNNING"
    return "CANCELLED" if word == "CANCELLED" else "FAILED"  # FAILED, TIMEOUT, OUT_OF_MEMORY, NODE_FAIL, ...


class JobFuture(concurrent.futures.Future):
    """A running or finished fastpar job. Get one from ``fastpar.submit``/``batch``, or ``load(job_id)``."""

    def __init__(self, record: JobRecord, job: Any = None, *, watch: bool = True) -> None:
        """``watch=False``: nobody completes this future in the background (for a quick ``state()``);
        ``poll()`` completes it once the job has ended."""
        super().__init__()
        self.record = record
        tasks = list(range(record.num_tasks))
        job_class = submitit.SlurmJob if record.cluster == "slurm" else submitit.LocalJob
        self._job = job if job is not None else job_class(record.folder, record.cluster_job_id, tasks=tasks)
        self._outcomes: dict[int, tuple[str, Any]] = {}
        if watch:
            _WATCHER.watch(self)

    # --- what it is -----------------------------------------------------------------------------
    @property
    def id(self) -> str:
        return self.record.id

    @property
    def name(self) -> str:
        return self.record.name

    @property
    def folder(self) -> Path:
        return Path(self.record.folder)

    def __repr__(self) -> str:
        return f"<JobFuture {self.id} {self.name!r} {self.record.cluster} {self.state()}>"

    # --- how it is going ------------------------------------------------------------------------
    def _outcome(self, task: int) -> tuple[str, Any] | None:
        if task not in self._outcomes:
            path = submitit.core.utils.JobPaths(self.folder, self.record.cluster_job_id, task).result_pickle
            if not path.exists():
                return None
            self._outcomes[task] = submitit.core.utils.pickle_load(path)
        return self._outcomes[task]

    def _alive(self) -> str:
        """PENDING, RUNNING or FAILED (gone without a result) from the cluster's point of view."""
        if self.record.cluster == "slurm":  # not submitit's state: it polls sacct, which fails without accounting
            return _slurm_state(slurm.job_state(self.record.cluster_job_id))
        local = self._job.state  # also reaps our own child controller once it has exited
        if local == "RUNNING":
            return "RUNNING"
        if local.startswith("NO PROCESS") and proctree.is_running(
            int(self.record.cluster_job_id), self.record.controller_start_ticks
        ):
            return "RUNNING"  # started by another process
        return "FAILED"

    def _finished_state(self) -> str | None:
        """FAILED when a task raised, COMPLETED when every task returned, None while results are missing."""
        outcomes = [self._outcome(t) for t in range(self.record.num_tasks)]
        if any(o is not None and o[0] == "error" for o in outcomes):
            return "FAILED"
        return "COMPLETED" if all(o is not None for o in outcomes) else None

    def state(self) -> str:
        """PENDING, RUNNING, COMPLETED, FAILED or CANCELLED."""
        finished = self._finished_state()
        if finished is not None:
            return finished
        if (self.folder / CANCELLED_MARKER).exists():
            return "CANCELLED"
        alive = self._alive()
        if alive == "FAILED":  # gone: its last result may have landed after the first look
            return self._finished_state() or "FAILED"
        return alive

    def running(self) -> bool:
        return not self.done() and self.state() == "RUNNING"

    def progress(self) -> dict[str, Any] | None:
        """The latest metrics the job published (a Trainer's logged step: epoch, iteration, loss, val_loss,
        ...; or what the function passed to ``fastpar.jobs.report``), or None before the first."""
        return channel.read_latest(self.folder)

    def history(self) -> list[dict[str, Any]]:
        """Every metrics record the job published so far."""
        return channel.read_history(self.folder)

    def log_paths(self, task: int = 0) -> tuple[Path, Path]:
        paths = submitit.core.utils.JobPaths(self.folder, self.record.cluster_job_id, task)
        return paths.stdout, paths.stderr

    def logs(self, task: int = 0) -> str:
        """The job's standard output and error so far (task ``task`` of a multi-node job)."""
        parts = []
        for label, path in zip(("stdout", "stderr"), self.log_paths(task), strict=True):
            text = path.read_text(errors="replace") if path.exists() else ""
            parts.append(f"==> {label}: {path} <==\n{text}")
        return "\n".join(parts)

    # --- ending it ------------------------------------------------------------------------------
    def cancel(self) -> bool:
        """Stop the job and every process it started; True unless it had already finished."""
        if self.done():
            return False
        (self.folder / CANCELLED_MARKER).write_text(time.strftime("%Y-%m-%dT%H:%M:%S\n"))
        self._stop()
        return super().cancel()

    def _stop(self) -> None:
        if self.record.cluster == "slurm":
            self._job.cancel(check=False)  # scancel: Slurm ends every step of the job
        else:
            proctree.kill_job(
                int(self.record.cluster_job_id), self.record.controller_start_ticks, marker=self.record.process_marker
            )
            self._job.state  # noqa: B018 - reap our child controller, if it is ours

    def poll(self) -> bool:
        """Complete the future if the job has ended; True when it is done."""
        if self.done():
            return True
        state = self.state()
        if state not in TERMINAL:
            return False
        if state == "CANCELLED":
            super().cancel()
            return True
        if state == "FAILED" and self.record.num_tasks > 1:
            self._stop()  # the other nodes would wait for the failed one until their timeouts
        try:
            value, error = self._value(), None
        except BaseException as exc:  # noqa: BLE001 - any error of the job becomes the future's
            value, error = None, exc
        if self.set_running_or_notify_cancel():
            if error is None:
                self.set_result(value)
            else:
                self.set_exception(error)
        return True

    def _value(self) -> Any:
        values = []
        for task in range(self.record.num_tasks):
            outcome = self._outcome(task)
            if outcome is None:
                stdout, stderr = self.log_paths(task)
                tail = stderr.read_text(errors="replace")[-2000:] if stderr.exists() else ""
                said = slurm.job_reason(self.record.cluster_job_id) if self.record.cluster == "slurm" else ""
                raise JobFailedError(
                    f"job {self.id} ({self.name}) task {task} ended without a result (killed, out of memory, or "
                    f"stopped by the cluster{': ' + said if said else ''}). Logs: {stdout} and {stderr}; their "
                    f"end:\n{tail}"
                )
            if outcome[0] == "error":
                raise self._failure(task, outcome[1])
            values.append(outcome[1])
        if self.record.result_from == "rank0":  # each node's agent returned {global rank: value}
            return next(v[0] for v in values if isinstance(v, dict) and 0 in v)
        return values[0]

    def _failure(self, task: int, trace: str) -> BaseException:
        if "timed-out and not checkpointable" in trace:  # submitit's handler of Slurm's warning signal
            limit = self.record.resources.get("timeout_min")
            return JobFailedError(
                f"job {self.id} ({self.name}) exceeded its time limit ({limit} min) and was stopped; ask for more "
                f"with resources={{'timeout_min': ...}}. Logs in {self.folder}"
            )
        note = (
            f"job {self.id} ({self.name}) failed in task {task}; logs in {self.folder}. Traceback in the job:\n{trace}"
        )
        path = exception_path(self.folder, task)
        if path.exists():
            try:
                exc = submitit.core.utils.pickle_load(path)
            except Exception:  # its class can't be imported here
                exc = None
            if isinstance(exc, BaseException):
                if hasattr(exc, "add_note"):
                    exc.add_note(note)
                return exc
        return JobFailedError(note)


class _Watcher:
    """One daemon thread completing the futures of this process as their jobs end."""

    def __init__(self) -> None:
        self._futures: list[JobFuture] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, future: JobFuture) -> None:
        with self._lock:
            self._futures.append(future)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="fastpar-jobs-watcher", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                futures = list(self._futures)
            done = []
            for future in futures:
                try:
                    if future.poll():
                        done.append(future)
                except Exception as exc:  # a job folder that vanished: fail that future, keep watching the others
                    if not future.done() and future.set_running_or_notify_cancel():
                        future.set_exception(exc)
                    done.append(future)
            with self._lock:
                self._futures = [f for f in self._futures if f not in done]
                if not self._futures:
                    self._thread = None
                    return
            time.sleep(POLL_S)


_WATCHER = _Watcher()


def load(job: str | Path, root: str | Path | None = None) -> JobFuture:
    """The future of job ``job`` (its id under the jobs root, or its folder), from any process."""
    return JobFuture(JobRecord.load(find_job(job, root)))


__all__ = ["JobFailedError", "JobFuture", "jobs_root", "load"]
