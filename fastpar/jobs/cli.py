"""``fastpar jobs``: the jobs submitted with ``fastpar.submit``/``fastpar.batch``, from any shell, later.

    fastpar jobs list                 # id, name, kind, cluster, state, submitted, what
    fastpar jobs status ID            # state, folder, resources, latest metrics
    fastpar jobs logs ID [-f]         # stdout and stderr (-f: follow until the job ends)
    fastpar jobs result ID [--wait]   # the return value (exit 1 when the job failed, 3 while it runs)
    fastpar jobs cancel ID            # stop it and every process it started

ID is a job's id or its folder (a sweep trial's folder works too). ``--dir`` or ``FASTPAR_JOBS_DIR``
picks the jobs folder (default ``~/.fastpar/jobs``).

Only ``result`` unpickles what a job left (its return value or exception): ``list``, ``status``, ``logs``
and ``cancel`` read file names, JSON and text.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

EXIT_FAILED, EXIT_USAGE, EXIT_RUNNING = 1, 2, 3


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastpar jobs", description="background and batch jobs (submitit)")
    parser.add_argument("--dir", help="jobs folder (default $FASTPAR_JOBS_DIR or ~/.fastpar/jobs)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{list,status,logs,result,cancel}")
    listing = sub.add_parser("list", help="every job in the jobs folder")
    listing.add_argument("--json", action="store_true", help="one JSON object per job")
    status = sub.add_parser("status", help="a job's state, folder, resources and latest metrics")
    status.add_argument("job", help="job id or folder")
    status.add_argument("--json", action="store_true")
    logs = sub.add_parser("logs", help="a job's stdout and stderr")
    logs.add_argument("job")
    logs.add_argument("--task", type=int, default=0, help="task (node) of a multi-node job (default 0)")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    result = sub.add_parser("result", help="a finished job's return value")
    result.add_argument("job")
    result.add_argument("--wait", action="store_true", help="wait for the job to end")
    result.add_argument("--timeout", type=float, help="with --wait: give up after this many seconds")
    cancel = sub.add_parser("cancel", help="stop a job and every process it started")
    cancel.add_argument("job")
    return parser


def _summary(value: Any) -> str:
    if hasattr(value, "history") and hasattr(value, "final"):  # a fastpar TrainingResult
        return f"TrainingResult: {value.steps} steps, final {value.final}\nmodel: {value.model}"
    text = repr(value)
    return text if len(text) <= 4000 else text[:4000] + f"... ({len(text)} characters)"


def _list(args: argparse.Namespace) -> int:
    from .store import jobs_root, list_jobs

    records = list_jobs(args.dir)
    if records:  # their states need submitit's job files: imported only when there are jobs to ask about
        from .future import JobFuture

    rows = [(r, JobFuture(r, watch=False).state()) for r in records]
    if args.json:
        for record, state in rows:
            print(
                json.dumps(
                    {
                        "id": record.id,
                        "name": record.name,
                        "kind": record.kind,
                        "cluster": record.cluster,
                        "state": state,
                        "submitted": record.submitted,
                        "what": record.what,
                    }
                )
            )
        return 0
    if not rows:
        print(f"no jobs in {jobs_root(args.dir)}")
        return 0
    print(f"{'id':<10}{'name':<18}{'kind':<7}{'cluster':<8}{'state':<11}{'submitted':<27}what")
    for record, state in rows:
        print(
            f"{record.id:<10}{record.name[:17]:<18}{record.kind:<7}{record.cluster:<8}{state:<11}"
            f"{record.submitted:<27}{record.what}"
        )
    return 0


def _follow(future: Any, task: int) -> None:
    offsets = [0, 0]
    while True:
        finished = future.state() in ("COMPLETED", "FAILED", "CANCELLED")
        for i, path in enumerate(future.log_paths(task)):
            if path.exists():
                with open(path, errors="replace") as fh:
                    fh.seek(offsets[i])
                    chunk = fh.read()
                    offsets[i] = fh.tell()
                (sys.stdout if i == 0 else sys.stderr).write(chunk)
        sys.stdout.flush()
        if finished:
            return
        time.sleep(1.0)


def _run(args: argparse.Namespace) -> int:
    from .future import JobFuture
    from .store import JobRecord, find_job

    record = JobRecord.load(find_job(args.job, args.dir))
    future = JobFuture(record, watch=args.command == "result" and args.wait)
    if args.command == "status":
        info = {
            "id": record.id,
            "name": record.name,
            "kind": record.kind,
            "state": future.state(),
            "cluster": record.cluster,
            "cluster_job_id": record.cluster_job_id,
            "folder": record.folder,
            "submitted": record.submitted,
            "what": record.what,
            "resources": record.resources,
            "tasks": record.num_tasks,
            "progress": future.progress(),
        }
        if args.json:
            print(json.dumps(info, default=repr))
        else:
            for key, value in info.items():
                print(f"{key:<15}{value}")
        return 0
    if args.command == "logs":
        if args.follow:
            _follow(future, args.task)
        else:
            print(future.logs(args.task))
        return 0
    if args.command == "cancel":
        state = future.state()
        if state in ("COMPLETED", "FAILED", "CANCELLED"):
            why = future.not_running_reason()
            print(f"job {record.id} had already ended ({state}); nothing to cancel" + (f": {why}" if why else ""))
            return 0
        future.cancel()
        print(f"job {record.id} cancelled; its processes were stopped")
        return 0
    return _result(future, args)


def _result(future: Any, args: argparse.Namespace) -> int:
    import concurrent.futures

    if not args.wait:
        state = future.state()
        if state in ("PENDING", "RUNNING"):
            print(f"job {future.id} is {state}; use --wait to wait for it", file=sys.stderr)
            return EXIT_RUNNING
        future.poll()  # it has ended: complete the future here and now
    try:
        value = future.result(timeout=args.timeout)
    except concurrent.futures.TimeoutError:
        print(f"job {future.id} still running after {args.timeout:g} s", file=sys.stderr)
        return EXIT_RUNNING
    except concurrent.futures.CancelledError:
        print(f"job {future.id} was cancelled", file=sys.stderr)
        return EXIT_FAILED
    except Exception as exc:  # the job's own error
        print(f"job {future.id} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        for note in getattr(exc, "__notes__", []):
            print(note, file=sys.stderr)
        return EXIT_FAILED
    print(_summary(value))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Errors the user can fix (a missing submitit, a job id that isn't there) are raised as UserError for
    the ``fastpar`` command to show: one line, exit status 2, the traceback with ``--debug``."""
    from ..user_errors import UserError

    args = _parser().parse_args(argv)
    try:
        from ..safe_files import ForeignFolderError
        from .proctree import JobProcessesError
        from .store import BadJobIdError, JobNotFoundError

        if args.command == "list":
            return _list(args)
        return _run(args)
    except ImportError as exc:
        if "pip install" not in str(exc):
            raise
        raise UserError(str(exc)) from exc  # submitit missing: the message names the extra to install
    except (JobNotFoundError, BadJobIdError, JobProcessesError, ForeignFolderError) as exc:
        raise UserError(f"{args.command}: {exc}") from exc
