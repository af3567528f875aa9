"""``TrainingOptions``: every knob of ``fastpar.Trainer`` and its default, in one place."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..costmodel.pipeline_split import SCHEDULES
from ..user_errors import OptionError
from .loggers import LoggerError, check_loggers

ENVIRONMENTS = ("auto", "cpu", "gpu", "multi-gpu", "cluster")
DDP_CHOICES = ("auto", "torch", "fastpar")
CPU_BACKENDS = ("auto", "fastpar", "gloo")
PLOTS = (None, "none", "training-progress")
SHARDINGS = ("ddp", "zero1", "zero2", "fsdp", "pipeline", "auto")
PIPELINE_SCHEDULES = SCHEDULES  # one list: the runtime's, the planner's and the options'
FSDP_WRAPS = ("auto", "root")
CHECKPOINT_MODES = (0o600, 0o640, 0o604, 0o644)  # the owner writes; others at most read, never write
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_bytes(value: int | str) -> int:
    """``8_000_000_000``, ``"8GB"``, ``"7.5 GiB"`` -> bytes; ValueError for anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"{value} is not a positive number of bytes")
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value) if isinstance(value, str) else None
    if match is None or match.group(2).lower() not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"{value!r} is not a size (bytes as an int, or a string like '8GB', '512MiB')")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


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
    cpu_backend: str = "auto"  # CPU processes, also on a cluster: auto (fastpar's backend when built) | fastpar | gloo

    # gradient sync and the step
    ddp: str = "auto"  # auto: fastpar's DDP when its extension is live, else torch's | torch | fastpar
    grad_dtype: torch.dtype | None = None  # dtype gradients are all-reduced in (None: the parameters' dtype)
    grad_accum_steps: int = 1
    grad_clip_norm: float | None = None
    find_unused_parameters: bool = False  # DDP's: for models with parameters that some steps leave without a gradient
    shard_optimizer: bool = False  # ZeRO-1: each process keeps 1/N of the optimizer state (fastpar DDP, >1 process)
    # how model state is spread over the processes: ddp (replicated) | zero1 (optimizer state sharded) | zero2
    # (+ gradients) | fsdp (+ parameters: torch's FSDP2) | pipeline (layers split into stages) | auto (the memory
    # planner picks the fastest that fits memory_budget; the plan is printed before training). None: "zero1" when
    # shard_optimizer=True, else "ddp".
    sharding: str | None = None
    memory_budget: int | str | None = None  # bytes per device ("8GB" too) the plan must fit (None: the device's memory)
    pipeline_stages: int | None = None  # pipeline: stages (default: the plan's, else every process one stage)
    pipeline_schedule: str = "1f1b"  # pipeline: 1f1b | gpipe | interleaved-1f1b (torch.distributed.pipelining's)
    microbatches: int | None = None  # pipeline: micro-batches each batch is split into (default: 2 x stages)
    # fsdp units: "auto" (repeated block classes; the plan's) | "root" (the whole model, one unit) |
    # a parameter count (modules at least that big) | block class names (such as ("TransformerBlock",))
    fsdp_wrap: str | int | tuple[str, ...] = "auto"
    fsdp_reshard_after_forward: bool | None = None  # fsdp: free gathered parameters after forward (None: the plan's)
    # fsdp: consecutive blocks grouped into one unit, one all-gather and reduce-scatter for them (None: the plan's, 1)
    fsdp_blocks_per_unit: int | None = None
    # measure the first step's peak memory per process (forward, backward, optimizer) into
    # TrainingResult.peak_memory_bytes: torch's MemTracker on CPU (it slows that one step), max_memory_allocated on GPUs
    measure_peak_memory: bool = False
    # "bf16": autocast to bfloat16 (CPUs, and GPUs that support it: on one that doesn't, the run stops saying so);
    # "fp16": autocast to float16 with loss scaling (torch.amp.GradScaler; fastpar's ShardedGradScaler under ZeRO),
    # GPUs only, with ddp, zero1 or zero2; None: full precision. True is "bf16", False is None.
    mixed_precision: str | bool | None = None
    # recompute chosen blocks' activations in backward instead of keeping them (fastpar.shard.checkpoint_activations):
    # True (every repeated block: a transformer's layers) | k (every k-th of them) | block class names | False
    activation_checkpointing: bool | int | str | tuple[str, ...] = False
    # torch.compile the model the step runs (fastpar's or torch's DDP, ZeRO, FSDP): True, or a dict of
    # torch.compile's arguments ({"backend": "inductor", "mode": "max-autotune"}); not with pipeline stages
    compile: bool | dict = False
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
    # where else rank 0 logs every logged step: "csv" (metrics.csv) | "tensorboard" | "mlflow" (local store) |
    # "wandb" (offline), under output_dir; a logger whose package is missing is refused here (see loggers.py)
    loggers: Sequence[str] = ()

    # checkpoints
    checkpoint_dir: str | None = None  # None: no checkpoints
    checkpoint_every: int = 0  # steps between checkpoints; 0: at the end of every epoch
    keep_checkpoints: int = 3
    resume: bool = False  # continue from the newest valid checkpoint in checkpoint_dir
    # checkpoint files' mode: 0o600 only you read them; 0o640 your group too (a shared folder); 0o644 anyone. A
    # checkpoint_dir the trainer creates gets the matching folder mode (0o700, 0o750, 0o755)
    checkpoint_mode: int = 0o600

    def __post_init__(self) -> None:
        self.validate()

    def _check_activation_checkpointing(self) -> None:
        from ..shard.activation_checkpoint import ActivationCheckpointError, checkpointing_spec

        if isinstance(self.activation_checkpointing, list):
            self.activation_checkpointing = tuple(self.activation_checkpointing)
        try:
            spec = checkpointing_spec(self.activation_checkpointing)
        except ActivationCheckpointError as exc:
            raise OptionError("activation_checkpointing", f"TrainingOptions.{exc}") from None
        if spec is not None and self.strategy == "pipeline":
            raise OptionError(
                "activation_checkpointing",
                "TrainingOptions.activation_checkpointing does not apply to pipeline stages (each stage keeps only "
                "its micro-batches' activations); use it with ddp, zero1, zero2 or fsdp",
            )

    def _check_compile(self) -> None:
        if isinstance(self.compile, bool):
            return
        if not isinstance(self.compile, dict):
            raise OptionError(
                "compile",
                f"TrainingOptions.compile must be True, False or a dict of torch.compile's arguments, got "
                f"{self.compile!r}",
            )
        import inspect

        accepted = set(inspect.signature(torch.compile).parameters) - {"model"}
        unknown = sorted(set(self.compile) - accepted)
        if unknown:
            raise OptionError(
                "compile",
                f"TrainingOptions.compile: torch.compile takes no argument {unknown}; it takes {sorted(accepted)}",
            )

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
        try:
            self.loggers = check_loggers(self.loggers)
        except LoggerError as exc:
            raise OptionError("loggers", str(exc)) from None
        if self.mixed_precision is True or self.mixed_precision is False:
            self.mixed_precision = "bf16" if self.mixed_precision else None
        if self.mixed_precision not in (None, "bf16", "fp16"):
            raise OptionError(
                "mixed_precision",
                f"TrainingOptions.mixed_precision must be 'bf16', 'fp16' or None (True means 'bf16'), got "
                f"{self.mixed_precision!r}",
            )
        if self.mixed_precision == "fp16" and self.strategy in ("fsdp", "pipeline"):
            raise OptionError(
                "mixed_precision",
                f"TrainingOptions.mixed_precision='fp16' needs loss scaling, which sharding={self.strategy!r} does "
                "not run here (FSDP's gradients are sharded DTensors; a pipeline schedule runs its own backward); "
                "use mixed_precision='bf16' (no scaling needed), or sharding 'ddp', 'zero1' or 'zero2'",
            )
        self._check_activation_checkpointing()
        self._check_compile()
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
        self._validate_sharding()
        if isinstance(self.checkpoint_mode, bool) or self.checkpoint_mode not in CHECKPOINT_MODES:
            shown = oct(self.checkpoint_mode) if isinstance(self.checkpoint_mode, int) else repr(self.checkpoint_mode)
            raise OptionError(
                "checkpoint_mode",
                f"TrainingOptions.checkpoint_mode must be 0o600 (only you read the checkpoints), 0o640 (your group "
                f"too: a shared folder) or 0o644 (anyone), got {shown}; nobody but you may write them",
            )
        if self.resume and self.checkpoint_dir is None:
            raise OptionError("resume", "TrainingOptions.resume=True needs checkpoint_dir: the folder to resume from")

    @property
    def strategy(self) -> str:
        """The sharding strategy asked for: ``sharding``, or what ``shard_optimizer`` stands for."""
        if self.sharding is not None:
            return self.sharding
        return "zero1" if self.shard_optimizer else "ddp"

    @property
    def memory_budget_bytes(self) -> int | None:
        return None if self.memory_budget is None else parse_bytes(self.memory_budget)

    def _validate_sharding(self) -> None:
        if self.sharding is not None and self.sharding not in SHARDINGS:
            raise OptionError("sharding", f"TrainingOptions.sharding must be one of {SHARDINGS}, got {self.sharding!r}")
        if self.shard_optimizer and self.sharding not in (None, "zero1"):
            raise OptionError(
                "shard_optimizer",
                f"TrainingOptions.shard_optimizer=True means sharding='zero1', which contradicts "
                f"sharding={self.sharding!r}; drop shard_optimizer and keep sharding={self.sharding!r}",
            )
        strategy = self.strategy
        if strategy in ("zero1", "zero2") and self.ddp == "torch":
            raise OptionError(
                "ddp",
                f"TrainingOptions.sharding={strategy!r} shards on fastpar's DDP buckets; use ddp='fastpar' or 'auto' "
                "(torch's DDP has its own ZeroRedundancyOptimizer, which the Trainer does not wire up)",
            )
        if self.memory_budget is not None:
            try:
                parse_bytes(self.memory_budget)
            except ValueError as exc:
                raise OptionError("memory_budget", f"TrainingOptions.memory_budget: {exc}") from None
        for name in ("pipeline_stages", "microbatches", "fsdp_blocks_per_unit"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise OptionError(name, f"TrainingOptions.{name} must be an integer >= 1 or None, got {value!r}")
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise OptionError(
                "pipeline_schedule",
                f"TrainingOptions.pipeline_schedule must be one of {PIPELINE_SCHEDULES}, got {self.pipeline_schedule!r}",
            )
        wrap = self.fsdp_wrap
        if isinstance(wrap, list):
            self.fsdp_wrap = wrap = tuple(wrap)
        names = isinstance(wrap, tuple) and wrap and all(isinstance(n, str) and n for n in wrap)
        if not (wrap in FSDP_WRAPS or names or (isinstance(wrap, int) and not isinstance(wrap, bool) and wrap >= 1)):
            raise OptionError(
                "fsdp_wrap",
                f"TrainingOptions.fsdp_wrap must be 'auto', 'root', a parameter count >= 1 (modules at least that "
                f"big become units) or block class names like ('TransformerBlock',), got {wrap!r}",
            )
        if self.fsdp_reshard_after_forward not in (None, True, False):
            raise OptionError(
                "fsdp_reshard_after_forward",
                f"TrainingOptions.fsdp_reshard_after_forward must be True, False or None, got "
                f"{self.fsdp_reshard_after_forward!r}",
            )
        pipeline_only = {"pipeline_stages": None, "microbatches": None, "pipeline_schedule": "1f1b"}
        fsdp_only = {"fsdp_wrap": "auto", "fsdp_reshard_after_forward": None, "fsdp_blocks_per_unit": None}
        for names, owner in ((pipeline_only, "pipeline"), (fsdp_only, "fsdp")):
            for name, default in names.items():
                if getattr(self, name) != default and strategy not in (owner, "auto"):
                    raise OptionError(
                        name,
                        f"TrainingOptions.{name} applies to sharding='{owner}' (or 'auto'), not {strategy!r}; "
                        f"drop it or set sharding='{owner}'",
                    )
        if strategy == "pipeline":
            if self.grad_accum_steps != 1:
                raise OptionError(
                    "grad_accum_steps",
                    "TrainingOptions.grad_accum_steps must be 1 with sharding='pipeline': a pipeline accumulates "
                    "over its micro-batches; raise microbatches (and batch_size) instead",
                )
            if self.validation_data is not None:
                raise OptionError(
                    "validation_data",
                    "TrainingOptions.validation_data is not supported with sharding='pipeline' (no process holds "
                    "the whole model to evaluate it); validate the exported model (fastpar.shard.checkpoint."
                    "export_consolidated) or train with another sharding",
                )
            if self.microbatches is not None and self.batch_size % self.microbatches:
                raise OptionError(
                    "microbatches",
                    f"TrainingOptions.microbatches={self.microbatches} must divide batch_size={self.batch_size}: "
                    "each batch is cut into that many equal micro-batches",
                )
