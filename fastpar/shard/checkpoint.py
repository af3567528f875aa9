"""Checkpoints of sharded training state through ``torch.distributed.checkpoint`` (DCP): written by every
rank at once, each its own pieces, and readable by any number of ranks with any sharding of the same model.

A checkpoint is a folder ``ckpt-<step>/``: DCP's files (``.metadata`` + one ``.distcp`` per rank) and
``trainer.pt`` (rank 0's small record: step, schedule, every rank's RNG and data position). Every rank writes
into a hidden temporary folder (a fresh name rank 0 makes and shares); after a barrier rank 0 adds
``trainer.pt``, gives every file the checkpoint's mode (0600 unless asked otherwise), fsyncs and renames the
folder, so a crash leaves either the old set of checkpoints or the complete new one.

Reading goes through :class:`~fastpar.shard.checkpoint_reader.CheckpointReader`: a folder's ``.metadata`` and
its non-tensor entries are loaded as plain data, never as code (a planted folder raises
:class:`UntrustedCheckpointError`).

What goes in is a nested dict of tensors whose *global* shape and offsets are known: FSDP2's DTensors, plain
(replicated) tensors, which DCP writes once, and -- for state sharded by hand, like ZeRO's flat bucket
slices -- :func:`flat_pieces`, a ShardedTensor built from each rank's piece of a flattened tensor and where
it sits. Loading asks for whatever pieces this rank holds *now*, so a checkpoint written at N ranks loads at M.
Keys are the model's own parameter names (FQNs), never positions or stage numbers, so a pipeline split
differently, or a world size that pads buckets differently, finds its pieces.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..safe_files import atomic_file, folder_mode_for, fsync_folder, open_new
from .checkpoint_reader import CheckpointReader, UntrustedCheckpointError, reading

__all__ = [
    "SHARDED_FORMAT",
    "IncompatibleCheckpointError",
    "UntrustedCheckpointError",
    "check_compatible",
    "consolidated_state",
    "export_consolidated",
    "flat_pieces",
    "is_sharded_checkpoint",
    "local_piece",
    "load_sharded",
    "read_metadata",
    "read_trainer_record",
    "save_sharded",
    "saved_entries",
]

SHARDED_FORMAT = 2  # the trainer record's "format" in a checkpoint folder (single files are format 1)
TRAINER_RECORD = "trainer.pt"
_DIR_NAME = re.compile(r"^ckpt-(\d{9})$")


class IncompatibleCheckpointError(ValueError):
    """A checkpoint written for another model (names or shapes differ): refused before the first step."""


@contextlib.contextmanager
def _sharded_tensors_allowed():
    """torch marks ShardedTensor deprecated in favour of DTensor, but a DTensor's pieces sit where its placement
    says (even chunks), while ZeRO's slices of a parameter start anywhere: only ShardedTensor's explicit offsets
    say that. Silence that one warning where fastpar builds or saves them, nothing else."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor", category=FutureWarning)
        yield


def local_piece(tensor: ShardedTensor) -> torch.Tensor:
    """This rank's piece of a :func:`flat_pieces` tensor."""
    with _sharded_tensors_allowed():
        return tensor.local_shards()[0].tensor


def is_sharded_checkpoint(path: str | Path) -> bool:
    return Path(path).is_dir() and _DIR_NAME.match(Path(path).name) is not None


def flat_pieces(
    local: torch.Tensor | None, offset: int, ranges: Sequence[tuple[int, int, int]], numel: int
) -> ShardedTensor:
    """A 1-D tensor of ``numel`` elements of which this rank holds ``local`` at ``offset`` (None: nothing).
    ``ranges``: every rank's ``(rank, offset, length)``, the same list on every rank -- no collective needed,
    so it can be built for each of thousands of parameters. DCP saves each rank's piece with its offset and
    reads back any other cut of the same elements."""
    rank = dist.get_rank()
    if local is not None:
        dtype, device = local.dtype, local.device
    else:  # a rank that holds nothing still declares the tensor, with its owners' properties
        dtype, device = torch.get_default_dtype(), torch.device("cpu")
    shards, local_shards = [], []
    for owner, start, length in ranges:
        meta = ShardMetadata(
            shard_offsets=[start], shard_sizes=[length], placement=f"rank:{owner}/{_placement_device(device)}"
        )
        shards.append(meta)
        if owner == rank:
            if local is None or local.numel() != length or start != offset:
                raise ValueError(
                    f"rank {rank}'s piece [{offset}, +{0 if local is None else local.numel()}) does "
                    f"not match its declared range [{start}, +{length})"
                )
            local_shards.append(Shard(local.reshape(-1), meta))
    properties = TensorProperties(dtype=dtype, requires_grad=False)
    metadata = ShardedTensorMetadata(shards_metadata=shards, size=torch.Size([numel]), tensor_properties=properties)
    with _sharded_tensors_allowed():
        return ShardedTensor._init_from_local_shards_and_global_metadata(local_shards, metadata)


def _placement_device(device: torch.device) -> str:
    return (
        f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
        if (device.type == "cuda")
        else "cpu"
    )


# --- writing -----------------------------------------------------------------------------------------
def save_sharded(
    state: dict[str, Any],
    directory: str | Path,
    step: int,
    record: dict[str, Any] | None,
    keep: int,
    group: dist.ProcessGroup | None = None,
    mode: int = 0o600,
) -> list[str] | None:
    """Collective: write ``state`` as ``directory/ckpt-<step>/``, rank 0 adding ``record`` (``trainer.pt``)
    and keeping the newest ``keep`` checkpoints (files or folders). Files get ``mode``, the folder the matching
    folder mode (0600 -> 0700, 0640 -> 0750). Returns the kept paths on rank 0."""
    directory = Path(directory)
    final = directory / f"ckpt-{step:09d}"
    rank = dist.get_rank(group)
    # a fresh, private folder: a name fixed in advance could already be someone's symlink to elsewhere
    made: list[str | None] = [None]
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        made[0] = tempfile.mkdtemp(prefix=f".ckpt-{step:09d}.", suffix=".tmp", dir=directory)
    dist.broadcast_object_list(made, group_src=0, group=group)
    tmp = Path(made[0])
    with _sharded_tensors_allowed():
        dcp.save(state, checkpoint_id=str(tmp), process_group=group)
    dist.barrier(group)  # every rank's pieces are on disk
    kept = None
    if rank == 0:
        if record is not None:
            _write_synced(tmp / TRAINER_RECORD, record, mode)
        for piece in tmp.iterdir():  # DCP created its files with the umask's mode, inside the private folder
            os.chmod(piece, mode)
        os.chmod(tmp, folder_mode_for(mode))
        fsync_folder(tmp)
        if final.is_symlink():  # not a folder fastpar made: the link goes, never what it points at
            final.unlink()
        elif final.exists():  # the same step saved again (a resumed run re-saving): replace it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_folder(directory)
        kept = _prune(directory, keep)
    dist.barrier(group)  # nobody reads or prunes while rank 0 is renaming
    return kept


def _write_synced(path: Path, obj: Any, mode: int) -> None:
    """A new file at ``path`` (in a folder only this user writes), never opened through an existing name."""
    with os.fdopen(open_new(path, mode), "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())


def _prune(directory: Path, keep: int) -> list[str]:
    found = sorted((int(p.name[5:14]), p) for p in directory.iterdir() if p.name.startswith("ckpt-"))
    for _, old in found[:-keep]:
        shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink(missing_ok=True)
    return [str(p) for _, p in found[-keep:]]


# --- reading -----------------------------------------------------------------------------------------
def read_metadata(path: str | Path) -> Metadata:
    """DCP's metadata of a checkpoint folder, read as plain data (UntrustedCheckpointError for anything else)."""
    return CheckpointReader(str(path)).read_metadata()


def read_trainer_record(path: str | Path) -> dict[str, Any]:
    """``trainer.pt`` of a checkpoint folder (raises when the folder is incomplete)."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path} has no .metadata: DCP did not finish writing it")
    return torch.load(path / TRAINER_RECORD, map_location="cpu", weights_only=True)


def saved_entries(path: str | Path) -> dict[tuple[str, ...], TensorStorageMetadata | Any]:
    """Every entry of a checkpoint folder by its path in the nested state (``("model", "0.weight")``), with
    DCP's metadata (a tensor's global size and dtype)."""
    metadata = read_metadata(path)
    return {tuple(metadata.planner_data[key]): value for key, value in metadata.state_dict_metadata.items()}


def check_compatible(
    expected: Mapping[str, torch.Size], saved: Mapping[str, torch.Size], where: str, *, subset: bool = False
) -> None:
    """Raise IncompatibleCheckpointError naming the parameters/buffers missing, unexpected or of another shape.
    ``expected``/``saved``: name -> global shape. ``subset``: this rank needs only some of the saved names
    (a pipeline stage), so extra saved names are fine."""
    missing = sorted(set(expected) - set(saved))
    extra = [] if subset else sorted(set(saved) - set(expected))
    shapes = sorted(
        f"{k}: checkpoint {list(saved[k])}, model {list(expected[k])}"
        for k in set(expected) & set(saved)
        if tuple(saved[k]) != tuple(expected[k])
    )
    if not (missing or extra or shapes):
        return
    parts = []
    if missing:
        parts.append(f"missing from the checkpoint: {_few(missing)}")
    if extra:
        parts.append(f"not in the model: {_few(extra)}")
    if shapes:
        parts.append(f"shapes differ: {_few(shapes)}")
    raise IncompatibleCheckpointError(
        f"the checkpoint {where} was written for a different model ({'; '.join(parts)}); resume with the model "
        "that wrote it, or start this model in an empty checkpoint_dir (or with resume=False)"
    )


def _few(names: Sequence[str], shown: int = 8) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def model_shapes_in(path: str | Path) -> dict[str, torch.Size]:
    """The model's entries (name -> global shape) a checkpoint folder holds."""
    return {
        key[1]: value.size
        for key, value in saved_entries(path).items()
        if key[0] == "model" and len(key) == 2 and isinstance(value, TensorStorageMetadata)
    }


def load_sharded(state: dict[str, Any], path: str | Path, group: dist.ProcessGroup | None = None) -> None:
    """Collective: fill ``state`` (the same nesting as saved; this rank's pieces) in place from ``path``."""
    with _sharded_tensors_allowed():
        with reading(path) as reader:
            dcp.load(state, storage_reader=reader, process_group=group)


# --- one file for inference --------------------------------------------------------------------------
def consolidated_state(checkpoint_dir: str | Path) -> dict[str, Any]:
    """The whole checkpoint in one process: DCP's nested dict with every sharded tensor whole (ZeRO's flat
    optimizer state stays flat: 1-D in the parameter's memory order). Needs the memory of the full state."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    with reading(checkpoint_dir) as reader:
        _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return state


def export_consolidated(checkpoint_dir: str | Path, out_file: str | Path, mode: int = 0o600) -> Path:
    """Write the model of a checkpoint folder (any strategy, any world size) as one ``model.state_dict()``-shaped
    file: ``model.load_state_dict(torch.load(out_file))`` on the plain, unsharded model. Runs in one process
    and needs the memory of the model's weights (not of the optimizer state). ``mode``: the file's (0600:
    only this user reads it)."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    checkpoint_dir = Path(checkpoint_dir)
    if not (checkpoint_dir / ".metadata").is_file():
        raise FileNotFoundError(
            f"{checkpoint_dir} is not a sharded checkpoint (no .metadata); pass a ckpt-<step> folder written by "
            "fastpar.Trainer with a sharded strategy"
        )
    state: dict[str, Any] = {}
    with reading(checkpoint_dir) as reader:
        model_keys = {k for k, path in reader.read_metadata().planner_data.items() if path[0] == "model"}
        _load_state_dict(
            state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(keys=model_keys), no_dist=True
        )
    model = state["model"]
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(out_file, mode) as fh:
        torch.save(dict(model), fh)
    return out_file
