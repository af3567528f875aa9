"""Exact resume: what a checkpoint holds beyond the weights, and how a run picks up from it.

With replicated state (DDP, one process) rank 0 writes one file per checkpoint: model, optimizer and
scheduler state, plus every rank's RNG states and data position (gathered from all ranks). Sharded
strategies (ZeRO-1/2, FSDP2, pipeline) write a DCP folder instead (fastpar/shard/checkpoint.py): every
rank its pieces of model and optimizer, rank 0 the same record of schedule, RNGs and data positions. A
run with the same number of processes continues with exactly the batches and random numbers the
uninterrupted run would have used; a sharded checkpoint also loads at another number of processes.

Resuming with a different ``max_epochs`` changes the run's length: a finished run can be extended
(or a stopped one shortened). The learning-rate schedule then follows the new length: the scheduler
your factory builds for this run (e.g. a one-cycle over the new total steps) continues from the
checkpoint's step, as if the run had been planned that long from the start. Only the scheduler's
position (``last_epoch``, step count, last LRs) comes from the checkpoint; a scheduler without those
keys is restored as saved. A checkpoint that already reaches ``max_epochs`` leaves nothing to train.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..shard import checkpoint as sharded
from . import checkpoint as ckpt


@dataclasses.dataclass
class Position:
    """Where a resumed run continues: the next step to take and this rank's place in the data."""

    step: int
    epoch: int
    batch_in_epoch: int  # batches of ``epoch`` already trained on (by this rank)
    elapsed: float  # seconds trained before the checkpoint
    loader_state: dict[str, Any] | None
    path: Path


# The keys of a torch LR scheduler's state that say where it is, not what it was configured as.
_SCHEDULE_POSITION = ("last_epoch", "_step_count", "_last_lr")


def save(
    directory: Path,
    keep: int,
    *,
    step: int,
    epoch: int,
    batch_in_epoch: int,
    batches_per_epoch: int,
    elapsed: float,
    total_steps: int,
    strategy: Any,
    scheduler: Any,
    train_loader: Any,
    rank: int,
    world_size: int,
    mode: int = 0o600,
    grad_scaler: Any = None,
) -> list[str] | None:
    """Collective: every rank calls it. Returns the kept paths on rank 0, None on the others. ``mode``: the
    checkpoint's files' (``TrainingOptions.checkpoint_mode``)."""
    loader_state = train_loader.state_dict() if hasattr(train_loader, "state_dict") else None
    mine = {"rng": ckpt.rng_state(), "batch_in_epoch": batch_in_epoch, "loader": loader_state}
    ranks: list[Any] = [mine]
    if world_size > 1:
        ranks = [None] * world_size
        dist.gather_object(mine, ranks if rank == 0 else None, dst=0)
    record = {
        "step": step,
        "epoch": epoch,
        "elapsed": elapsed,
        "total_steps": total_steps,  # the run's planned length: a resume with another length re-plans the schedule
        "batches_per_epoch": batches_per_epoch,  # whether the epoch was complete, for a resume at another world size
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "grad_scaler": grad_scaler.state_dict() if grad_scaler is not None else None,  # alike on every rank
        "ranks": ranks,
    }
    if strategy.sharded_checkpoints:
        state = strategy.checkpoint_state()  # every rank: its own pieces
        record.update(format=sharded.SHARDED_FORMAT, sharding=strategy.name, world_size=world_size)
        return sharded.save_sharded(state, directory, step, record if rank == 0 else None, keep, mode=mode)
    if rank != 0:
        return None
    record.update(format=ckpt.FORMAT, model=strategy.model.state_dict(), optimizer=strategy.optimizer.state_dict())
    ckpt.save_atomic(record, ckpt.checkpoint_path(directory, step), mode)
    ckpt.prune(directory, keep)
    return [str(p) for p in ckpt.list_checkpoints(directory)]


def restore(
    directory: Path,
    *,
    strategy: Any,
    scheduler: Any,
    rank: int,
    world_size: int,
    batches_per_epoch: int,
    total_steps: int,
    max_epochs: int,
    report: Callable[[str], None],
    grad_scaler: Any = None,
) -> Position | None:
    """Load the newest valid checkpoint into the strategy's model/optimizer, the scheduler and this rank's RNGs;
    None if there is none. A checkpoint of another model is refused (IncompatibleCheckpointError)."""
    state, path = ckpt.load_newest_valid(directory, report=report)
    if state is None:
        report(f"fastpar: no valid checkpoint in {directory}; starting from scratch")
        return None
    _load_weights(strategy, state, path)
    planned = state.get("total_steps", total_steps)  # checkpoints from before fastpar saved it: assume unchanged
    if scheduler is not None and state.get("scheduler") is not None:
        saved = state["scheduler"]
        scheduler.load_state_dict(saved if planned == total_steps else _repositioned(scheduler.state_dict(), saved))
    if grad_scaler is not None and state.get("grad_scaler"):  # fp16: the loss scale and its growth count
        grad_scaler.load_state_dict(state["grad_scaler"])
    ranks = state["ranks"]
    epoch, batch_in_epoch, loader_state = state["epoch"], 0, None
    if len(ranks) == world_size:  # same world size: exact continuation
        mine = ranks[rank]
        ckpt.set_rng_state(mine["rng"])
        batch_in_epoch, loader_state = mine["batch_in_epoch"], mine.get("loader")
    elif ranks[0]["batch_in_epoch"] >= state.get("batches_per_epoch", float("inf")):
        epoch += 1  # written at the end of an epoch: the next one starts, at this world size's cut of the data
    else:
        report(
            f"fastpar: checkpoint was written by {len(ranks)} processes, resuming on {world_size}: "
            "the data order restarts at the beginning of its epoch"
        )
    if batch_in_epoch >= batches_per_epoch:  # written at the end of an epoch
        epoch, batch_in_epoch, loader_state = epoch + 1, 0, None
    step = state["step"]
    where = (
        f"{epoch} of {max_epochs} epochs done"
        if batch_in_epoch == 0
        else f"in epoch {epoch + 1} of {max_epochs}, {batch_in_epoch} of {batches_per_epoch} batches done"
    )
    if epoch >= max_epochs:
        message = (
            f"nothing to do: the newest checkpoint, {path}, is at step {step} and already completes "
            f"max_epochs={max_epochs} epoch(s); pass a larger max_epochs to train further"
        )
    elif planned != total_steps:
        message = (
            f"resuming from {path} at step {step} ({where}); the run was planned for {planned} steps, now "
            f"{total_steps}: the learning-rate schedule for {total_steps} steps continues from step {step}"
        )
    else:
        message = f"resuming from {path} at step {step} of {total_steps} ({where})"
    report(f"fastpar: {message}")
    return Position(step, epoch, batch_in_epoch, state.get("elapsed", 0.0), loader_state, path)


def _repositioned(fresh: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
    """``fresh`` (the scheduler built for this run's length) moved to ``saved``'s position; sub-schedulers
    (SequentialLR, ChainedScheduler) alike. A scheduler without a known position is restored as saved."""
    if not any(key in saved for key in _SCHEDULE_POSITION):
        return saved
    merged = {**fresh, **{key: saved[key] for key in _SCHEDULE_POSITION if key in saved}}
    inner_fresh, inner_saved = fresh.get("_schedulers"), saved.get("_schedulers")
    if isinstance(inner_fresh, list) and isinstance(inner_saved, list) and len(inner_fresh) == len(inner_saved):
        merged["_schedulers"] = [_repositioned(f, s) for f, s in zip(inner_fresh, inner_saved, strict=True)]
    return merged


# Strategies whose checkpoint folders hold the same entries: ZeRO-1 and ZeRO-2 both keep flat optimizer slices.
_SAME_LAYOUT = {"zero1": "zero", "zero2": "zero"}


def _load_weights(strategy: Any, state: dict[str, Any], path: Path) -> None:
    expected = strategy.model_shapes()  # collective for pipeline stages: the whole model's names
    if sharded.is_sharded_checkpoint(path):
        saved_by, mine = state.get("sharding"), strategy.name
        if _SAME_LAYOUT.get(saved_by, saved_by) != _SAME_LAYOUT.get(mine, mine) or not strategy.sharded_checkpoints:
            raise sharded.IncompatibleCheckpointError(
                f"the checkpoint {path} was written with sharding={saved_by!r}, this run uses sharding={mine!r}; "
                f"resume with sharding={saved_by!r}, or start from its weights: "
                "fastpar.shard.checkpoint.export_consolidated(...) and load them into the model you pass"
            )
        sharded.check_compatible(expected, sharded.model_shapes_in(path), str(path))
        strategy.load_checkpoint(path)
        return
    sharded.check_compatible(expected, {k: v.shape for k, v in state["model"].items()}, str(path))
    strategy.load_full(state["model"], state["optimizer"])


def single_file_state(folder: str | Path) -> dict[str, Any]:
    """A sharded checkpoint folder as a single-file checkpoint (what ``sharding="ddp"`` writes: model and
    optimizer state whole, the optimizer's keyed by position), for ``checkpoint.save_atomic``. Loads the
    whole state into this one process."""
    folder = Path(folder)
    record = sharded.read_trainer_record(folder)
    whole = sharded.consolidated_state(folder)
    model, optim = whole["model"], whole["optim"]
    if "param_groups" not in optim:  # hyperparameters per parameter: consecutive equal ones make a group
        groups: list[dict[str, Any]] = []
        for name in (n for n in model if n in optim["groups_of"]):
            hyper = optim["groups_of"][name]
            if groups and {k: v for k, v in groups[-1].items() if k != "params"} == hyper:
                groups[-1]["params"].append(name)
            else:
                groups.append({**hyper, "params": [name]})
        optim["param_groups"] = groups
    position = {name: i for i, name in enumerate(n for g in optim["param_groups"] for n in g["params"])}
    state = {}
    for name, entry in optim["state"].items():
        shape = model[name].shape
        state[position[name]] = {
            # ZeRO keeps elementwise state flat (in the parameter's memory order): back to the parameter's shape
            k: v.view(shape) if torch.is_tensor(v) and v.dim() == 1 and v.numel() == model[name].numel() else v
            for k, v in entry.items()
        }
    groups = [{**g, "params": [position[n] for n in g["params"]]} for g in optim["param_groups"]]
    single = {k: v for k, v in record.items() if k not in ("sharding", "world_size")}
    single.update(
        format=ckpt.FORMAT, model=dict(model), optimizer={"state": dict(sorted(state.items())), "param_groups": groups}
    )
    return single
