"""Find the compiled extension ``fastpar._C``: prebuilt, else JIT-built, else pure torch.

Loading order (DESIGN.md): the module built by ``setup.py`` → a JIT build with
``torch.utils.cpp_extension.load`` (cached per torch version and source hash, guarded by a file lock
so many ranks starting at once build it once) → the pure-torch fallback in ``fastpar._torch_ops``
with one warning. Nothing here raises: ``import fastpar`` never fails because of the extension.

Environment:
  FASTPAR_EXT=auto|compiled|jit|torch  force a path ("torch" skips the extension entirely)
  FASTPAR_JIT_DIR=DIR                  where JIT builds are cached (default ~/.cache/fastpar)
  FASTPAR_CUDA=0|1                     JIT: build the CUDA kernels or not (default: when usable)
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
import threading
import warnings
from pathlib import Path
from types import ModuleType

import torch

_REPO_ROOT = Path(__file__).resolve().parent.parent
_lock = threading.Lock()
_state: dict | None = None


def csrc_dir() -> Path | None:
    """The C++/CUDA sources: a source checkout's ``csrc/`` or the copy shipped inside the package."""
    for candidate in (_REPO_ROOT / "csrc", Path(__file__).resolve().parent / "_csrc"):
        if (candidate / "fastpar.cpp").is_file():
            return candidate
    return None


def extension_sources(root: Path, with_cuda: bool) -> list[Path]:
    """Sources of ``_C``; shared with setup.py so both builds compile the same files."""
    sources = sorted(root.glob("*.cpp"))
    if with_cuda:
        sources += sorted((root / "cuda").glob("*.cu"))
    return sources


def cuda_build_wanted(default: bool) -> bool:
    flag = os.environ.get("FASTPAR_CUDA")
    if flag in (None, ""):
        return default
    if flag not in ("0", "1"):
        raise ValueError(f"FASTPAR_CUDA must be 0 or 1, got {flag!r}")
    return flag == "1"


def _cuda_toolkit_usable() -> bool:
    from torch.utils import cpp_extension

    return torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None


@contextlib.contextmanager
def _file_lock(path: Path):
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # blocks while another rank builds
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _jit_build() -> ModuleType:
    from torch.utils import cpp_extension

    root = csrc_dir()
    if root is None:
        raise RuntimeError("C++ sources (csrc/) are not shipped with this installation")
    with_cuda = cuda_build_wanted(default=_cuda_toolkit_usable() and torch.cuda.is_available())
    sources = extension_sources(root, with_cuda)
    # Same flags as setup.py: no FMA contraction (bit-exact with the torch reference), OpenMP for at::parallel_for.
    openmp = ["-fopenmp"] if "parallel backend: OpenMP" in torch.__config__.parallel_info() else []
    cflags = ["-O3", "-ffp-contract=off", *openmp] + (["-DFASTPAR_WITH_CUDA"] if with_cuda else [])
    cuda_cflags = ["-O3", "--fmad=false", "-DFASTPAR_WITH_CUDA"]
    digest = hashlib.sha256(f"{torch.__version__} {cflags} {cuda_cflags}".encode())
    for src in sources + sorted(root.rglob("*.h")) + sorted(root.rglob("*.cuh")):
        digest.update(src.read_bytes())
    tag = f"fastpar_C_{'cuda' if with_cuda else 'cpu'}_{digest.hexdigest()[:12]}"
    cache = Path(os.environ.get("FASTPAR_JIT_DIR", Path.home() / ".cache" / "fastpar")) / tag
    cache.mkdir(parents=True, exist_ok=True)
    with _file_lock(cache / ".lock"):
        return cpp_extension.load(
            name=tag,
            sources=[str(s) for s in sources],
            extra_cflags=cflags,
            extra_cuda_cflags=cuda_cflags,
            extra_ldflags=[*openmp, "-lrt"],  # shm_open: librt before glibc 2.34
            extra_include_paths=[str(root)],
            build_directory=str(cache),
            with_cuda=with_cuda,
            verbose=os.environ.get("FASTPAR_JIT_VERBOSE") == "1",
        )


def _load() -> dict:
    mode = os.environ.get("FASTPAR_EXT", "auto")
    if mode not in ("auto", "compiled", "jit", "torch"):
        warnings.warn(f"FASTPAR_EXT={mode!r} is not one of auto|compiled|jit|torch; using auto", stacklevel=3)
        mode = "auto"
    if mode == "torch":
        return {"backend": "torch", "module": None, "reason": "FASTPAR_EXT=torch selects the pure-torch ops"}

    reasons = []
    if mode in ("auto", "compiled"):
        try:
            module = importlib.import_module("fastpar._C")
            return {"backend": "compiled", "module": module, "reason": f"prebuilt {Path(module.__file__).name}"}
        except ImportError as exc:
            reasons.append(f"no prebuilt fastpar._C ({exc})")
    if mode in ("auto", "jit"):
        try:
            module = _jit_build()
            return {
                "backend": "jit",
                "module": module,
                "reason": f"built on first use into {Path(module.__file__).parent}",
            }
        except Exception as exc:  # a missing compiler shows up as many exception types
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            reasons.append(f"JIT build failed ({first_line})")
    reason = "; ".join(reasons)
    warnings.warn(
        f"fastpar: C++ extension unavailable, using pure-torch ops (slower): {reason}. "
        "Build it with `pip install --no-build-isolation .` or set FASTPAR_EXT=torch to silence this.",
        RuntimeWarning,
        stacklevel=3,
    )
    return {"backend": "torch", "module": None, "reason": reason}


def _get() -> dict:
    global _state
    if _state is None:
        with _lock:
            if _state is None:
                _state = _load()
    return _state


def extension() -> ModuleType | None:
    """The loaded ``_C`` module, or None when the pure-torch fallback is live."""
    return _get()["module"]


def ext_status() -> dict:
    """Which implementation of ``fastpar.ops`` is live: ``{"backend": "compiled"|"jit"|"torch", "reason": ...}``.

    Also reports whether the live extension contains CUDA kernels (``"cuda"``).
    """
    state = _get()
    module = state["module"]
    has_cuda = bool(module is not None and getattr(module, "has_cuda", lambda: False)())
    return {"backend": state["backend"], "reason": state["reason"], "cuda": has_cuda}


def _reset_for_tests() -> None:
    global _state
    with _lock:
        _state = None
