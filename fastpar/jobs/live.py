"""The live table of a sweep: trial, config, state, slot, epoch, latest metrics, time.

On a terminal with ``rich`` installed the table redraws in place; otherwise (logs, CI, notebooks without a
TTY) a line is printed whenever a trial changes state or finishes an epoch, and the whole table at the end.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from .._optional import available
from . import channel
from .results import COMPLETED, FAILED, RUNNING, Trial, shown_epoch

COLUMNS = ("trial", "config", "state", "slot", "epoch", "metrics", "time")


def format_metrics(record: dict[str, Any] | None) -> str:
    if not record:
        return ""
    parts = []
    for key in ("loss", "val_loss", "value"):
        if isinstance(record.get(key), (int, float)):
            parts.append(f"{key} {record[key]:.4g}")
    for key in ("accuracy", "val_accuracy"):
        if isinstance(record.get(key), (int, float)):
            parts.append(f"{key.replace('accuracy', 'acc')} {100 * record[key]:.1f}%")
    return "  ".join(parts)


class LiveTable:
    def __init__(self, trials: list[Trial], *, live: bool = True, stream: TextIO | None = None) -> None:
        self.trials, self.enabled = trials, live
        self.stream = stream or sys.stdout
        self.started: dict[int, float] = {}
        self._seen: dict[int, tuple[str, Any]] = {}
        self._rich = None
        if live and self.stream.isatty() and available("rich"):
            from rich.console import Console
            from rich.live import Live

            self._rich = Live(self._rich_table(), console=Console(file=self.stream), refresh_per_second=2)
            self._rich.start()

    def row(self, trial: Trial) -> list[str]:
        latest = channel.read_latest(trial.folder) if trial.state in (RUNNING, COMPLETED, FAILED) else None
        if trial.state == RUNNING and trial.index not in self.started:
            self.started[trial.index] = time.monotonic()
        seconds = trial.seconds
        if seconds is None and trial.index in self.started:
            seconds = time.monotonic() - self.started[trial.index]
        epoch = str(shown) if latest and (shown := shown_epoch(latest)) is not None else ""
        state = trial.state + (" (earlier run)" if trial.resumed else "")
        metrics = trial.error[:100] if trial.state == FAILED and trial.error else format_metrics(latest)
        slot = trial.slot.describe() if trial.slot is not None else ""
        return [
            str(trial.index),
            trial.short_config(),
            state,
            slot,
            epoch,
            metrics,
            f"{seconds:.0f}s" if seconds is not None else "",
        ]

    def _rich_table(self) -> Any:
        from rich.table import Table

        table = Table(title="fastpar sweep")
        for name in COLUMNS:
            table.add_column(name, overflow="fold" if name == "metrics" else "ellipsis")
        for trial in self.trials:
            table.add_row(*self.row(trial))
        return table

    def update(self) -> None:
        if not self.enabled:
            return
        if self._rich is not None:
            self._rich.update(self._rich_table())
            return
        for trial in self.trials:
            row = self.row(trial)
            mark = (row[2], row[4])  # state, epoch
            if self._seen.get(trial.index) != mark:
                self._seen[trial.index] = mark
                print(
                    f"trial {row[0]} [{row[1]}] {row[2]}" + "".join(f"  {c}" for c in row[3:] if c),
                    file=self.stream,
                    flush=True,
                )

    def close(self) -> None:
        if self._rich is not None:
            self._rich.update(self._rich_table())
            self._rich.stop()
            return
        if self.enabled:
            print(render_plain([self.row(t) for t in self.trials]), file=self.stream, flush=True)


def render_plain(rows: list[list[str]]) -> str:
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(COLUMNS)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(COLUMNS, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)
