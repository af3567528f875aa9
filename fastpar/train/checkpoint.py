"""Checkpoints: written atomically, the last K kept, resumed from the newest valid one.

Replicated training (DDP, one process) writes single files, rank 0 alone (below). Sharded strategies write
folders ``ckpt-<step>/`` through ``torch.distributed.checkpoint`` (fastpar/shard/checkpoint.py); both kinds
are listed, pruned and resumed from here.

A checkpoint is a plain dict of tensors and Python scalars (model, optimizer, scheduler, every rank's
RNG states and data position), so it loads with ``torch.load(weights_only=True)``. Writing goes to a
new temporary file (a random name, created exclusively: never through a symlink someone left) that is
fsync'ed and renamed over the final name: a crash leaves either the old set or the new file, never a
half-written ``ckpt-*.pt``. Checkpoints are private to their user (0600) unless
``TrainingOptions.checkpoint_mode`` shares them.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..safe_files import (
    FolderOwnedByAnotherUserError,
    atomic_file,
    create_exclusive,
    make_folder,
    refuse_foreign_folder,
)

_NAME = re.compile(r"^ckpt-(\d{9})(\.pt)?$")
REQUIRED_KEYS = ("format", "step", "epoch", "model", "optimizer", "ranks")
FORMAT = 1


def checkpoint_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"ckpt-{step:09d}.pt"


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Checkpoints in ``directory`` (files ``ckpt-<step>.pt`` and folders ``ckpt-<step>``), oldest step first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in directory.iterdir()
        if (m := _NAME.match(p.name)) and (p.is_dir() != bool(m.group(2)))
    ]
    return [p for _, p in sorted(found)]


def save_atomic(state: dict[str, Any], path: Path, mode: int = 0o600) -> Path:
    """Write ``state`` to ``path`` so that ``path`` is either absent or complete, even after a crash. The file
    gets ``mode`` (0600: only this user reads it); its temporary name is new and random, never a link's."""
    with atomic_file(path, mode) as fh:
        torch.save(state, fh)
    return path


def prune(directory: str | Path, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints, and temp files crashed writers left behind."""
    for old in list_checkpoints(directory)[:-keep]:
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() and not old.is_symlink() else old.unlink(missing_ok=True)


def remove_stale_temp_files(directory: str | Path) -> None:
    for tmp in Path(directory).glob(".ckpt-*.pt.tmp-*"):
        tmp.unlink(missing_ok=True)
    for tmp in Path(directory).glob(".ckpt-*.tmp"):  # a sharded checkpoint's folder, never renamed
        if tmp.is_symlink():  # not ours (fastpar makes folders there): remove the link, not what it points at
            tmp.unlink(missing_ok=True)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def load_newest_valid(directory: str | Path, report=print) -> tuple[dict[str, Any] | None, Path | None]:
    """The newest checkpoint that loads and has every required key; unreadable ones are reported and skipped,
    a folder holding what fastpar never writes (UntrustedCheckpointError) stops the run."""
    from ..shard.checkpoint_reader import UntrustedCheckpointError

    for path in reversed(list_checkpoints(directory)):
        try:
            if path.is_dir():  # sharded: the record here, the weights loaded by the strategy from the folder
                from ..shard.checkpoint import SHARDED_FORMAT, read_metadata, read_trainer_record

                state = read_trainer_record(path)
                read_metadata(path)  # every rank, before any collective: a planted folder stops them all here
                if state.get("format") != SHARDED_FORMAT:
                    raise ValueError(f"format {state.get('format')} (this fastpar reads format {SHARDED_FORMAT})")
                return state, path
            state = torch.load(path, map_location="cpu", weights_only=True)
            missing = [k for k in REQUIRED_KEYS if k not in state]
            if missing:
                raise ValueError(f"missing keys {missing}")
            if state["format"] != FORMAT:
                raise ValueError(f"format {state['format']} (this fastpar reads format {FORMAT})")
        except UntrustedCheckpointError:  # not damage but a planted file: stop, don't quietly resume from another
            raise
        except Exception as exc:  # truncated zip, bad pickle, wrong content: skip to an older one
            report(f"fastpar: skipping checkpoint {path}: it is unreadable or incomplete ({type(exc).__name__}: {exc})")
            continue
        return state, path
    return None, None


def restarted_by_torchrun() -> bool:
    """True in a worker group torchrun (or the trainer's elastic launch) restarted after a failure: resume. On
    several nodes every node's workers say so, also those of nodes that did not fail (fastpar.rendezvous)."""
    from ..rendezvous import restart_round

    return restart_round() > 0


def rng_state() -> dict[str, Any]:
    """This process's random number generator states, as weights_only-loadable values."""
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def check_writable(directory: str | Path, what: str, mode: int | None = None) -> Path:
    """Create ``directory`` (a folder created here gets ``mode``; None: the umask's default) and prove a file
    can be written there; raise PermissionError saying which option. A folder that belongs to another user
    is refused (FolderOwnedByAnotherUserError): its owner could swap what fastpar writes there."""
    directory = Path(directory)
    described = f"TrainingOptions.{what}={str(directory)!r}" if what.isidentifier() else f"{what} {directory}"
    try:
        make_folder(directory, mode)
        refuse_foreign_folder(directory, described)
        fd, probe = create_exclusive(directory, ".fastpar-write-test-")  # a new name: never through a link
        os.close(fd)
        probe.unlink()
    except FolderOwnedByAnotherUserError:
        raise
    except OSError as exc:
        raise PermissionError(
            f"{described} is not a writable folder ({exc.strerror or exc}); choose a folder this user can write to"
        ) from exc
    return directory


__all__ = [
    "check_writable",
    "checkpoint_path",
    "list_checkpoints",
    "load_newest_valid",
    "prune",
    "remove_stale_temp_files",
    "restarted_by_torchrun",
    "rng_state",
    "save_atomic",
    "set_rng_state",
]
