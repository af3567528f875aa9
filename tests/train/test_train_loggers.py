"""TrainingOptions(loggers=...): every logged step of rank 0 reaches each logger, read back with the tool's own
reader (csv, TensorBoard's EventAccumulator, mlflow.search_runs and its metric history, W&B's record schema) and
equal to ``metrics.jsonl``; a 2-process run writes each once; a resumed run continues the same files and runs;
an unknown logger or a missing package is one line before training."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
from pathlib import Path

import pytest
import test_train as tt

from fastpar.train import TrainingOptions
from fastpar.user_errors import OptionError

_PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}


def _installed() -> tuple[str, ...]:
    return ("csv",) + tuple(name for name, pkg in _PACKAGES.items() if importlib.util.find_spec(pkg) is not None)


def _jsonl(result) -> list[dict]:
    return [json.loads(line) for line in Path(result.metrics_path).read_text().splitlines()]


def _read_csv(path: Path) -> list[dict]:
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def _read_tensorboard(path: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(path))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def _read_mlflow(uri: str, key: str) -> tuple[int, list[tuple[int, float]]]:
    import mlflow

    if uri.startswith("file:"):  # mlflow-skinny: the file store, which MLflow 3 opens only when told to
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=["fastpar"])
    history = mlflow.MlflowClient().get_metric_history(runs["run_id"][0], key)
    return len(runs), list(dict((m.step, m.value) for m in history).items())  # a redone step: its last value


def _read_wandb(folder: Path) -> list[dict]:
    import wandb_offline

    files = sorted(folder.glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    return wandb_offline.history(files[0])


def _check_against_jsonl(result, loggers: tuple[str, ...]) -> None:
    records = _jsonl(result)
    steps = [r["iteration"] for r in records]
    losses = [r["loss"] for r in records]
    assert set(result.logger_paths) == set(loggers)
    rows = _read_csv(Path(result.logger_paths["csv"]))
    assert [int(r["iteration"]) for r in rows] == steps
    assert [float(r["loss"]) for r in rows] == losses  # repr of a float round-trips exactly
    assert all(r["val_loss"] == "" or float(r["val_loss"]) > 0 for r in rows)
    if "tensorboard" in loggers:
        scalars = _read_tensorboard(Path(result.logger_paths["tensorboard"]), "loss")
        assert [s for s, _ in scalars] == steps
        assert [v for _, v in scalars] == pytest.approx(losses, rel=1e-6)  # stored as float32
    if "mlflow" in loggers:
        runs, history = _read_mlflow(result.logger_paths["mlflow"], "loss")
        assert runs == 1 and history == list(zip(steps, losses, strict=True))
    if "wandb" in loggers:
        logged = [(row["_step"], row["loss"]) for row in _read_wandb(Path(result.logger_paths["wandb"]))]
        assert logged == list(zip(steps, losses, strict=True))


def test_every_installed_logger_gets_what_metrics_jsonl_holds_from_a_two_process_run(tmp_path):
    loggers = _installed()
    result = tt.fit(tmp_path, loggers=loggers, max_epochs=1)
    _check_against_jsonl(result, loggers)
    assert len(_jsonl(result)) == tt.STEPS // 2 // 4 + 1  # rank 0 alone writes: one record per logged step


def test_a_resumed_run_continues_its_logs(tmp_path):
    loggers = tuple(name for name in _installed() if name != "wandb")  # W&B resumes its run in a second folder
    uninterrupted = tt.single(tmp_path / "u", loggers=("csv",))
    ck = str(tmp_path / "ck")
    stopped = tt.single(
        tmp_path / "s",
        loggers=loggers,
        output_fns=[tt.StopAt(40, str(tmp_path / "log"))],
        checkpoint_dir=ck,
        checkpoint_every=16,
    )
    assert stopped.steps == 40
    resumed = tt.single(tmp_path / "s", loggers=loggers, checkpoint_dir=ck, checkpoint_every=16, resume=True)
    assert resumed.steps == uninterrupted.steps
    _check_against_jsonl(resumed, loggers)
    # the rows of steps 33..40 (redone after resuming from step 32) appear once, with the redone values
    assert [r["loss"] for r in _jsonl(resumed)] == [r["loss"] for r in uninterrupted.history]


def test_unknown_logger_and_missing_package_are_one_line(monkeypatch):
    with pytest.raises(OptionError, match="unknown logger 'neptune'; choose from csv, tensorboard, mlflow, wandb"):
        TrainingOptions(loggers=("neptune",))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(OptionError) as caught:
        TrainingOptions(loggers=("csv", "mlflow"))
    message = str(caught.value)
    assert "\n" not in message and "needs the mlflow package" in message and "pip install mlflow" in message
    assert TrainingOptions(loggers="csv").loggers == ("csv",)
