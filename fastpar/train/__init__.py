"""``fastpar.Trainer``: the same training script on CPU cores, one GPU, all local GPUs or a cluster,
with a progress bar and plot, output functions that can stop training, and exact resume."""

from __future__ import annotations

from .batches import loss_from_batch
from .environment import ExecutionEnvironmentError
from .options import TrainingOptions
from .trainer import Trainer, TrainingResult

__all__ = ["ExecutionEnvironmentError", "Trainer", "TrainingOptions", "TrainingResult", "loss_from_batch"]
