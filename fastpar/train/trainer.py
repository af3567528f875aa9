"""``fastpar.Trainer``: one training script for CPU cores, one GPU, all local GPUs or a torchrun cluster."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .. import launcher
from ..safe_files import folder_mode_for
from ..user_errors import OptionError
from . import checkpoint as ckpt
from .batches import Objective
from .data import check_exists
from .environment import resolve
from .job import Job, OptimizerSpec, build_model, check_picklable
from .loop import check_fp16
from .options import TrainingOptions
from .worker import run_worker


def check_resumable(model: Any, newest: Any, strategy: str) -> None:
    """Refuse, in the launching process, a newest checkpoint of another model (names or shapes) or of a sharding
    it can't continue. The model is built on the meta device: its shapes, none of its memory. (The workers check
    again, at every world size, against the checkpoint they load.)"""
    from ..shard import checkpoint as sharded

    if sharded.is_sharded_checkpoint(newest):
        try:
            record, saved = sharded.read_trainer_record(newest), sharded.model_shapes_in(newest)
        except sharded.UntrustedCheckpointError:  # planted, not damaged: refused here, before any worker starts
            raise
        except Exception:  # unreadable: the workers skip it for an older one, and say so
            return
        saved_by = record.get("sharding")
        same = {"zero1": "zero", "zero2": "zero"}
        if strategy != "auto" and same.get(saved_by, saved_by) != same.get(strategy, strategy):
            raise sharded.IncompatibleCheckpointError(
                f"the checkpoint {newest} was written with sharding={saved_by!r}, this run uses sharding={strategy!r}; "
                f"resume with sharding={saved_by!r}, or start from its weights: "
                "fastpar.shard.checkpoint.export_consolidated(...) and load them into the model you pass"
            )
    else:
        try:
            state = torch.load(newest, map_location="cpu", weights_only=True, mmap=True)
            saved = {k: v.shape for k, v in state["model"].items()}
        except Exception:
            return
    if isinstance(model, torch.nn.Module):
        expected = {k: v.shape for k, v in model.state_dict().items()}
    else:
        with torch.device("meta"):
            expected = {k: v.shape for k, v in build_model(model).state_dict().items()}
    sharded.check_compatible(expected, saved, str(newest))


@dataclasses.dataclass
class TrainingResult:
    """What ``Trainer.fit()`` returns on rank 0 (on other ranks of a torchrun job, ``model`` is None)."""

    model: torch.nn.Module | None  # the trained module (the one you passed, updated in place, when you passed one)
    history: list[dict[str, Any]]  # every logged step, as written to metrics.jsonl
    metrics_path: str | None
    plot_path: str | None
    checkpoints: list[str]
    stopped_early: bool  # an output function returned True
    steps: int  # of the whole run, earlier (resumed) calls included
    elapsed: float  # seconds of training of the whole run, earlier (resumed) calls included
    start_step: int = 0  # the step this call started (or resumed) at; == steps when there was nothing to train
    start_elapsed: float = 0.0  # seconds of training before this call (a resumed run's earlier calls)
    sharding: str | None = None  # the strategy that trained: ddp, zero1, zero2, fsdp or pipeline (after "auto")
    # parameters, gradients, optimizer state and their total, in bytes, on the rank that held the most, measured
    # after this call's first step (None when it took none)
    model_state_bytes: dict[str, int] | None = None
    # with TrainingOptions(measure_peak_memory=True): the most bytes live at once during this call's first step
    # (forward, backward, optimizer step) on the process with the highest peak ("total", its "rank"), and the
    # state + buffers that process held after the step ("state"); None otherwise
    peak_memory_bytes: dict[str, int] | None = None
    logger_paths: dict[str, str] = dataclasses.field(default_factory=dict)  # logger name -> where it wrote

    @property
    def steps_this_call(self) -> int:
        return self.steps - self.start_step

    @property
    def elapsed_this_call(self) -> float:
        return self.elapsed - self.start_elapsed

    @property
    def final(self) -> dict[str, Any]:
        """The last logged record: loss, accuracy, validation metrics, throughput."""
        return self.history[-1] if self.history else {}

    def last(self, key: str) -> Any:
        """The most recent logged value of ``key`` (e.g. "val_accuracy"), or None."""
        return next((r[key] for r in reversed(self.history) if r.get(key) is not None), None)


class Trainer:
    """Train ``model`` with ``optimizer`` on ``train_data`` as ``options`` says.

    - ``model``: an ``nn.Module`` or a factory returning one (each process builds its own).
    - ``optimizer``: an optimizer over ``model.parameters()``, or a factory ``fn(params) -> Optimizer``.
    - ``loss_fn``, one of three forms (:mod:`fastpar.train.batches`): ``loss_fn(outputs, targets) -> scalar``
      for ``(inputs, targets)`` batches; ``None`` when the model returns its own loss (``model(**batch)`` for a
      dict batch, e.g. a Hugging Face model given ``labels``); ``fastpar.loss_from_batch(fn)`` with
      ``fn(model, batch) -> loss`` or ``(loss, {name: scalar})``, whose scalars are logged too.
    - ``train_data``: an image folder (class subfolders), ``(x, y)`` arrays (numpy or torch), a torch Dataset
      (its samples may be tuples or dicts), a loader (e.g. ``fastpar.data.token_loader``), or a factory
      ``fn(rank, world_size) -> loader``. A torch DataLoader (default sampler) or a fastpar loader made here is
      re-planned so each process gets its own shard. Batches (tensors, tuples, lists, dicts) are moved to the
      device, floating tensors cast to the model's dtype; ``(inputs, targets)`` integer targets become int64.

    Started from a plain ``python train.py`` the trainer launches its own workers, so these objects are
    pickled: define them at module level and guard the entry with ``if __name__ == "__main__":``.
    """

    def __init__(
        self, model: Any, optimizer: Any, loss_fn: Any, train_data: Any, *, options: TrainingOptions | None = None
    ) -> None:
        self.options = options or TrainingOptions()
        self.model, self.optimizer, self.loss_fn, self.train_data = model, optimizer, loss_fn, train_data
        if not (isinstance(model, torch.nn.Module) or callable(model)):
            raise TypeError(f"model must be an nn.Module or a factory returning one, got {type(model).__name__}")
        if not (isinstance(optimizer, torch.optim.Optimizer) or callable(optimizer)):
            raise TypeError(f"optimizer must be an Optimizer or a factory fn(params), got {type(optimizer).__name__}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(
                f"loss_fn must be loss_fn(outputs, targets), None (the model returns its loss) or "
                f"fastpar.loss_from_batch(fn); got {type(loss_fn).__name__}"
            )

    def _check_before_launch(self) -> None:
        """Every error a user can fix, raised here in the launching process before any worker starts."""
        opts = self.options
        opts.validate()
        if opts.strategy == "pipeline" and not Objective(self.loss_fn).takes_pairs:
            raise OptionError(
                "sharding",
                "sharding='pipeline' computes loss_fn(outputs, targets) on the last stage, so it needs (inputs, "
                "targets) batches and such a loss_fn; with loss_fn=None or fastpar.loss_from_batch choose 'ddp', "
                "'zero1', 'zero2', 'fsdp' or 'auto'",
            )
        check_exists(self.train_data, "train_data")
        if opts.validation_data is not None:
            check_exists(opts.validation_data, "TrainingOptions.validation_data")
        ckpt.check_writable(opts.output_dir, "output_dir")
        if opts.checkpoint_dir is not None:
            ckpt.check_writable(opts.checkpoint_dir, "checkpoint_dir", folder_mode_for(opts.checkpoint_mode))
            ckpt.remove_stale_temp_files(opts.checkpoint_dir)
            existing = ckpt.list_checkpoints(opts.checkpoint_dir)
            if existing and not opts.resume and not ckpt.restarted_by_torchrun():
                raise FileExistsError(
                    f"TrainingOptions.checkpoint_dir={opts.checkpoint_dir!r} already holds {len(existing)} checkpoint(s) "
                    f"(newest {existing[-1].name}) from an earlier run; pass resume=True to continue from them, "
                    "or use an empty folder"
                )
            if existing and opts.resume:
                check_resumable(self.model, existing[-1], opts.strategy)
        if opts.plots == "training-progress":
            from .._optional import require

            require("matplotlib", extra="plot", purpose="plots='training-progress'")

    def fit(self) -> TrainingResult:
        """Train; returns a TrainingResult (see its fields)."""
        self._check_before_launch()
        opts = self.options
        plan = resolve(opts.execution_environment, opts.devices, opts.threads_per_process, opts.cpu_backend)
        if opts.mixed_precision == "fp16":
            check_fp16(torch.device(plan.device_type), opts.strategy)  # before any worker starts
        optimizer = self.optimizer
        local_launch = plan.nprocs > 1
        if isinstance(optimizer, torch.optim.Optimizer):
            if not isinstance(self.model, torch.nn.Module):
                raise TypeError(
                    "an optimizer instance needs a model instance; with a model factory pass an optimizer factory"
                )
            if local_launch:
                optimizer = OptimizerSpec.from_optimizer(optimizer, self.model)
            else:
                optimizer = lambda _params, opt=optimizer: opt  # noqa: E731 - same process: use it as is
        job = Job(self.model, optimizer, self.loss_fn, self.train_data, opts, plan)
        if local_launch:
            check_picklable(job)
            raw = launcher.launch_agent(run_worker, (job,), nproc_per_node=plan.nprocs, max_restarts=opts.max_restarts)[
                0
            ]
            if raw is not None and "refused" in raw:
                raise OptionError(*raw["refused"])
        else:  # one process here, or this process is already a torchrun worker
            raw = run_worker(job)
        return self._result(raw)

    def _result(self, raw: dict[str, Any] | None) -> TrainingResult:
        if raw is None:  # a non-zero rank of a torchrun job
            return TrainingResult(None, [], None, None, [], False, 0, 0.0)
        model = build_model(self.model)
        model.load_state_dict(raw["model_state"])
        return TrainingResult(
            model=model,
            history=raw["history"],
            metrics_path=raw["metrics_path"],
            plot_path=raw["plot_path"],
            checkpoints=raw["checkpoints"],
            stopped_early=raw["stopped_early"],
            steps=raw["steps"],
            elapsed=raw["elapsed"],
            start_step=raw["start_step"],
            start_elapsed=raw.get("start_elapsed", 0.0),
            sharding=raw.get("sharding"),
            model_state_bytes=raw.get("model_state_bytes"),
            peak_memory_bytes=raw.get("peak_memory_bytes"),
            logger_paths=raw.get("logger_paths", {}),
        )
