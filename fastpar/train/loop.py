"""The per-rank training loop. Every process runs ``run_worker(job)``; rank 0 also logs, plots,
calls the output functions and writes checkpoints.

One step: ``grad_accum_steps`` batches forward/backward (gradient sync only on the last one), clip,
optimizer step, scheduler step. Loss and accuracy are summed on the device and reduced across ranks
only on logged steps, so an ordinary step has no CPU-GPU sync and no extra collective.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from . import checkpoint as ckpt
from .data import batches_per_epoch, make_loader
from .job import Job, build_model, build_optimizer, wrap_ddp
from .plot import write_progress_plot
from .progress import MetricsLog, ProgressBar

_PLOT_REFRESH_S = 10.0  # redraw the progress PNG at most this often (a redraw costs ~0.2 s on rank 0)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _classification(out: torch.Tensor, y: Any) -> bool:
    return torch.is_tensor(y) and out.ndim == 2 and y.ndim == 1 and not y.is_floating_point()


class _Run:
    def __init__(self, job: Job, rank: int, world_size: int, device: torch.device) -> None:
        self.job, self.opts = job, job.options
        self.rank, self.world_size, self.device = rank, world_size, device
        self.is_main = rank == 0
        opts = self.opts

        _seed_everything(opts.seed)  # identical initial weights on every rank
        self.model = build_model(job.model).to(device)
        self.optimizer = build_optimizer(job.optimizer, self.model)
        self.scheduler = opts.lr_scheduler(self.optimizer) if opts.lr_scheduler else None
        self.ddp_model = wrap_ddp(self.model, opts, job.plan, device) if world_size > 1 else self.model
        _seed_everything(opts.seed + 1000 * rank)  # distinct dropout/augmentation streams per rank

        threads = opts.data_threads if opts.data_threads is not None else (None if device.type == "cuda" else 0)
        loader_args = dict(batch_size=opts.batch_size, rank=rank, world_size=world_size, seed=opts.seed,
                           image_size=opts.image_size, threads=threads, device=device)  # fmt: skip
        self.train_loader = make_loader(job.train_data, train=True, **loader_args)
        self.val_loader = (
            make_loader(opts.validation_data, train=False, **loader_args) if opts.validation_data is not None else None
        )
        self.batches = batches_per_epoch(self.train_loader)
        accum = opts.grad_accum_steps
        self.steps_per_epoch = -(-self.batches // accum)
        self.total_steps = self.steps_per_epoch * opts.max_epochs

        self.autocast = contextlib.nullcontext
        if opts.mixed_precision and (device.type == "cpu" or torch.cuda.is_bf16_supported()):
            self.autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16)

        self.step, self.epoch, self.batch_in_epoch, self.elapsed_before = 0, 0, 0, 0.0
        self.started, self.loader_state, self.skip = time.perf_counter(), None, 0
        self.saved_step = 0
        self.ckpt_dir = Path(opts.checkpoint_dir) if opts.checkpoint_dir else None
        self.checkpoints: list[str] = []
        resumed = self._maybe_resume()

        self.output_dir = Path(opts.output_dir)
        if self.is_main:
            self.metrics = MetricsLog(self.output_dir / "metrics.jsonl", self.step if resumed else None)
            self.bar = ProgressBar(self.total_steps, opts.max_epochs) if opts.progress_bar else None
            self.plot_path = self.output_dir / "training-progress.png" if opts.plots == "training-progress" else None
            self._plotted_at = 0.0
        self._reset_window()

    # --- resume and checkpoints -------------------------------------------------------------------
    def _maybe_resume(self) -> bool:
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        if self.ckpt_dir is None or not (self.opts.resume or restarted):
            return False
        report = print if self.is_main else (lambda _msg: None)
        state, path = ckpt.load_newest_valid(self.ckpt_dir, report=report)
        if state is None:
            report(f"fastpar: no valid checkpoint in {self.ckpt_dir}; starting from scratch")
            return False
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.epoch = state["step"], state["epoch"]
        self.saved_step = self.step
        self.elapsed_before = state.get("elapsed", 0.0)
        ranks = state["ranks"]
        mine = ranks[self.rank] if len(ranks) == self.world_size else None  # same world size: exact continuation
        if mine is not None:
            ckpt.set_rng_state(mine["rng"])
            self.batch_in_epoch = mine["batch_in_epoch"]
            self.loader_state = mine.get("loader")
        else:
            report(f"fastpar: checkpoint was written by {len(ranks)} processes, resuming on {self.world_size}: "
                   "the data order restarts at the beginning of its epoch")  # fmt: skip
            self.batch_in_epoch, self.loader_state = 0, None
        if self.batch_in_epoch >= self.batches:  # written at the end of an epoch
            self.epoch, self.batch_in_epoch, self.loader_state = self.epoch + 1, 0, None
        report(f"fastpar: resumed from {path} (step {self.step}, epoch {self.epoch + 1})")
        return True

    def _save_checkpoint(self) -> None:
        loader_state = self.train_loader.state_dict() if hasattr(self.train_loader, "state_dict") else None
        mine = {"rng": ckpt.rng_state(), "batch_in_epoch": self.batch_in_epoch, "loader": loader_state}
        self.saved_step = self.step  # on every rank: they all decide alike whether a final save is due
        ranks = [None] * self.world_size
        if self.world_size > 1:
            dist.gather_object(mine, ranks if self.is_main else None, dst=0)
        else:
            ranks = [mine]
        if not self.is_main:
            return
        state = {
            "format": ckpt.FORMAT,
            "step": self.step,
            "epoch": self.epoch,
            "elapsed": self.elapsed(),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "ranks": ranks,
        }
        ckpt.save_atomic(state, ckpt.checkpoint_path(self.ckpt_dir, self.step))
        ckpt.prune(self.ckpt_dir, self.opts.keep_checkpoints)
        self.checkpoints = [str(p) for p in ckpt.list_checkpoints(self.ckpt_dir)]

    # --- metrics ----------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.started

    def _reset_window(self) -> None:
        self.window = torch.zeros(3, dtype=torch.float64, device=self.device)  # loss sum, correct, samples
        self.window_start = time.perf_counter()
        self.is_classifier = None

    def _reduce(self, values: torch.Tensor) -> list[float]:
        if self.world_size > 1:
            dist.all_reduce(values)
        return values.tolist()  # CPU-GPU sync point (logged steps only)

    def _validate(self) -> dict[str, float]:
        self.model.eval()
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)
        classifier = False
        if hasattr(self.val_loader, "set_epoch"):
            self.val_loader.set_epoch(0)
        with torch.no_grad(), self.autocast():
            for x, y in self.val_loader:
                x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
                out = self.model(x)  # the bare module: no DDP hooks or buffer broadcasts in evaluation
                totals[0] += self.job.loss_fn(out, y).double() * len(y)
                if _classification(out, y):
                    classifier = True
                    totals[1] += (out.argmax(1) == y).sum()
                totals[2] += len(y)
        self.model.train()
        loss_sum, correct, count = self._reduce(totals)
        result = {"val_loss": loss_sum / max(count, 1)}
        if classifier:
            result["val_accuracy"] = correct / max(count, 1)
        return result

    def _log(self, validation: dict[str, float] | None) -> bool:
        """Reduce the window's metrics, record them on rank 0, call output functions; True: stop (all ranks)."""
        loss_sum, correct, count = self._reduce(self.window)
        seconds = time.perf_counter() - self.window_start
        stop = False
        if self.is_main:
            record = {
                "epoch": self.epoch,
                "iteration": self.step,
                "loss": loss_sum / max(count, 1),
                "accuracy": correct / count if self.is_classifier and count else None,
                "lr": self.optimizer.param_groups[0]["lr"],
                "elapsed": self.elapsed(),
                "samples_per_s": count / max(seconds, 1e-9),
                **(validation or {}),
            }
            self.metrics.append(record)
            if self.bar is not None:
                self.bar.update(record)
            self._refresh_plot(final=False)
            stop = self._call_output_fns(record, "iteration")
        self._reset_window()
        return self._share_stop(stop)

    def _call_output_fns(self, record: dict[str, Any], state: str) -> bool:
        info = {"state": state, "max_epochs": self.opts.max_epochs, "total_steps": self.total_steps, **record}
        return any([fn(dict(info)) is True for fn in self.opts.output_fns])  # call every fn, even after a True

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
        if self.opts.grad_clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.opts.grad_clip_norm)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

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
            start = {"epoch": self.epoch, "iteration": self.step, "elapsed": self.elapsed(), "loss": None,
                     "lr": self.optimizer.param_groups[0]["lr"]}  # fmt: skip
            stop = self._call_output_fns(start, "start")
        stop = self._share_stop(stop)
        self.optimizer.zero_grad(set_to_none=True)
        while not stop and self.epoch < opts.max_epochs:
            self._start_epoch()
            for x, y in self.train_loader:
                if self.skip:
                    self.skip -= 1
                    continue
                group_start = self.batch_in_epoch - self.batch_in_epoch % accum
                group_size = min(accum, self.batches - group_start)
                self.batch_in_epoch += 1
                last_micro = self.batch_in_epoch == group_start + group_size
                x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
                sync = contextlib.nullcontext() if last_micro or self.world_size == 1 else self.ddp_model.no_sync()
                with sync:
                    with self.autocast():
                        out = self.ddp_model(x)
                        loss = self.job.loss_fn(out, y)
                    (loss / group_size).backward()
                with torch.no_grad():
                    if self.is_classifier is None:
                        self.is_classifier = _classification(out, y)
                    self.window[0] += loss.detach().double() * len(y)
                    if self.is_classifier:
                        self.window[1] += (out.argmax(1) == y).sum()
                    self.window[2] += len(y)
                if not last_micro:
                    continue
                self._optimizer_step()
                self.step += 1
                stop = self._after_step(epoch_end=self.batch_in_epoch == self.batches)
                if stop:
                    break
            if not stop:
                self.epoch, self.batch_in_epoch = self.epoch + 1, 0
        if self.ckpt_dir is not None and self.step > self.saved_step:  # stopped or ended between checkpoints
            self._save_checkpoint()
        return self._finish()

    def _after_step(self, epoch_end: bool) -> bool:
        opts = self.opts
        validate = self.val_loader is not None and (
            (opts.validation_every and self.step % opts.validation_every == 0)
            or (not opts.validation_every and epoch_end)
        )
        validation = self._validate() if validate else None
        stop = False
        if validation or epoch_end or self.step % opts.log_every == 0:
            stop = self._log(validation)
        if self.ckpt_dir is not None and (
            (opts.checkpoint_every and self.step % opts.checkpoint_every == 0)
            or (not opts.checkpoint_every and epoch_end)
        ):
            self._save_checkpoint()
        return stop

    def _finish(self) -> dict[str, Any] | None:
        if not self.is_main:
            return None
        if self.bar is not None:
            self.bar.close()
        records = self.metrics.records
        last = records[-1] if records else {"epoch": self.epoch, "iteration": self.step, "elapsed": self.elapsed()}
        self._call_output_fns(dict(last), "done")
        self._refresh_plot(final=True)
        self.metrics.close()
        state = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        return {
            "model_state": state,
            "history": records,
            "stopped_early": self.step < self.total_steps,
            "steps": self.step,
            "metrics_path": str(self.metrics.path),
            "plot_path": str(self.plot_path) if self.plot_path and self.plot_path.exists() else None,
            "checkpoints": self.checkpoints,
            "elapsed": self.elapsed(),
        }


def _init_process_group(backend: str, rank: int, world_size: int, device: torch.device,
                        timeout: datetime.timedelta) -> None:  # fmt: skip
    device_id = device if device.type == "cuda" else None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout, device_id=device_id)
        return
    # The elastic agent keeps one TCPStore for all restart rounds and workers connect without a prefix, so
    # a restarted group could read the dead workers' addresses (gloo: "connectFullMesh failed ...
    # Connection refused"). A per-round prefix keeps every round's keys apart.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                                is_master=False, timeout=timeout)  # fmt: skip
    store = dist.PrefixStore(f"fastpar/attempt_{attempt}", agent_store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                            device_id=device_id)  # fmt: skip


def run_worker(job: Job) -> dict[str, Any] | None:
    """Train on this process's rank (from torchrun's environment; rank 0 of 1 when there is none)."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    plan = job.plan
    if plan.device_type == "cuda":
        device = torch.device("cuda", plan.device_ids[local_rank] if plan.device_ids else local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if plan.nprocs > 1:  # launched here: keep torch threads to this process's share of the cores
        torch.set_num_threads(plan.threads_per_process)
    own_group = world_size > 1 and not dist.is_initialized()
    if own_group:
        if plan.nprocs:  # a local launch: keep gloo on loopback
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        _init_process_group(plan.backend or ("nccl" if device.type == "cuda" else "gloo"), rank, world_size, device,
                            datetime.timedelta(seconds=job.collective_timeout_s))  # fmt: skip
    try:
        return _Run(job, rank, world_size, device).train()
    finally:
        if own_group and dist.is_initialized():
            dist.destroy_process_group()
