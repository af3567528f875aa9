"""Where the C++/CUDA sources and the build caches live, and the file lock that lets many ranks build once.

Shared by the JIT tier (``fastpar.ops.loader``) and the NVRTC tier (``fastpar.ops.nvrtc``); imports nothing
heavy, so both can use it without importing each other.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]  # fastpar/
BINDINGS = "bindings.cpp"  # the file that defines the fastpar._C module: marks a complete csrc/ tree


def csrc_dir() -> Path | None:
    """The C++/CUDA sources: a source checkout's ``csrc/`` or the copy shipped inside the package."""
    for candidate in (_PACKAGE.parent / "csrc", _PACKAGE / "_csrc"):
        if (candidate / BINDINGS).is_file():
            return candidate
    return None


def cache_dir() -> Path:
    """Where built kernels are cached: ``FASTPAR_JIT_DIR``, else ``~/.cache/fastpar``."""
    return Path(os.environ.get("FASTPAR_JIT_DIR", Path.home() / ".cache" / "fastpar"))


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path``: blocks while another process (another rank) builds the same thing."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
