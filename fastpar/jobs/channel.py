"""The progress channel between a running job and whoever watches it (a future's ``progress()``, a sweep's
live table, ``fastpar jobs status``).

A job process has ``FASTPAR_JOB_DIR`` set to its job folder, and the Trainer's metrics sink
(``FASTPAR_METRICS_SINK``, see ``fastpar.train.progress``) pointed at ``<job folder>/progress.jsonl``: rank 0 of a
``fastpar.Trainer`` running inside it appends every logged metrics record there; any other function can do the
same with :func:`report`. Readers parse
the file; a line cut short by a writer mid-flush is skipped. No submitit import here: the trainer uses it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

JOB_DIR_ENV = "FASTPAR_JOB_DIR"
PROGRESS_FILE = "progress.jsonl"
# The Trainer's metrics sink (fastpar.train.progress.METRICS_SINK_ENV), named here so that listening to the
# trainer does not import it (and torch) into every jobs command.
TRAINER_METRICS_SINK_ENV = "FASTPAR_METRICS_SINK"


def enter_job(folder: str | Path) -> None:
    """Make this process (and what it starts) a job's: outputs and progress go to ``folder``. The progress
    file is created here, private (0600), so that whoever appends to it later keeps it so."""
    os.environ[JOB_DIR_ENV] = str(folder)
    os.environ[TRAINER_METRICS_SINK_ENV] = str(Path(folder) / PROGRESS_FILE)
    try:
        fd = os.open(Path(folder) / PROGRESS_FILE, os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError:  # a folder we may not write: publishing will say so
        return
    os.close(fd)


def job_dir() -> Path | None:
    """The folder of the job this process runs in (write outputs there), or None outside a job."""
    folder = os.environ.get(JOB_DIR_ENV)
    return Path(folder) if folder else None


def publish(record: dict[str, Any]) -> None:
    """Append ``record`` to this job's progress channel; a no-op outside a job."""
    folder = job_dir()
    if folder is None:
        return
    line = json.dumps(record, default=str) + "\n"
    with open(folder / PROGRESS_FILE, "a") as fh:  # one write per record: readers never see half of one
        fh.write(line)


def report(**metrics: Any) -> None:
    """Report metrics of a running job function (e.g. ``report(epoch=3, val_loss=0.41)``): they show in
    ``future.progress()``, a sweep's live table and its curve plot (``iteration`` is the x axis)."""
    publish({"time": time.time(), **metrics})


def read_history(folder: str | Path) -> list[dict[str, Any]]:
    """Every record the job in ``folder`` has published so far, oldest first."""
    path = Path(folder) / PROGRESS_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    records = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line still being written
            continue
    return records


def read_latest(folder: str | Path) -> dict[str, Any] | None:
    """The newest record the job in ``folder`` has published, or None."""
    history = read_history(folder)
    return history[-1] if history else None
