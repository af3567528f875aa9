"""``TrainingOptions``: every knob of ``fastpar.Trainer`` and its default, in one place."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..user_errors import OptionError

ENVIRONMENTS = ("auto", "cpu", "gpu", "multi-gpu", "cluster")
DDP_CHOICES = ("auto", "torch", "fastpar")
CPU_BACKENDS = ("auto", "fastpar", "gloo")
PLOTS = (None, "none", "training-progress")


@dataclasses.dataclass
class TrainingOptions:
    """Options of one training run (the counterpart of MATLAB's ``trainingOptions``).

    Steps count optimizer steps; with ``grad_accum_steps=k`` one step consumes k batches per process.
    Output functions are called on rank 0 with state "start", after every optimizer step ("iteration") and
    at "done", with an info record holding state, epoch (0-based), iteration, loss, accuracy, val_loss,
    val_accuracy (None when not known), lr, elapsed, samples_per_s, max_epochs and total_steps; loss and
    accuracy average all ranks over the steps since the previous logged step on logged steps (every
    ``log_every`` steps, epoch ends, validations) and over that one step otherwise. A truthy return stops
    every rank after that step. (Each call costs a small all-reduce and a broadcast, only when output_fns
    are given.)
    Objects here travel to the worker processes, so callables (``output_fns``, ``lr_scheduler``) must be
    picklable: functions or classes defined at module level of an importable module.
    """

    # what to run
    max_epochs: int = 10
    batch_size: int = 32  # samples per process per batch (global batch = batch_size * processes * grad_accum_steps)
    seed: int = 0

    # where to run
    execution_environment: str = "auto"  # auto | cpu | gpu | multi-gpu | cluster
    devices: int | None = None  # cpu: processes (default min(4, cores)); multi-gpu: best k GPUs (default all)
    max_restarts: int = 0  # elastic restarts of the whole local group when a worker dies
    threads_per_process: int | None = None  # torch threads per CPU process (default: cores / processes)
    cpu_backend: str = "auto"  # CPU processes: auto (fastpar's shared-memory backend when built) | fastpar | gloo

    # gradient sync and the step
    ddp: str = "auto"  # auto: fastpar's DDP when its extension is live, else torch's | torch | fastpar
    grad_dtype: torch.dtype | None = None  # dtype gradients are all-reduced in (None: the parameters' dtype)
    grad_accum_steps: int = 1
    grad_clip_norm: float | None = None
    find_unused_parameters: bool = False  # DDP's: for models with parameters that some steps leave without a gradient
    shard_optimizer: bool = False  # ZeRO-1: each process keeps 1/N of the optimizer state (fastpar DDP, >1 process)
    mixed_precision: bool = False  # bf16 autocast where the device supports it
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = (
        None  # factory(optimizer) -> scheduler, stepped per step
    )

    # data
    validation_data: Any = None  # same kinds as train_data
    validation_every: int = 0  # steps between validations; 0: at the end of every epoch
    image_size: int | None = None  # side of the square crops images from a folder become (None: the loader's 224)
    data_threads: int | None = (
        None  # image decoding: DALI threads / DataLoader workers (None: 0 on CPU, loader default on GPU)
    )
    data_cache_dir: str | None = None  # s3:// (object-store) data: keep fetched objects here, shared by the ranks

    # watching it
    log_every: int = 10  # steps between logged metrics (metrics.jsonl, progress bar, plot)
    progress_bar: bool = True
    plots: str | None = None  # "training-progress": a PNG of loss/accuracy, refreshed while training
    output_fns: Sequence[Callable[[dict], Any]] = ()  # called on rank 0 with an info record; truthy stops training
    output_dir: str = "fastpar-output"  # metrics.jsonl and the progress plot go here

    # checkpoints
    checkpoint_dir: str | None = None  # None: no checkpoints
    checkpoint_every: int = 0  # steps between checkpoints; 0: at the end of every epoch
    keep_checkpoints: int = 3
    resume: bool = False  # continue from the newest valid checkpoint in checkpoint_dir

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise OptionError (a ValueError) naming the option and the accepted values when an option is out of range."""

        def positive(name: str, minimum: int = 1) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise OptionError(name, f"TrainingOptions.{name} must be an integer >= {minimum}, got {value!r}")

        for name in ("max_epochs", "batch_size", "grad_accum_steps", "log_every", "keep_checkpoints"):
            positive(name)
        for name in ("validation_every", "checkpoint_every", "max_restarts"):
            positive(name, 0)
        for name in ("devices", "threads_per_process", "image_size"):
            if getattr(self, name) is not None:
                positive(name)
        if self.data_threads is not None:
            positive("data_threads", 0)
        if self.execution_environment not in ENVIRONMENTS:
            raise OptionError(
                "execution_environment",
                f"TrainingOptions.execution_environment must be one of {ENVIRONMENTS}, got {self.execution_environment!r}",
            )
        if self.cpu_backend not in CPU_BACKENDS:
            raise OptionError(
                "cpu_backend", f"TrainingOptions.cpu_backend must be one of {CPU_BACKENDS}, got {self.cpu_backend!r}"
            )
        if self.ddp not in DDP_CHOICES:
            raise OptionError("ddp", f"TrainingOptions.ddp must be one of {DDP_CHOICES}, got {self.ddp!r}")
        if self.plots not in PLOTS:
            raise OptionError("plots", f"TrainingOptions.plots must be 'training-progress' or None, got {self.plots!r}")
        if self.grad_dtype is not None and self.grad_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise OptionError(
                "grad_dtype",
                f"TrainingOptions.grad_dtype must be None, torch.float32, torch.bfloat16 or torch.float16, got {self.grad_dtype!r}",
            )
        if self.grad_clip_norm is not None and not self.grad_clip_norm > 0:
            raise OptionError(
                "grad_clip_norm",
                f"TrainingOptions.grad_clip_norm must be positive or None, got {self.grad_clip_norm!r}",
            )
        if callable(self.output_fns):
            self.output_fns = (self.output_fns,)
        for fn in self.output_fns:
            if not callable(fn):
                raise OptionError("output_fns", f"TrainingOptions.output_fns must hold callables, got {fn!r}")
        if self.lr_scheduler is not None and not callable(self.lr_scheduler):
            raise OptionError(
                "lr_scheduler", "TrainingOptions.lr_scheduler must be a factory: a callable taking the optimizer"
            )
        if self.shard_optimizer and self.ddp == "torch":
            raise OptionError(
                "shard_optimizer",
                "TrainingOptions.shard_optimizer=True shards the optimizer on fastpar's DDP buckets; use ddp='fastpar' "
                "or 'auto' (torch's DDP has its own ZeroRedundancyOptimizer, which the Trainer does not wire up)",
            )
        if self.resume and self.checkpoint_dir is None:
            raise OptionError("resume", "TrainingOptions.resume=True needs checkpoint_dir: the folder to resume from")
