"""Exact resume: what a checkpoint holds beyond the weights, and how a run picks up from it.

Rank 0 writes one file per checkpoint: model, optimizer and scheduler state, plus every rank's RNG
states and data position (gathered from all ranks), so a run with the same number of processes
continues with exactly the batches and random numbers the uninterrupted run would have used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

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


def save(directory: Path, keep: int, *, step: int, epoch: int, batch_in_epoch: int, elapsed: float,
         model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, train_loader: Any,
         rank: int, world_size: int) -> list[str] | None:  # fmt: skip
    """Collective: every rank calls it. Rank 0 writes the checkpoint and returns the kept paths, others None."""
    loader_state = train_loader.state_dict() if hasattr(train_loader, "state_dict") else None
    mine = {"rng": ckpt.rng_state(), "batch_in_epoch": batch_in_epoch, "loader": loader_state}
    ranks: list[Any] = [mine]
    if world_size > 1:
        ranks = [None] * world_size
        dist.gather_object(mine, ranks if rank == 0 else None, dst=0)
    if rank != 0:
        return None
    state = {
        "format": ckpt.FORMAT,
        "step": step,
        "epoch": epoch,
        "elapsed": elapsed,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "ranks": ranks,
    }
    ckpt.save_atomic(state, ckpt.checkpoint_path(directory, step))
    ckpt.prune(directory, keep)
    return [str(p) for p in ckpt.list_checkpoints(directory)]


def restore(directory: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
            rank: int, world_size: int, batches_per_epoch: int,
            report: Callable[[str], None]) -> Position | None:  # fmt: skip
    """Load the newest valid checkpoint into model/optimizer/scheduler and this rank's RNGs; None if none."""
    state, path = ckpt.load_newest_valid(directory, report=report)
    if state is None:
        report(f"fastpar: no valid checkpoint in {directory}; starting from scratch")
        return None
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    ranks = state["ranks"]
    epoch, batch_in_epoch, loader_state = state["epoch"], 0, None
    if len(ranks) == world_size:  # same world size: exact continuation
        mine = ranks[rank]
        ckpt.set_rng_state(mine["rng"])
        batch_in_epoch, loader_state = mine["batch_in_epoch"], mine.get("loader")
    else:
        report(f"fastpar: checkpoint was written by {len(ranks)} processes, resuming on {world_size}: "
               "the data order restarts at the beginning of its epoch")  # fmt: skip
    if batch_in_epoch >= batches_per_epoch:  # written at the end of an epoch
        epoch, batch_in_epoch, loader_state = epoch + 1, 0, None
    report(f"fastpar: resumed from {path} (step {state['step']}, epoch {epoch + 1})")
    return Position(state["step"], epoch, batch_in_epoch, state.get("elapsed", 0.0), loader_state, path)
