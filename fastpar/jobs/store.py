"""Where jobs live: one folder per job, holding submitit's files (pickled call, result, logs) and
``job.json``, fastpar's record of what was submitted where. A job is found again by its id (the folder's
name under the jobs root) or by its folder's path, from any process, after the submitting one has exited.

The jobs root is ``FASTPAR_JOBS_DIR`` or ``~/.fastpar/jobs``; on a cluster it must be on a file system
the compute nodes share (home directories usually are). The root and every job folder are private to their
owner (0700, files 0600): a job folder holds pickles, and only ``result()`` unpickles them.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import secrets
from pathlib import Path
from typing import Any

from .private_files import check_owned, private_folder, write_private

ROOT_ENV = "FASTPAR_JOBS_DIR"
RECORD_FILE = "job.json"


# A job's id names a folder directly under the jobs root: no separators, no "..", nothing hidden.
JOB_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


class JobNotFoundError(LookupError):
    """No job with that id (or folder) exists; the message says where it looked."""


class BadJobIdError(ValueError):
    """A job id that is not one (a path, ``..``, odd characters); the message says what one looks like."""


@dataclasses.dataclass
class JobRecord:
    id: str
    name: str
    kind: str  # submit | batch | trial
    cluster: str  # local | slurm | debug
    folder: str
    cluster_job_id: str = ""  # submitit's id: the controller's pid locally, the Slurm job id on Slurm
    num_tasks: int = 1
    result_from: str = "task0"  # task0: task 0's return value | rank0: the value of global rank 0 (multi-node)
    submitted: str = ""  # ISO time
    what: str = ""  # the function or script, for people
    resources: dict[str, Any] = dataclasses.field(default_factory=dict)
    controller_start_ticks: int | None = None  # local: tells the controller apart from a later process with its pid
    process_marker: str | None = None  # local: the value of proctree.MARKER_ENV every process of the job inherits
    slot: dict[str, Any] | None = None  # a local sweep trial's slot: index, cpus, gpus

    def save(self) -> None:
        write_private(Path(self.folder) / RECORD_FILE, json.dumps(dataclasses.asdict(self), indent=1, default=repr))

    @classmethod
    def load(cls, folder: str | Path) -> JobRecord:
        """The record in ``folder``; ForeignFolderError when the folder or its record belongs to another user
        (what such a folder holds was not written by this user's jobs)."""
        check_owned(Path(folder))
        check_owned(Path(folder) / RECORD_FILE)
        data = json.loads((Path(folder) / RECORD_FILE).read_text())
        known = {f.name for f in dataclasses.fields(cls)}
        record = cls(**{k: v for k, v in data.items() if k in known})
        record.folder = str(Path(folder).resolve())  # the folder may have moved since
        return record


def jobs_root(root: str | Path | None = None) -> Path:
    """The folder holding job folders: ``root``, else ``$FASTPAR_JOBS_DIR``, else ``~/.fastpar/jobs``."""
    chosen = root or os.environ.get(ROOT_ENV) or Path.home() / ".fastpar" / "jobs"
    return Path(chosen).expanduser().resolve()


def new_job_folder(root: Path) -> tuple[str, Path]:
    """A fresh, empty folder (0700) under ``root`` (made private too) and its id (8 hex digits)."""
    private_folder(root)
    while True:
        job_id = secrets.token_hex(4)
        folder = root / job_id
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:
            continue
        return job_id, folder


def now_iso() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def check_job_id(job_id: str) -> str:
    """``job_id`` when it is a job id (letters, digits, ``-`` and ``_``; no path); BadJobIdError otherwise."""
    if not JOB_ID_PATTERN.fullmatch(job_id):
        raise BadJobIdError(
            f"{job_id!r} is not a job id: ids are letters, digits, '-' and '_' (like 3f9a01c2, as 'fastpar jobs "
            "list' shows them); to name a job by its folder, give the folder's path"
        )
    return job_id


def find_job(job: str | Path, root: str | Path | None = None) -> Path:
    """The folder of job ``job``: an id under the jobs root, or a job folder's path (a ``Path``, or text with
    a separator in it). A path must not climb with ``..``: BadJobIdError."""
    text = str(job)
    if isinstance(job, Path) or os.sep in text or (os.altsep and os.altsep in text):
        if ".." in Path(text).parts:
            raise BadJobIdError(
                f"{text!r}: a job folder's path must not contain '..'; give the folder's full path or the job's id"
            )
        folder = Path(text).expanduser()
    else:
        folder = jobs_root(root) / check_job_id(text)
    if (folder / RECORD_FILE).is_file():
        return folder.resolve()
    raise JobNotFoundError(
        f"no fastpar job {text!r} under {jobs_root(root)} (looked for {folder / RECORD_FILE}); "
        f"'fastpar jobs list' shows the jobs there, --dir / {ROOT_ENV} picks another jobs folder"
    )


def list_jobs(root: str | Path | None = None) -> list[JobRecord]:
    """Every job under the jobs root, oldest first."""
    base = jobs_root(root)
    records = []
    if base.is_dir():
        for record_file in base.glob(f"*/{RECORD_FILE}"):
            try:
                records.append(JobRecord.load(record_file.parent))
            except (OSError, ValueError, TypeError):  # a folder being written, or not a job
                continue
    return sorted(records, key=lambda r: (r.submitted, r.id))
