"""What travels to a job and runs there: the user's call, packed with cloudpickle in the submitting process.

Packing happens before anything is submitted, so an object that can't travel is a clear error naming it.
In the job the call is unpacked only after the submitter's import path is restored, so functions from
modules the submitting script could import (next to it, in a test folder) import in the job too.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .._pickling import Unpicklable, dumps_naming_culprit
from .channel import enter_job
from .private_files import write_private


class UnpicklableError(TypeError):
    """A function or argument of a job can't be sent to the job's process; the message names it."""


def pack_call(fn: Callable[..., Any], args: Sequence[Any], arg_names: Sequence[str] | None = None) -> bytes:
    """``(fn, args)`` as cloudpickle bytes; UnpicklableError naming the culprit when that fails."""
    import cloudpickle

    if not callable(fn):
        raise TypeError(f"a job needs a callable to run, got {type(fn).__name__}")
    names = list(arg_names or [f"argument {i}" for i in range(len(args))])
    parts = [("the function", fn), *zip(names, args, strict=False)]
    try:
        return dumps_naming_culprit((fn, tuple(args)), parts, default="the call", dumps=cloudpickle.dumps)
    except Unpicklable as exc:
        culprit, error = exc.culprit, exc.error
    raise UnpicklableError(
        f"{culprit} can't be sent to the job's process ({type(error).__name__}: {error}); nothing was submitted. "
        "Jobs run in other processes (maybe other machines): pass plain data (numbers, strings, tensors, paths, "
        "dataclasses) and functions, not open files, locks, sockets, generators or live process groups."
    ) from error


def call_packed(payload: bytes) -> Any:
    """Unpack and call what :func:`pack_call` packed (in a worker process started inside a job)."""
    import cloudpickle

    fn, args = cloudpickle.loads(payload)
    return fn(*args)


def exception_path(folder: str | Path, task: int) -> Path:
    return Path(folder) / f"exception-task{task}.pkl"


class JobCall:
    """The callable submitit runs in the job: restore the import path, enter the slot, call, keep the error."""

    def __init__(
        self,
        payload: bytes,
        folder: str | Path,
        slot: Any = None,
        threads_from_cores: bool = False,
        user_umask: int | None = None,
    ) -> None:
        """``threads_from_cores``: a trial placed by a cluster (no slot) runs on the cores the cluster allocated
        to it (pinned by fastpar on a Slurm that does not bind), and torch and OpenMP get as many threads.
        ``user_umask``: the submitter's umask, in force while the function runs (the job's own files are written
        under a private one)."""
        self.payload, self.folder, self.slot = payload, str(folder), slot
        self.threads_from_cores = threads_from_cores
        self.user_umask = user_umask
        self.sys_path = [p for p in sys.path if p]  # "" (the current folder) is the job's own cwd

    def __call__(self) -> Any:
        import cloudpickle

        enter_job(self.folder)
        sys.path.extend(p for p in self.sys_path if p not in sys.path)
        if self.slot is not None:
            self.slot.enter()
        elif getattr(self, "threads_from_cores", False) and hasattr(os, "sched_getaffinity"):
            from .slots import Slot
            from .slurm import task_cpus

            # on Slurm, the CPUs it allocated to this task even where the cluster does not bind (task/none)
            Slot(0, task_cpus() or tuple(sorted(os.sched_getaffinity(0)))).enter()
        fn, args = cloudpickle.loads(self.payload)
        user_umask = getattr(self, "user_umask", None)
        job_umask = os.umask(user_umask) if user_umask is not None else None
        try:
            return fn(*args)
        except Exception as exc:
            self._keep(exc)
            raise
        finally:
            if job_umask is not None:  # submitit writes the result next: private again
                os.umask(job_umask)

    def _keep(self, exc: Exception) -> None:
        """Pickle the exception itself next to submitit's traceback text, so ``result()`` re-raises its type."""
        import cloudpickle

        task = int(os.environ.get("SUBMITIT_LOCAL_GLOBALID", os.environ.get("SLURM_PROCID", "0")))
        try:
            write_private(exception_path(self.folder, task), cloudpickle.dumps(exc))
        except Exception:  # an exception that can't be pickled: the traceback text is still kept by submitit
            pass
