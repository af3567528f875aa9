"""Reading a DCP checkpoint folder without running what is in it.

``torch.distributed.checkpoint``'s own reader unpickles ``.metadata`` with plain ``pickle`` and loads each
non-tensor entry ("bytes": an optimizer's ``lr``, ``betas``...) with ``torch.load(weights_only=False)``, so a
planted folder runs its author's code in whoever resumes or exports it. :class:`CheckpointReader` is torch's
``FileSystemReader`` with those two doors shut:

- ``.metadata`` is unpickled by an allow-list: the classes of ``torch.distributed.checkpoint.metadata``,
  the filesystem reader's ``_StorageInfo``, ``torch.Size``, dtypes, layouts and memory formats, the path of
  the folder it was written to, and plain containers -- what torch writes there, nothing that runs code.
  Anything else is refused before it is looked up, with :class:`UntrustedCheckpointError`;
- a bytes entry is loaded with ``torch.load(weights_only=True)`` (plain Python values and tensors) and
  handed on re-serialized, so torch's planner only ever unpickles what fastpar wrote itself.

Tensor entries were already loaded with ``weights_only=True`` by torch. Every place fastpar reads a checkpoint
folder goes through this reader.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ..user_errors import UserError

__all__ = ["CheckpointReader", "UntrustedCheckpointError", "reading"]

_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    *(
        (_METADATA, name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # how a torch.layout pickles: a lookup by its name
    # StorageMeta.checkpoint_id: the folder the checkpoint was written to (pathlib moved its classes in 3.13)
    *((module, name) for module in ("pathlib", "pathlib._local") for name in ("PosixPath", "PurePosixPath")),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)  # torch.float32 pickles as a name


class UntrustedCheckpointError(UserError, ValueError):
    """A checkpoint file that holds what fastpar and torch never write there (a pickle naming other code, a
    value that is not plain data): refused without running any of it."""


def _refusal(path: str | os.PathLike, what: str) -> UntrustedCheckpointError:
    return UntrustedCheckpointError(
        f"{path} is not a checkpoint that fastpar or torch.distributed.checkpoint wrote: {what}. Nothing in it was "
        "run; load checkpoints only from folders you trust"
    )


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: str | os.PathLike) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_CONSTANTS):
            return getattr(torch, name)
        raise _refusal(self._path, f"its pickle asks for {module}.{name}, which DCP metadata never holds")


def load_metadata(file, path: str | os.PathLike) -> Metadata:
    """DCP's ``Metadata`` from the open ``file`` (``path`` names it in errors), through the allow-list."""
    try:
        metadata = _MetadataUnpickler(file, path).load()
    except UntrustedCheckpointError:
        raise
    except Exception as exc:  # truncated, or not a pickle at all
        raise ValueError(f"{path} is unreadable: not DCP metadata, or cut short ({type(exc).__name__}: {exc})") from exc
    if not isinstance(metadata, Metadata):
        raise _refusal(path, f"it holds a {type(metadata).__name__}, not DCP's Metadata")
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        # every piece lives in the checkpoint's own folder: a path elsewhere would read another file as tensors
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or os.sep in name:
            raise _refusal(path, f"it points at a data file {name!r} outside its folder")
    return metadata


class CheckpointReader(FileSystemReader):
    """torch's ``FileSystemReader`` that runs nothing a checkpoint folder holds (see the module docstring)."""

    _metadata: dict[int | None, Metadata]

    def reset(self, checkpoint_id=None) -> None:
        super().reset(checkpoint_id)
        self._metadata = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        cache = self.__dict__.setdefault("_metadata", {})
        if rank not in cache:  # read once: reading() checks it before DCP, which would fold a refusal into others
            path = self._get_metadata_path(rank)
            with self.fs.create_stream(path, "rb") as file:
                metadata = load_metadata(file, path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id  # as torch's reader does
            cache[rank] = metadata
        return cache[rank]

    def read_data(self, plan, planner):
        return super().read_data(plan, _PlainBytesOnly(planner, self))


@contextlib.contextmanager
def reading(path: str | os.PathLike) -> Iterator[CheckpointReader]:
    """A :class:`CheckpointReader` on folder ``path`` whose metadata is already checked, for ``dcp.load``.
    A refusal raised while DCP loads (a bytes entry, on any rank) comes out as itself: DCP wraps what its
    steps raise into one CheckpointException holding every rank's traceback."""
    reader = CheckpointReader(str(path))
    reader.read_metadata()
    try:
        yield reader
    except CheckpointException as exc:
        refused = [error for error, _ in exc.failures.values() if isinstance(error, UntrustedCheckpointError)]
        if refused:
            raise refused[0] from None
        raise


class _PlainBytesOnly:
    """``planner``, except that a bytes entry reaches it only after ``torch.load(weights_only=True)``."""

    def __init__(self, planner, reader: CheckpointReader) -> None:
        self._planner, self._reader = planner, reader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            plain = torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            file = Path(self._reader.path) / self._reader.storage_data[read_item.storage_index].relative_path
            # torch names the global ("Unsupported global: GLOBAL os.system ...") and advises allowing it: we don't
            found = re.search(r"GLOBAL ([\w.]+)", str(exc))
            reason = f"it asks for {found.group(1)}" if found else type(exc).__name__
            raise _refusal(file, f"its entry {read_item.dest_index.fqn!r} is not plain data ({reason})") from None
        clean = io.BytesIO()
        torch.save(plain, clean)  # torch's planner unpickles this with weights_only=False: only ever our bytes
        clean.seek(0)
        self._planner.load_bytes(read_item, clean)
