"""A sweep's trials and what they gave: one record per trial (its config, state, time and final metrics),
the best trial by a metric, and the records as a pandas DataFrame when pandas is installed."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from .._optional import available
from .private_files import write_private

QUEUED, RUNNING, COMPLETED, FAILED, CANCELLED = "QUEUED", "RUNNING", "COMPLETED", "FAILED", "CANCELLED"
# metrics a Trainer logs, in the order a sweep looks for one to rank by
METRIC_KEYS = ("val_loss", "val_accuracy", "loss", "accuracy", "value")


@dataclasses.dataclass
class Trial:
    index: int
    key: str  # stable name of (function, config): the trial's folder, how a resumed sweep recognises it
    config: Any
    folder: Path
    state: str = QUEUED
    slot: Any = None
    future: Any = None
    result: Any = None
    error: str | None = None
    seconds: float | None = None
    started: float | None = None  # time.monotonic() when this run of the sweep started or re-attached it
    resumed: bool = False  # finished by an earlier run of the sweep

    def config_fields(self) -> dict[str, Any]:
        if isinstance(self.config, dict):
            return {str(k): v for k, v in self.config.items()}
        return {"config": self.config}

    def short_config(self, width: int = 40) -> str:
        text = ", ".join(f"{k}={_short(v)}" for k, v in self.config_fields().items())
        return text if len(text) <= width else text[: width - 1] + "…"


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def metrics_of(result: Any, latest: dict[str, Any] | None) -> dict[str, Any]:
    """Final metrics of a trial: the last numbers it published (a Trainer's last logged step, or
    ``fastpar.jobs.report``), updated with what it returned: a Trainer's last logged values, a returned
    dict's plain values, a returned number as ``value``."""
    metrics = {k: v for k, v in (latest or {}).items() if _number(v) and k not in ("time", "elapsed")}
    if latest is not None and _from_trainer(latest):
        metrics["epoch"] = shown_epoch(latest)
    if hasattr(result, "history") and hasattr(result, "last"):  # a fastpar TrainingResult
        keys = ("epoch", "iteration", "loss", "accuracy", "val_loss", "val_accuracy")
        metrics.update({k: v for k in keys if (v := result.last(k)) is not None})
        if isinstance(metrics.get("epoch"), int):
            metrics["epoch"] += 1  # a Trainer's records count epochs from 0; shown from 1, as the table does
    elif isinstance(result, dict):
        metrics.update({str(k): v for k, v in result.items() if isinstance(v, (int, float, str, bool)) or v is None})
    elif _number(result):
        metrics["value"] = result
    return metrics


def _from_trainer(record: dict[str, Any]) -> bool:
    return "max_epochs" in record  # every record a Trainer logs has it (fastpar.train.loop.INFO_KEYS)


def shown_epoch(record: dict[str, Any]) -> Any:
    """The epoch as people read it. A Trainer's records count epochs from 0 (metrics.jsonl) while its
    progress bar and plot count from 1; a sweep's table and records show the latter. An epoch a job
    reported itself (``fastpar.jobs.report(epoch=...)``) is shown as it was given."""
    epoch = record.get("epoch")
    if _from_trainer(record) and isinstance(epoch, int) and not isinstance(epoch, bool):
        return epoch + 1
    return epoch


def record_of(trial: Trial, latest: dict[str, Any] | None) -> dict[str, Any]:
    record = {"trial": trial.index, **trial.config_fields(), "state": trial.state, "seconds": trial.seconds}
    metrics = metrics_of(trial.result if trial.state == COMPLETED else None, latest)
    record.update({k: v for k, v in metrics.items() if k not in record})
    record["error"] = trial.error
    record["folder"] = str(trial.folder)
    return record


def choose_metric(records: list[dict[str, Any]], metric: str | None, mode: str | None) -> tuple[str | None, str]:
    """The metric to rank trials by (the first of METRIC_KEYS present, unless given) and "min" or "max"."""
    if metric is None:
        metric = next((k for k in METRIC_KEYS if any(_number(r.get(k)) for r in records)), None)
    if mode is None:
        mode = "max" if metric and ("acc" in metric or metric.endswith("score")) else "min"
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
    return metric, mode


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


@dataclasses.dataclass
class SweepResult:
    """What ``fastpar.sweep`` returns."""

    records: list[dict[str, Any]]  # one per trial, in config order
    results: list[Any]  # each trial's return value (None when it failed)
    metric: str | None  # what ``best`` ranks by
    mode: str  # "min" or "max"
    folder: Path
    plot_path: Path | None

    @property
    def table(self) -> Any:
        """The records as a pandas DataFrame when pandas is installed, else the list of records."""
        if available("pandas"):
            import pandas

            return pandas.DataFrame(self.records).set_index("trial")
        return self.records

    @property
    def best(self) -> dict[str, Any] | None:
        """The record of the best completed trial by ``metric`` (None when no trial has it)."""
        ranked = [r for r in self.records if r["state"] == COMPLETED and _number(r.get(self.metric))]
        if not ranked:
            return None
        pick = min if self.mode == "min" else max
        return pick(ranked, key=lambda r: r[self.metric])

    @property
    def best_result(self) -> Any:
        """The return value of the best trial (e.g. its TrainingResult, with ``.model``)."""
        best = self.best
        return None if best is None else self.results[best["trial"]]

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r["state"] != COMPLETED]

    def save(self) -> Path:
        path = self.folder / "results.jsonl"
        write_private(path, "".join(json.dumps(r, default=repr) + "\n" for r in self.records))
        return path
