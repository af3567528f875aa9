"""Where rank 0's logged metrics go besides ``metrics.jsonl``: ``TrainingOptions(loggers=(...))``.

One small interface -- ``log(record)`` for every logged step, ``close()`` at the end -- and a logger per tool:

- ``"csv"``: ``metrics.csv`` in ``output_dir``, one row per logged step, a column per metric (a metric that appears
  later widens the file);
- ``"tensorboard"``: event files under ``output_dir/tensorboard``, written by ``torch.utils.tensorboard`` (needs the
  ``tensorboard`` package), one scalar per metric at the step's iteration;
- ``"mlflow"``: a run in a local store under ``output_dir`` (``mlflow.db``, or the file store ``mlruns/`` without
  SQLAlchemy; ``mlflow ui --backend-store-uri URI`` shows it), the options as parameters, every metric at its
  iteration;
- ``"wandb"``: a Weights & Biases run in offline mode under ``output_dir/wandb`` (``wandb sync`` uploads it later).

A resumed run continues where its checkpoint was: the CSV keeps the rows up to it, TensorBoard purges the events
after it, MLflow and W&B continue the same run (MLflow's history of a step redone after the checkpoint holds both
values, the redone one last). A logger whose package is missing is refused before training, in
one line naming what to install.
"""

from __future__ import annotations

import csv
import importlib.util
import math
import os
from pathlib import Path
from typing import Any

from ..safe_files import atomic_file, create_exclusive

LOGGERS = {"csv": None, "tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}  # name -> package


class LoggerError(ValueError):
    """A logger that cannot be used: unknown, or its package is not installed."""


def check_loggers(names: Any) -> tuple[str, ...]:
    """``names`` as a tuple of known loggers whose packages are importable; LoggerError otherwise."""
    if isinstance(names, str):
        names = (names,)
    try:
        names = tuple(names)
    except TypeError:
        raise LoggerError(f"TrainingOptions.loggers takes a tuple of logger names, got {names!r}") from None
    for name in names:
        if name not in LOGGERS:
            raise LoggerError(
                f"TrainingOptions.loggers: unknown logger {name!r}; choose from {', '.join(LOGGERS)} "
                "(metrics.jsonl is always written)"
            )
        package = LOGGERS[name]
        if package is not None and importlib.util.find_spec(package) is None:
            raise LoggerError(
                f"TrainingOptions.loggers: the {name!r} logger needs the {package} package, which is not installed: "
                f"pip install {package} (or 'fastpar[loggers]' for every logger)"
            )
    if len(set(names)) != len(names):
        raise LoggerError(f"TrainingOptions.loggers names a logger twice: {names!r}")
    return names


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's numeric metrics (None and non-numbers left out; the step is the record's iteration)."""
    return {
        k: float(v)
        for k, v in record.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("iteration",) and math.isfinite(v)
    }


class CSVLogger:
    """``metrics.csv``: rewritten whole when a metric appears that the header lacks, else appended."""

    def __init__(self, output_dir: Path, resume_at_step: int | None) -> None:
        self.path = output_dir / "metrics.csv"
        self.rows: list[dict[str, Any]] = []
        if resume_at_step is not None and self.path.is_file() and not self.path.is_symlink():
            with self.path.open(newline="") as fh:
                self.rows = [r for r in csv.DictReader(fh) if float(r.get("iteration") or 0) <= resume_at_step]
        self.columns: list[str] = []
        for row in self.rows:
            self._widen(row)
        self._fh = None
        self._rewrite()

    def _widen(self, row: dict[str, Any]) -> bool:
        new = [k for k in row if k not in self.columns]
        self.columns += new
        return bool(new)

    def _rewrite(self) -> None:
        # a new file under a random name renamed over the fixed one: never opened through a planted link
        if self._fh is not None:
            self._fh.close()
        fd, tmp = create_exclusive(self.path.parent, f".{self.path.name}.tmp-", mode=0o666)
        self._fh = os.fdopen(fd, "w", newline="")
        self._writer = csv.DictWriter(self._fh, fieldnames=self.columns, restval="")
        if self.columns:
            self._writer.writeheader()
            self._writer.writerows(self.rows)
        self._fh.flush()
        os.replace(tmp, self.path)

    def log(self, record: dict[str, Any]) -> None:
        row = {k: ("" if v is None else v) for k, v in record.items()}
        self.rows.append(row)
        if self._widen(row):
            self._rewrite()
        else:
            self._writer.writerow(row)
            self._fh.flush()

    def close(self) -> None:
        self._fh.close()


class TensorBoardLogger:
    """Event files written by ``torch.utils.tensorboard.SummaryWriter``: one scalar per metric and step."""

    def __init__(self, output_dir: Path, resume_at_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.path = output_dir / "tensorboard"
        # purge_step: events of steps after the checkpoint (about to be redone) are dropped
        self._writer = SummaryWriter(
            log_dir=str(self.path), purge_step=None if resume_at_step is None else resume_at_step + 1
        )

    def log(self, record: dict[str, Any]) -> None:
        for key, value in _scalars(record).items():
            self._writer.add_scalar(key, value, global_step=int(record["iteration"]))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class MLflowLogger:
    """A run in a local store under ``output_dir``: ``mlflow.db`` (SQLite, MLflow's recommended local store) where
    SQLAlchemy is installed (the full ``mlflow`` package), else the file store ``mlruns/`` (``mlflow-skinny``; MLflow
    3 keeps it in maintenance mode, allowed here explicitly). ``path`` is the tracking URI. A resumed run logs into
    the same run."""

    def __init__(self, output_dir: Path, resume_at_step: int | None, params: dict[str, Any]) -> None:
        import mlflow

        if importlib.util.find_spec("sqlalchemy") is not None:
            self.path = f"sqlite:///{(output_dir / 'mlflow.db').resolve()}"
        else:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            self.path = (output_dir / "mlruns").resolve().as_uri()
        self._client = mlflow.MlflowClient(tracking_uri=self.path)
        marker = output_dir / ".mlflow-run-id"
        run_id = marker.read_text().strip() if resume_at_step is not None and marker.is_file() else None
        if run_id is None:
            experiment = self._client.get_experiment_by_name("fastpar")
            experiment_id = (
                experiment.experiment_id if experiment is not None else self._client.create_experiment("fastpar")
            )
            run_id = self._client.create_run(experiment_id, run_name=output_dir.resolve().name).info.run_id
            for key, value in params.items():
                self._client.log_param(run_id, key, str(value)[:500])
            _write_marker(marker, run_id)
        self.run_id = run_id

    def log(self, record: dict[str, Any]) -> None:
        step = int(record["iteration"])
        for key, value in _scalars(record).items():
            self._client.log_metric(self.run_id, key, value, step=step)

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


class WandbLogger:
    """A Weights & Biases run in offline mode under ``output_dir/wandb`` (nothing leaves the machine)."""

    def __init__(self, output_dir: Path, resume_at_step: int | None, params: dict[str, Any]) -> None:
        import wandb

        marker = output_dir / ".wandb-run-id"
        run_id = marker.read_text().strip() if resume_at_step is not None and marker.is_file() else None
        self._run = wandb.init(
            project="fastpar",
            dir=str(output_dir),
            mode="offline",
            id=run_id,
            resume="allow" if run_id else None,
            config={k: str(v) for k, v in params.items()},
            reinit="create_new",
            settings=wandb.Settings(quiet=True),
        )
        if run_id is None:
            _write_marker(marker, self._run.id)
        self.path = output_dir / "wandb"  # the run's folder: offline-run-<time>-<id> (one more per resumed call)

    def log(self, record: dict[str, Any]) -> None:
        self._run.log(_scalars(record), step=int(record["iteration"]))

    def close(self) -> None:
        self._run.finish()


def _write_marker(path: Path, run_id: str) -> None:
    """The run id a resumed run continues, written whole (the umask's mode, as the other output files)."""
    with atomic_file(path, None, durable=False) as fh:
        fh.write(run_id.encode())


def open_loggers(
    names: tuple[str, ...], output_dir: Path, resume_at_step: int | None, params: dict[str, Any]
) -> list[Any]:
    """The loggers ``names`` asks for, on rank 0, writing under ``output_dir``."""
    output_dir.mkdir(parents=True, exist_ok=True)
    made = []
    for name in names:
        if name == "csv":
            made.append(CSVLogger(output_dir, resume_at_step))
        elif name == "tensorboard":
            made.append(TensorBoardLogger(output_dir, resume_at_step))
        elif name == "mlflow":
            made.append(MLflowLogger(output_dir, resume_at_step, params))
        elif name == "wandb":
            made.append(WandbLogger(output_dir, resume_at_step, params))
    return made


__all__ = ["LOGGERS", "LoggerError", "check_loggers", "open_loggers"]
