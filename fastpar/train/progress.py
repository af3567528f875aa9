"""What rank 0 shows and keeps while training: a progress bar (tqdm where it can redraw), ``metrics.jsonl``, and
the metrics sink a watcher can ask for.

The sink: when ``FASTPAR_METRICS_SINK`` names a file, rank 0 also appends every logged record to it as one JSON
line. The trainer knows nothing of who reads it; the job system (``fastpar.jobs``) sets it to a job's progress
channel, so ``future.progress()`` and a sweep's live table follow a Trainer running inside a job.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from .._optional import available
from ..safe_files import create_exclusive


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def _in_notebook() -> bool:
    """True in a Jupyter kernel (a single-process run trains there; launched workers have no notebook)."""
    shell = sys.modules.get("IPython") and getattr(sys.modules["IPython"], "get_ipython", lambda: None)()
    return type(shell).__name__ == "ZMQInteractiveShell"


def metrics_text(record: dict[str, Any]) -> str:
    """ "loss 0.4321  acc 87.5%  val_loss ...  1234 samples/s" for one logged record."""
    parts = [f"loss {record['loss']:.4f}"]
    if record.get("accuracy") is not None:
        parts.append(f"acc {100 * record['accuracy']:.1f}%")
    if record.get("val_loss") is not None:
        parts.append(f"val_loss {record['val_loss']:.4f}")
    if record.get("val_accuracy") is not None:
        parts.append(f"val_acc {100 * record['val_accuracy']:.1f}%")
    parts.append(f"{record['samples_per_s']:.0f} samples/s")
    return "  ".join(parts)


def _redrawable(stream: TextIO) -> bool:
    """A terminal with a size: a pseudo-terminal that reports 0 rows (some CI runners, ``script``) would make
    tqdm print nothing at all."""
    if not stream.isatty():
        return False
    try:
        size = os.get_terminal_size(stream.fileno())
    except (OSError, ValueError):  # no file descriptor (a stand-in stream): trust isatty()
        return True
    return size.lines > 0 and size.columns > 0


class ProgressBar:
    """Training progress on rank 0, updated at every logged step.

    In a terminal or a notebook: a tqdm bar (steps, rate, ETA; the latest metrics beside it). Elsewhere --
    output piped to a log file, or tqdm not installed -- one plain line per update, because a redrawn
    bar writes carriage returns that make logs unreadable.
    """

    def __init__(
        self, total_steps: int, max_epochs: int, stream: TextIO | None = None, start_step: int = 0, width: int = 24
    ) -> None:
        self.total_steps, self.max_epochs, self.width = total_steps, max_epochs, width
        self.stream = stream or sys.stdout
        self._bar = None
        notebook = _in_notebook() and stream is None
        if (notebook or _redrawable(self.stream)) and available("tqdm"):
            if notebook:
                from tqdm.auto import tqdm  # the notebook widget when ipywidgets is there, else text
            else:
                from tqdm import tqdm
            self._bar = tqdm(
                total=total_steps,
                initial=start_step,
                file=None if notebook else self.stream,
                unit="step",
                dynamic_ncols=True,
                leave=True,
            )
        self._start_step: int | None = None
        self._start_time = time.perf_counter()

    def update(self, record: dict[str, Any]) -> None:
        step = record["iteration"]
        epoch = f"epoch {record['epoch'] + 1}/{self.max_epochs}"
        if self._bar is not None:
            self._bar.set_description(epoch, refresh=False)
            self._bar.set_postfix_str(metrics_text(record), refresh=False)
            self._bar.update(step - self._bar.n)
            return
        if self._start_step is None:  # ETA from this run's own pace (a resumed run starts mid-way)
            self._start_step, self._start_time = step, time.perf_counter()
        filled = int(self.width * step / max(self.total_steps, 1))
        bar = "#" * filled + "." * (self.width - filled)
        rate = (step - self._start_step) / max(time.perf_counter() - self._start_time, 1e-9)
        eta = format_duration((self.total_steps - step) / rate) if rate > 0 else "?"
        line = f"{epoch}  step {step}/{self.total_steps} [{bar}]  {metrics_text(record)}  ETA {eta}"
        self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


METRICS_SINK_ENV = "FASTPAR_METRICS_SINK"


def _to_sink(record: dict[str, Any]) -> None:
    """Append ``record`` to the file ``FASTPAR_METRICS_SINK`` names, if any (one write: readers never see half)."""
    sink = os.environ.get(METRICS_SINK_ENV)
    if sink:
        fd = os.open(sink, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)  # never through a link
        with os.fdopen(fd, "a") as fh:
            fh.write(json.dumps(record, default=str) + "\n")


class MetricsLog:
    """``metrics.jsonl``: one JSON object per logged step, flushed as written so a crash loses nothing."""

    def __init__(self, path: Path, resume_at_step: int | None) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        if resume_at_step is not None and path.is_file() and not path.is_symlink():
            # Keep what the resumed checkpoint had seen; later lines come from steps about to be redone.
            for line in path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by a crash
                    continue
                if record.get("iteration", 0) <= resume_at_step:
                    self.records.append(record)
        path.parent.mkdir(parents=True, exist_ok=True)
        # A new file under a random name, renamed over metrics.jsonl and kept open for the whole run: nothing
        # is ever opened through the fixed name, where someone may have left a symlink to another file.
        fd, tmp = create_exclusive(path.parent, f".{path.name}.tmp-", mode=0o666)  # the umask's mode, as open()
        self._fh = os.fdopen(fd, "w")
        try:
            self._fh.writelines(json.dumps(r) + "\n" for r in self.records)
            self._fh.flush()
            os.replace(tmp, path)
        except BaseException:
            self._fh.close()
            tmp.unlink(missing_ok=True)
            raise

    def append(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()
        _to_sink(record)

    def close(self) -> None:
        self._fh.close()
