"""What rank 0 shows and keeps while training: a progress bar and ``metrics.jsonl``."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from ..jobs.channel import publish


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class ProgressBar:
    """One line per update: redrawn in place on a terminal, appended otherwise (logs stay readable)."""

    def __init__(self, total_steps: int, max_epochs: int, stream: TextIO | None = None, width: int = 24) -> None:
        self.total_steps, self.max_epochs, self.width = total_steps, max_epochs, width
        self.stream = stream or sys.stdout
        self.inplace = self.stream.isatty()
        self._start_step: int | None = None
        self._start_time = time.perf_counter()

    def update(self, record: dict[str, Any]) -> None:
        step = record["iteration"]
        if self._start_step is None:  # ETA from this run's own pace (a resumed run starts mid-way)
            self._start_step, self._start_time = step, time.perf_counter()
        done = step / max(self.total_steps, 1)
        filled = int(self.width * done)
        bar = "#" * filled + "." * (self.width - filled)
        rate = (step - self._start_step) / max(time.perf_counter() - self._start_time, 1e-9)
        eta = (self.total_steps - step) / rate if rate > 0 else float("nan")
        parts = [
            f"epoch {record['epoch'] + 1}/{self.max_epochs}",
            f"step {step}/{self.total_steps} [{bar}]",
            f"loss {record['loss']:.4f}",
        ]
        if record.get("accuracy") is not None:
            parts.append(f"acc {100 * record['accuracy']:.1f}%")
        if record.get("val_loss") is not None:
            parts.append(f"val_loss {record['val_loss']:.4f}")
        if record.get("val_accuracy") is not None:
            parts.append(f"val_acc {100 * record['val_accuracy']:.1f}%")
        parts.append(f"{record['samples_per_s']:.0f} samples/s")
        parts.append(f"ETA {format_duration(eta) if eta == eta else '?'}")
        line = "  ".join(parts)
        if self.inplace:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.inplace:
            self.stream.write("\n")
            self.stream.flush()


class MetricsLog:
    """``metrics.jsonl``: one JSON object per logged step, flushed as written so a crash loses nothing."""

    def __init__(self, path: Path, resume_at_step: int | None) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        if resume_at_step is not None and path.is_file():
            # Keep what the resumed checkpoint had seen; later lines come from steps about to be redone.
            for line in path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by a crash
                    continue
                if record.get("iteration", 0) <= resume_at_step:
                    self.records.append(record)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in self.records)
        self._fh = open(path, "a")  # noqa: SIM115 - open for the whole run

    def append(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()
        publish(record)  # inside a fastpar job: what future.progress() and a sweep's live table read

    def close(self) -> None:
        self._fh.close()
