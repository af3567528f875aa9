"""The per-rank training loop. Every process runs ``Run(...).train()``; rank 0 also logs, plots,
calls the output functions and writes checkpoints.

One step: ``grad_accum_steps`` batches forward/backward (gradient sync only on the last one), clip,
optimizer step, scheduler step. Loss, accuracy (classification only), samples, tokens and the metrics a
``loss_from_batch`` function returns are summed on the device and reduced across ranks only on logged steps,
so an ordinary step has no CPU-GPU sync and no extra collective. (What a batch and its loss are: batches.py.)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from ..user_errors import OptionError
from . import checkpoint as ckpt
from . import resume
from .batches import Objective, StepResult, to_device
from .data import batches_per_epoch, make_loader
from .job import Job, build_model, build_optimizer, ddp_choice
from .loggers import open_loggers
from .planning import plan_sharding
from .plot import write_progress_plot
from .progress import MetricsLog, ProgressBar
from .strategies import build_strategy

if TYPE_CHECKING:
    from ..shard.peak_memory import PeakTracker, StepMemory

_PLOT_REFRESH_S = 10.0  # redraw the progress PNG at most this often (a redraw costs ~0.2 s on rank 0)
# Every info record an output function gets has these keys (None when not known at that point).
INFO_KEYS = (
    "state",
    "epoch",
    "iteration",
    "loss",
    "accuracy",
    "val_loss",
    "val_accuracy",
    "lr",
    "elapsed",
    "samples_per_s",
    "tokens_per_s",
    "max_epochs",
    "total_steps",
)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _floating_dtype(module: torch.nn.Module) -> torch.dtype:
    floating = [p.dtype for p in module.parameters() if p.is_floating_point()]
    return floating[0] if floating else torch.get_default_dtype()


def check_fp16(device: torch.device, strategy: str) -> None:
    """mixed_precision='fp16' runs where float16 pays off and loss scaling works: CUDA, DDP or ZeRO."""
    if device.type != "cuda":
        raise OptionError(
            "mixed_precision",
            f"TrainingOptions.mixed_precision='fp16' is for GPUs: on the {device.type.upper()} float16 matmuls are "
            "slower than float32 and need loss scaling; use mixed_precision='bf16' (float32's range, no scaling) "
            "or None",
        )
    if strategy in ("fsdp", "pipeline"):
        raise OptionError(
            "mixed_precision",
            f"TrainingOptions.mixed_precision='fp16' with sharding={strategy!r} (chosen by 'auto'): loss scaling "
            "runs with ddp, zero1 or zero2; use mixed_precision='bf16' or one of those shardings",
        )


def _planned_checkpointing(option: Any) -> bool | None:
    """What the planner prices: not asked -> with and without (it may turn checkpointing on); every repeated block
    (True) -> only with; another choice of blocks -> as measured, without (more than it will hold)."""
    from ..shard.activation_checkpoint import checkpointing_spec

    spec = checkpointing_spec(option)
    return None if spec is None else spec == ("auto", 1)


def _classification(out: Any, y: Any) -> bool:
    return torch.is_tensor(out) and torch.is_tensor(y) and out.ndim == 2 and y.ndim == 1 and not y.is_floating_point()


# the window of summed metrics: loss x samples, correct predictions, samples, tokens (then the returned metrics)
_LOSS, _CORRECT, _SAMPLES, _TOKENS = range(4)


class Run:
    def __init__(self, job: Job, rank: int, world_size: int, device: torch.device) -> None:
        self.job, self.opts = job, job.options
        self.rank, self.world_size, self.device = rank, world_size, device
        self.model_state_bytes: dict[str, int] | None = None  # measured at this call's first step (largest rank)
        self.peak_memory_bytes: dict[str, int] | None = None  # the first step's peak (opts.measure_peak_memory)
        self._peak_tracker: PeakTracker | None = None
        self.is_main = rank == 0
        self.objective = Objective(job.loss_fn)
        self.metric_names: list[str] | None = None  # what the loss returns beside itself, fixed at the first batch
        opts = self.opts

        threads = opts.data_threads if opts.data_threads is not None else (None if device.type == "cuda" else 0)
        self.loader_args = dict(
            batch_size=opts.batch_size,
            seed=opts.seed,
            image_size=opts.image_size,
            threads=threads,
            device=device,
            cache_dir=opts.data_cache_dir,  # object-store data: a local cache shared by the ranks
        )
        name, plan_options, example = opts.strategy if world_size > 1 else "ddp", {}, None  # one process: no shards
        if name == "auto" or opts.memory_budget is not None:
            name, plan_options = self._plan(name)
            if plan_options.pop("activation_checkpointing", False) and not opts.activation_checkpointing:
                # it fits only with the repeated blocks checkpointed: the same bits, a slower step
                opts = self.opts = dataclasses.replace(opts, activation_checkpointing=True)
                job = self.job = dataclasses.replace(job, options=opts)
        if name == "pipeline" and world_size > 1:
            example = self._example_batch()
        _seed_everything(opts.seed)  # identical initial weights on every rank
        self.strategy = build_strategy(job, name, rank, world_size, device, plan_options, example)
        if opts.compile:
            self.strategy.compile({} if opts.compile is True else dict(opts.compile))
        self.model, self.ddp_model = self.strategy.model, self.strategy.train_model
        self.optimizer = self.strategy.optimizer
        self.scheduler = opts.lr_scheduler(self.optimizer) if opts.lr_scheduler else None
        _seed_everything(opts.seed + 1000 * rank)  # distinct dropout/augmentation streams per rank
        floating = [p.dtype for p in self.model.parameters() if p.is_floating_point()]
        self.input_dtype = floating[0] if floating else torch.get_default_dtype()

        data_rank, data_world = self.strategy.data_rank, self.strategy.data_world_size
        loader_args = dict(self.loader_args, rank=data_rank, world_size=data_world)
        self.train_loader = make_loader(job.train_data, train=True, **loader_args)
        self.val_loader = (
            make_loader(opts.validation_data, train=False, **loader_args) if opts.validation_data is not None else None
        )
        self.batches = self._agreed_batches_per_epoch()
        accum = opts.grad_accum_steps
        self.steps_per_epoch = -(-self.batches // accum)
        self.total_steps = self.steps_per_epoch * opts.max_epochs

        self.autocast = contextlib.nullcontext
        if opts.mixed_precision == "bf16":
            if device.type == "cuda" and not torch.cuda.is_bf16_supported():
                raise RuntimeError(
                    f"mixed_precision='bf16': {torch.cuda.get_device_name(device)} does not support bfloat16; train "
                    "in full precision (mixed_precision=None)"
                )
            self.autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16)
        self.grad_scaler = None
        if opts.mixed_precision == "fp16":
            check_fp16(device, self.strategy.name)
            from ..zero import ShardedGradScaler  # torch's GradScaler, and ZeRO's gradient slices agreed by all ranks

            self.autocast = lambda: torch.autocast(device.type, dtype=torch.float16)
            self.grad_scaler = ShardedGradScaler(device.type)
            self.strategy.grad_scaler = self.grad_scaler

        self.step, self.epoch, self.batch_in_epoch, self.elapsed_before = 0, 0, 0, 0.0
        self.started, self.loader_state, self.skip = time.perf_counter(), None, 0
        self.ckpt_dir = Path(opts.checkpoint_dir) if opts.checkpoint_dir else None
        resumed = self._maybe_resume()
        self.start_step = self.saved_step = self.step
        self.checkpoints = [str(p) for p in ckpt.list_checkpoints(self.ckpt_dir)] if self.ckpt_dir else []

        self.output_dir = Path(opts.output_dir)
        if self.is_main:
            self.metrics = MetricsLog(self.output_dir / "metrics.jsonl", self.step if resumed else None)
            self.loggers = open_loggers(opts.loggers, self.output_dir, self.step if resumed else None, _params(opts))
            self.bar = None
            if opts.progress_bar and self.epoch < opts.max_epochs:  # nothing to train: no bar, no summary
                self._print_summary()  # before the bar starts redrawing its line
                self.bar = ProgressBar(self.total_steps, opts.max_epochs, start_step=self.step)
            self.plot_path = self.output_dir / "training-progress.png" if opts.plots == "training-progress" else None
            self._plotted_at = 0.0
        self._reset_window()

    def _plan(self, strategy: str) -> tuple[str, dict]:
        """Ask the memory planner (rank 0, with a real batch) which strategy fits; every rank gets its answer."""
        example = module = optimizer = None
        if self.is_main:  # rank 0 builds the whole model once, on the CPU or this device, to measure it
            _seed_everything(self.opts.seed)
            module = copy.deepcopy(build_model(self.job.model))  # measuring runs it: not the instance we train
            optimizer = build_optimizer(self.job.optimizer, module)
            example = self._example_batch(module)
            module.to(self.device)
        return plan_sharding(
            module,
            optimizer,
            self.objective,
            example,
            strategy,
            self.opts.memory_budget_bytes,
            self.rank,
            self.world_size,
            self.device,
            activation_checkpointing=_planned_checkpointing(self.opts.activation_checkpointing),
            # the plan groups only wrap="auto"'s blocks: other units are priced one block a unit
            fsdp_blocks_per_unit=self.opts.fsdp_blocks_per_unit if self.opts.fsdp_wrap == "auto" else 1,
        )

    def _example_batch(self, module: torch.nn.Module | None = None) -> Any:
        """The first training batch (as rank 0 of one process would read it), on this device."""
        if module is None:
            _seed_everything(self.opts.seed)
            module = build_model(self.job.model)
        loader = make_loader(self.job.train_data, train=True, rank=0, world_size=1, **self.loader_args)
        return self._batch(next(iter(loader)), module_dtype=module)

    def _agreed_batches_per_epoch(self) -> int:
        """Batches per epoch, checked equal on every rank: a rank with fewer would leave the others in a collective."""
        mine = batches_per_epoch(self.train_loader)
        counts = [mine]
        if self.world_size > 1:
            counts = [None] * self.world_size
            dist.all_gather_object(counts, mine)
        if len(set(counts)) > 1 or mine == 0:
            raise ValueError(
                f"the training loader yields {counts} batches per epoch on ranks 0..{self.world_size - 1}; every "
                "rank needs the same number, at least 1 (use less batch_size or more data; a factory's loaders "
                "must shard evenly, e.g. fastpar.data.array_loader(..., last_batch='drop'))"
            )
        return mine

    def _print_summary(self) -> None:
        where = f"{self.world_size} {self.device.type.upper()} process(es)"
        ddp = ""
        if self.world_size > 1:
            name = self.strategy.describe()
            ddp = f", {ddp_choice(self.opts)} DDP" if name == "ddp" else f", sharding: {name}"
        loader = getattr(getattr(self.train_loader, "backend", None), "name", type(self.train_loader).__name__)
        print(
            f"fastpar: training on {where}{ddp}; data: {loader}, {self.batches} batches/epoch per process; "
            f"{self.total_steps} steps",
            flush=True,
        )

    # --- resume and checkpoints -------------------------------------------------------------------
    def _maybe_resume(self) -> bool:
        if self.ckpt_dir is None or not (self.opts.resume or ckpt.restarted_by_torchrun()):
            return False
        position = resume.restore(
            self.ckpt_dir,
            strategy=self.strategy,
            scheduler=self.scheduler,
            rank=self.rank,
            world_size=self.world_size,
            batches_per_epoch=self.batches,
            total_steps=self.total_steps,
            max_epochs=self.opts.max_epochs,
            report=print if self.is_main else (lambda _msg: None),
            grad_scaler=self.grad_scaler,
        )
        if position is None:
            return False
        self.step, self.epoch, self.batch_in_epoch = position.step, position.epoch, position.batch_in_epoch
        self.elapsed_before, self.loader_state = position.elapsed, position.loader_state
        return True

    def _save_checkpoint(self) -> None:
        self.saved_step = self.step  # on every rank: they all decide alike whether a final save is due
        kept = resume.save(
            self.ckpt_dir,
            self.opts.keep_checkpoints,
            step=self.step,
            epoch=self.epoch,
            batch_in_epoch=self.batch_in_epoch,
            batches_per_epoch=self.batches,
            elapsed=self.elapsed(),
            total_steps=self.total_steps,
            strategy=self.strategy,
            scheduler=self.scheduler,
            train_loader=self.train_loader,
            rank=self.rank,
            world_size=self.world_size,
            mode=self.opts.checkpoint_mode,
            grad_scaler=self.grad_scaler,
        )
        if kept is not None:
            self.checkpoints = kept

    # --- metrics ----------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.started

    def _reset_window(self) -> None:
        extra = len(self.metric_names or ())
        self.window = torch.zeros(4 + extra, dtype=torch.float64, device=self.device)  # _LOSS.. then metrics
        self.window_start = time.perf_counter()
        self.is_classifier = None
        self._mark_step()

    def _mark_step(self) -> None:
        """Remember where this step starts in the window, for the per-step output-function record."""
        self.step_mark = self.window.clone()
        self.step_start = time.perf_counter()

    def _reduce(self, values: torch.Tensor) -> list[float]:
        if self.world_size > 1:
            dist.all_reduce(values)
        return values.tolist()  # CPU-GPU sync point (logged steps, and every step when output_fns are set)

    def _batch(self, batch: Any, module_dtype: torch.nn.Module | None = None) -> Any:
        """The batch on this device, floating tensors in the model's dtype (numpy gives float64)."""
        dtype = self.input_dtype if module_dtype is None else _floating_dtype(module_dtype)
        return to_device(batch, self.device, dtype)

    def _fix_metric_names(self, result: StepResult) -> None:
        """The first batch fixes the metric names every window holds (and reduces, alike on every rank)."""
        if self.metric_names is None:
            self.metric_names = sorted(result.metrics)
            grow = self.window.new_zeros(len(self.metric_names))
            self.window, self.step_mark = torch.cat([self.window, grow]), torch.cat([self.step_mark, grow])

    def _add(self, window: torch.Tensor, result: StepResult) -> None:
        """Add one micro-batch's numbers to a window (on the device: no sync)."""
        if sorted(result.metrics) != self.metric_names:
            raise ValueError(
                f"the loss returned metrics {sorted(result.metrics)}, earlier {self.metric_names}; return the same "
                "names for every batch"
            )
        samples = result.samples
        window[_LOSS] += result.loss.detach().double() * samples
        if _classification(result.outputs, result.targets):
            window[_CORRECT] += (result.outputs.argmax(1) == result.targets).sum()
        window[_SAMPLES] += samples
        window[_TOKENS] += result.tokens or 0
        for i, name in enumerate(self.metric_names):
            window[4 + i] += result.metrics[name] * samples

    def _means(self, values: list[float], prefix: str = "") -> dict[str, float]:
        """The reduced window's per-sample means of the returned metrics."""
        count = max(values[_SAMPLES], 1)
        return {prefix + name: values[4 + i] / count for i, name in enumerate(self.metric_names or ())}

    def _validate(self) -> dict[str, float]:
        self.model.eval()
        totals = None
        classifier = False
        if hasattr(self.val_loader, "set_epoch"):
            self.val_loader.set_epoch(0)
        extra, batch = self._agreed_validation_padding(), None
        with torch.no_grad(), self.autocast():
            for batch in self.val_loader:
                batch = self._batch(batch)
                # the bare module: no DDP hooks or buffer broadcasts in evaluation
                result = self.objective(self.model, batch, self.device)
                classifier = classifier or _classification(result.outputs, result.targets)
                self._fix_metric_names(result)
                totals = torch.zeros_like(self.window) if totals is None else totals
                self._add(totals, result)
            for _ in range(extra):  # FSDP2: every rank must take part in as many forwards' all-gathers
                if batch is None:  # this rank's shard of the validation data is empty
                    batch = self._batch(next(iter(self.val_loader)))
                self.objective(self.model, batch, self.device)
        self.model.train()
        values = self._reduce(torch.zeros_like(self.window) if totals is None else totals)
        count = max(values[_SAMPLES], 1)
        result = {"val_loss": values[_LOSS] / count, **self._means(values, "val_")}
        if classifier:
            result["val_accuracy"] = values[_CORRECT] / count
        return result

    def _agreed_validation_padding(self) -> int:
        """Forwards this rank runs beyond its own validation batches (uncounted), so that every rank runs as
        many: a fully sharded forward is collective, and the validation shards may differ by a batch."""
        if not self.strategy.collective_forward:
            return 0
        counts: list = [None] * self.world_size
        dist.all_gather_object(counts, batches_per_epoch(self.val_loader))
        return max(counts) - counts[self.rank]

    def _record(self, sums: torch.Tensor, seconds: float) -> dict[str, Any] | None:
        """All ranks' window (loss sum, correct, samples, tokens, metrics) reduced into a record on rank 0 (None
        elsewhere)."""
        values = self._reduce(sums)
        if not self.is_main:
            return None
        count, tokens = values[_SAMPLES], values[_TOKENS]
        record = {
            "epoch": self.epoch,
            "iteration": self.step,
            "loss": values[_LOSS] / max(count, 1),
            "accuracy": values[_CORRECT] / count if self.is_classifier and count else None,
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            "elapsed": self.elapsed(),
            "samples_per_s": count / max(seconds, 1e-9),  # training only: validation time excluded
        }
        if tokens:
            record["tokens_per_s"] = tokens / max(seconds, 1e-9)
        record.update(self._means(values))
        return record

    def _log(self, validation: dict[str, float] | None, seconds: float) -> bool:
        """Reduce the window's metrics, record them on rank 0, call output functions; True: stop (all ranks)."""
        record = self._record(self.window, seconds)
        stop = False
        if record is not None:
            record.update(validation or {})
            self.metrics.append(record)
            for logger in self.loggers:
                logger.log(record)
            if self.bar is not None:
                self.bar.update(record)
            self._refresh_plot(final=False)
            stop = self._call_output_fns(record, "iteration")
        self._reset_window()
        return self._share_stop(stop)

    def _step_output_fns(self) -> bool:
        """Between logged steps: call the output functions with this step's metrics (all ranks' mean)."""
        record = self._record(self.window - self.step_mark, time.perf_counter() - self.step_start)
        stop = self._call_output_fns(record, "iteration") if record is not None else False
        self._mark_step()
        return self._share_stop(stop)

    def _call_output_fns(self, record: dict[str, Any], state: str) -> bool:
        info = dict.fromkeys(INFO_KEYS)
        info.update(record, state=state, max_epochs=self.opts.max_epochs, total_steps=self.total_steps)
        answers = [fn(dict(info)) for fn in self.opts.output_fns]  # call every fn, even after a True
        return any(answer is not None and bool(answer) for answer in answers)

    def _share_stop(self, stop: bool) -> bool:
        if self.world_size == 1 or not self.opts.output_fns:
            return stop
        flag = torch.tensor([int(stop)], device=self.device)
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    def _refresh_plot(self, final: bool) -> None:
        if self.plot_path is None or not self.metrics.records:
            return
        now = time.perf_counter()
        if final or now - self._plotted_at >= _PLOT_REFRESH_S:
            write_progress_plot(self.metrics.records, self.plot_path, final=final)
            self._plotted_at = now

    # --- the loop ---------------------------------------------------------------------------------
    def _optimizer_step(self) -> None:
        scaler = self.grad_scaler
        if self.opts.grad_clip_norm is not None:
            if scaler is not None:
                scaler.unscale_(self.optimizer)  # clip the true gradients
            self.strategy.clip(self.opts.grad_clip_norm)
        if scaler is not None:
            scaler.step(self.optimizer)  # skipped on every rank alike when a gradient overflowed
            scaler.update()
        else:
            self.optimizer.step()
        if self._peak_tracker is not None:
            self._peak_tracker.stop()
            self.peak_memory_bytes = self._largest_peak(self._peak_tracker.result())
            self._peak_tracker = None
        if self.scheduler is not None:
            self.scheduler.step()
        if self.model_state_bytes is None:  # the first step: everything a step keeps is there, gradients too
            self.model_state_bytes = self._largest_model_state()
        self.optimizer.zero_grad(set_to_none=True)

    def _largest_model_state(self) -> dict[str, int]:
        """The model state of the rank that holds the most (what a memory budget must cover), measured."""
        mine = self.strategy.model_state_bytes()
        values = torch.tensor([sum(mine.values()), *mine.values()], dtype=torch.int64, device=self.device)
        if self.world_size > 1:
            everyone = [torch.zeros_like(values) for _ in range(self.world_size)]
            dist.all_gather(everyone, values)
            values = max(everyone, key=lambda v: int(v[0]))
        return dict(zip(("total", *mine), (int(v) for v in values.tolist()), strict=True))

    def _largest_peak(self, memory: StepMemory) -> dict[str, int]:
        """The step's peak on the rank with the highest (``"total"``, ``"rank"``) and that rank's state + buffers
        after it (``"state"``)."""
        values = torch.tensor([memory.peak, memory.state_total, self.rank], dtype=torch.int64, device=self.device)
        if self.world_size > 1:
            everyone = [torch.zeros_like(values) for _ in range(self.world_size)]
            dist.all_gather(everyone, values)
            values = max(everyone, key=lambda v: int(v[0]))
        return dict(zip(("total", "state", "rank"), (int(v) for v in values.tolist()), strict=True))

    def _start_epoch(self) -> None:
        loader = self.train_loader
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(self.epoch)
        if self.batch_in_epoch and self.loader_state is not None and hasattr(loader, "load_state_dict"):
            loader.load_state_dict(self.loader_state)
            self.skip = 0
        else:
            self.skip = self.batch_in_epoch  # a loader without state: skip the batches already trained on
        self.loader_state = None

    def train(self) -> dict[str, Any] | None:
        opts, accum = self.opts, self.opts.grad_accum_steps
        self.started = time.perf_counter()
        stop = False
        if self.is_main:
            start = {
                "epoch": self.epoch,
                "iteration": self.step,
                "elapsed": self.elapsed(),
                "lr": float(self.optimizer.param_groups[0]["lr"]),
            }
            stop = self._call_output_fns(start, "start")
        stop = self._share_stop(stop)
        self.optimizer.zero_grad(set_to_none=True)
        while not stop and self.epoch < opts.max_epochs:
            self._start_epoch()
            for batch in self.train_loader:
                if self.skip:
                    self.skip -= 1
                    continue
                group_start = self.batch_in_epoch - self.batch_in_epoch % accum
                group_size = min(accum, self.batches - group_start)
                self.batch_in_epoch += 1
                last_micro = self.batch_in_epoch == group_start + group_size
                batch = self._batch(batch)
                if opts.measure_peak_memory and self.peak_memory_bytes is None and self._peak_tracker is None:
                    from ..shard.peak_memory import PeakTracker

                    self._peak_tracker = PeakTracker(self.strategy.model, self.optimizer, self.device)
                    self._peak_tracker.start()  # from the first micro-batch to the end of the optimizer step
                with self.strategy.no_sync(last_micro):
                    result = self.strategy.forward_backward(batch, 1 / group_size, self.autocast)
                with torch.no_grad():
                    if self.is_classifier is None:
                        self.is_classifier = _classification(result.outputs, result.targets)
                    self._fix_metric_names(result)
                    self._add(self.window, result)
                if not last_micro:
                    continue
                self._optimizer_step()
                self.step += 1
                stop = self._after_step(epoch_end=self.batch_in_epoch == self.batches)
                if stop or self.batch_in_epoch == self.batches:
                    break  # a loader longer than its len() must not run past the epoch
            if not stop:
                self.epoch, self.batch_in_epoch = self.epoch + 1, 0
        if self.ckpt_dir is not None and self.step > self.saved_step:  # stopped or ended between checkpoints
            self._save_checkpoint()
        return self._finish()

    def _after_step(self, epoch_end: bool) -> bool:
        opts = self.opts
        seconds = time.perf_counter() - self.window_start
        validate = self.val_loader is not None and (
            (opts.validation_every and self.step % opts.validation_every == 0)
            or (not opts.validation_every and epoch_end)
        )
        validation = self._validate() if validate else None
        stop = False
        if validation or epoch_end or self.step % opts.log_every == 0:
            stop = self._log(validation, seconds)
        elif opts.output_fns:  # output functions see every iteration, as MATLAB's do
            stop = self._step_output_fns()
        if self.ckpt_dir is not None and (
            (opts.checkpoint_every and self.step % opts.checkpoint_every == 0)
            or (not opts.checkpoint_every and epoch_end)
        ):
            self._save_checkpoint()
        return stop

    def _finish(self) -> dict[str, Any] | None:
        if self._peak_tracker is not None:  # stopped before the first optimizer step: no peak to report
            self._peak_tracker.stop()
            self._peak_tracker = None
        state = self.strategy.full_model_state()  # collective for sharded models: before rank 0 goes its own way
        if not self.is_main:
            return None
        if self.bar is not None:
            self.bar.close()
        records = self.metrics.records
        last = records[-1] if records else {"epoch": self.epoch, "iteration": self.step, "elapsed": self.elapsed()}
        self._call_output_fns(dict(last), "done")
        self._refresh_plot(final=True)
        self.metrics.close()
        for logger in self.loggers:
            logger.close()
        return {
            "model_state": state,
            "history": records,
            "stopped_early": self.step < self.total_steps,
            "steps": self.step,
            "start_step": self.start_step,
            "start_elapsed": self.elapsed_before,
            "metrics_path": str(self.metrics.path),
            "logger_paths": {name: str(lg.path) for name, lg in zip(self.opts.loggers, self.loggers, strict=True)},
            "plot_path": str(self.plot_path) if self.plot_path and self.plot_path.exists() else None,
            "checkpoints": self.checkpoints,
            "elapsed": self.elapsed(),
            "sharding": self.strategy.name,
            "model_state_bytes": self.model_state_bytes,
            "peak_memory_bytes": self.peak_memory_bytes,
        }


def _params(opts: Any) -> dict[str, Any]:
    """The options a logger records as the run's parameters: the plain values (not data, callables or models)."""
    import dataclasses

    plain = (bool, int, float, str, type(None), torch.dtype)
    return {
        f.name: getattr(opts, f.name)
        for f in dataclasses.fields(opts)
        if isinstance(getattr(opts, f.name), plain) or f.name == "loggers"
    }
