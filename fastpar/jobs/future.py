"""``JobFuture``: a submitted job as a ``concurrent.futures.Future`` — ``done()``, ``result(timeout)``,
``exception()``, ``cancel()``, ``add_done_callback`` and ``concurrent.futures.wait/as_completed`` work as
for a thread pool's futures — plus ``state()``, ``progress()``, ``logs()`` and the job's id and folder.

One watcher thread per process polls the unfinished futures (every ``POLL_S``) and completes each when
its job ends: with the function's return value, or its exception (the original type, when it could be
pickled, with the job's traceback attached as a note). A future made by ``load(job_id)`` in a fresh
process watches a job some other process submitted.

Only ``result()``/``exception()`` unpickle the job's files (a pickle runs code when read: read your own
jobs' only). ``state()`` — and so ``fastpar jobs list``/``status`` — tells a finished job from a failed one
by reading the tag submitit writes first in a result pickle ("success" or "error") with ``pickletools``,
which decodes opcodes without executing any.
"""

from __future__ import annotations

import concurrent.futures
import pickletools
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from . import channel, proctree, slurm
from .executor import submitit
from .private_files import write_private
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
    def _result_path(self, task: int) -> Path:
        return submitit.core.utils.JobPaths(self.folder, self.record.cluster_job_id, task).result_pickle

    def _outcome(self, task: int) -> tuple[str, Any] | None:
        """Task ``task``'s (tag, value), unpickled: for the result only, never for a state."""
        if task not in self._outcomes:
            path = self._result_path(task)
            if not path.exists():
                return None
            self._outcomes[task] = submitit.core.utils.pickle_load(path)
        return self._outcomes[task]

    def _outcome_tag(self, task: int) -> str | None:
        """The tag of task ``task``'s result ("success", "error" or "unreadable"), read without unpickling it;
        None while there is no result."""
        if task in self._outcomes:
            return self._outcomes[task][0]
        return result_tag(self._result_path(task))

    def _alive(self) -> str:
        """PENDING, RUNNING or FAILED (gone without a result) from the cluster's point of view."""
        if self.record.cluster == "slurm":  # not submitit's state: it polls sacct, which fails without accounting
            return _slurm_state(slurm.job_state(self.record.cluster_job_id))
        local = self._job.state  # also reaps our own child controller once it has exited
        if local == "RUNNING":
            return "RUNNING"
        if local.startswith("NO PROCESS") and self._controller_mismatch() is None:
            return "RUNNING"  # started by another process
        return "FAILED"

    def _controller_mismatch(self) -> str | None:
        """Why the process job.json names is not this local job's running controller; None when it is."""
        try:
            pid = int(self.record.cluster_job_id)
        except ValueError:
            return f"job.json names no controller process ({self.record.cluster_job_id!r})"
        return proctree.controller_mismatch(pid, self.record.controller_start_ticks, self.record.process_marker)

    def not_running_reason(self) -> str | None:
        """For a local job whose recorded controller pid is in use by a process that is not the job's: why
        (nothing of it is signalled); None otherwise."""
        if self.record.cluster != "local":
            return None
        why = self._controller_mismatch()
        return None if why is None or why.endswith("is not running") else f"{why}; nothing was signalled"

    def _finished_state(self) -> str | None:
        """FAILED when a task raised, COMPLETED when every task returned, None while results are missing."""
        tags = [self._outcome_tag(t) for t in range(self.record.num_tasks)]
        if any(tag is not None and tag != "success" for tag in tags):
            return "FAILED"
        return "COMPLETED" if all(tag is not None for tag in tags) else None

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
        # the marker first: a watcher seeing the job's processes gone must not take it for a failure
        marker = self.folder / CANCELLED_MARKER
        write_private(marker, time.strftime("%Y-%m-%dT%H:%M:%S\n"))
        try:
            self._stop()
        except BaseException:  # nothing was stopped (or all was resumed): the job runs on
            marker.unlink(missing_ok=True)
            raise
        return super().cancel()

    def _stop(self) -> None:
        if self.record.cluster == "slurm":
            self._job.cancel(check=False)  # scancel: Slurm ends every step of the job
        elif self.record.cluster == "local":
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
            try:
                self._stop()  # the other nodes would wait for the failed one until their timeouts
            except proctree.JobProcessesError as exc:  # the job's failure is the news; this is a warning beside it
                warnings.warn(f"job {self.id} failed, and its other tasks could not be stopped: {exc}", stacklevel=2)
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
                if "JobState TIMEOUT" in said:  # Slurm killed it before submitit's handler could write a result
                    raise self._over_time_limit(f"Slurm said: {said}. Logs: {stdout} and {stderr}")
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

    def _over_time_limit(self, where: str) -> JobFailedError:
        limit = self.record.resources.get("timeout_min")
        return JobFailedError(
            f"job {self.id} ({self.name}) exceeded its time limit ({limit} min) and was stopped; ask for more "
            f"with resources={{'timeout_min': ...}}. {where}"
        )

    def _failure(self, task: int, trace: str) -> BaseException:
        if "timed-out and not checkpointable" in trace:  # submitit's handler of Slurm's warning signal
            return self._over_time_limit(f"Logs in {self.folder}")
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


def result_tag(path: Path) -> str | None:
    """The tag submitit pickles first in a result file, ``("success", value)`` or ``("error", traceback)``,
    read by decoding opcodes up to the first string (nothing is executed: no class is looked up, no
    ``__reduce__`` is called); "unreadable" for a file that doesn't start that way; None when there is none."""
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        return None
    with fh:
        try:
            for opcode, arg, _ in pickletools.genops(fh):
                if opcode.name in ("PROTO", "FRAME", "MARK"):
                    continue
                if isinstance(arg, str) and "UNICODE" in opcode.name:
                    return arg if arg in ("success", "error") else "unreadable"
                return "unreadable"
        except (ValueError, EOFError, OSError):
            pass
    return "unreadable"


def load(job: str | Path, root: str | Path | None = None) -> JobFuture:
    """The future of job ``job`` (its id under the jobs root, or its folder), from any process."""
    return JobFuture(JobRecord.load(find_job(job, root)))


__all__ = ["JobFailedError", "JobFuture", "jobs_root", "load"]
