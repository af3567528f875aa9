"""Find the kernels behind ``fastpar.ops``: the compiled ``fastpar._C``, the CuPy/NVRTC tier, a JIT build, pure torch.

Loading order (docs/design.md): the module built by ``setup.py`` when it has CUDA kernels (or no GPU is visible) →
on a GPU without them, the CuPy tier (``fastpar.ops.cupy_tier``: the same ``csrc/ops/cuda`` source compiled by NVRTC;
CPU tensors then use the prebuilt module if there is one, else torch) → the prebuilt CPU-only module → a JIT build
with ``torch.utils.cpp_extension.load`` (cached per torch version and source hash, guarded by a file lock so many
ranks starting at once build it once) → the pure-torch fallback in ``fastpar.ops.reference`` with one warning.
Nothing here raises: ``import fastpar`` never fails because of the extension.

Environment:
  FASTPAR_EXT=auto|compiled|cupy|jit|torch  force a path ("torch" skips the extension entirely)
  FASTPAR_JIT_DIR=DIR                  where JIT builds are cached (default ~/.cache/fastpar)
  FASTPAR_CUDA=0|1                     JIT: build the CUDA kernels or not (default: when usable)
"""

from __future__ import annotations

import hashlib
import importlib
import os
import threading
import warnings
from pathlib import Path
from types import ModuleType

import torch

from . import build
from .sources import cache_dir, csrc_dir, file_lock

_lock = threading.Lock()
_state: dict | None = None


def _jit_build() -> ModuleType:
    from torch.utils import cpp_extension

    root = csrc_dir()
    if root is None:
        raise RuntimeError("C++ sources (csrc/) are not shipped with this installation")
    with_cuda = build.cuda_wanted(default=build.cuda_toolkit_usable(torch) and torch.cuda.is_available())
    cfg = build.config(root, torch, with_cuda)  # the same sources and flags as setup.py
    digest = hashlib.sha256(f"{torch.__version__} {cfg.cxx_flags} {cfg.nvcc_flags}".encode())
    for src in cfg.sources + sorted(root.rglob("*.h")) + sorted(root.rglob("*.cuh")):
        digest.update(src.read_bytes())
    tag = f"fastpar_C_{'cuda' if cfg.with_cuda else 'cpu'}_{digest.hexdigest()[:12]}"
    cache = cache_dir() / tag
    cache.mkdir(parents=True, exist_ok=True)
    with file_lock(cache / ".lock"):
        return cpp_extension.load(
            name=tag,
            sources=[str(s) for s in cfg.sources],
            extra_cflags=cfg.cxx_flags,
            extra_cuda_cflags=cfg.nvcc_flags,
            extra_ldflags=cfg.ldflags,
            extra_include_paths=[str(root)],
            build_directory=str(cache),
            with_cuda=cfg.with_cuda,
            verbose=os.environ.get("FASTPAR_JIT_VERBOSE") == "1",
        )


_MODES = ("auto", "compiled", "cupy", "jit", "torch")


def _gpu_visible() -> bool:
    return torch.version.cuda is not None and torch.cuda.is_available()


def _with_module(backend: str, module: ModuleType | None, reason: str, cuda_tier=None) -> dict:
    """A loader state: which implementation serves CPU and CUDA tensors (name, object), and why."""
    cpu = ("jit" if backend == "jit" else "compiled", module) if module is not None else ("torch", None)
    if cuda_tier is not None:
        cuda = ("cupy", cuda_tier)
    elif module is not None and module.has_cuda():
        cuda = cpu
    else:
        cuda = ("torch", None)
    return {"backend": backend, "module": module, "reason": reason, "cpu": cpu, "cuda": cuda}


def _load() -> dict:
    mode = os.environ.get("FASTPAR_EXT", "auto")
    if mode not in _MODES:
        warnings.warn(f"FASTPAR_EXT={mode!r} is not one of {'|'.join(_MODES)}; using auto", stacklevel=3)
        mode = "auto"
    if mode == "torch":
        return _with_module("torch", None, "FASTPAR_EXT=torch selects the pure-torch ops")

    reasons = []
    module = None
    if mode in ("auto", "compiled", "cupy"):
        try:
            module = importlib.import_module("fastpar._C")
            prebuilt = f"prebuilt {Path(module.__file__).name}"
        except ImportError as exc:
            reasons.append(f"no prebuilt fastpar._C ({exc})")
    if module is not None and (mode == "compiled" or (mode == "auto" and (module.has_cuda() or not _gpu_visible()))):
        return _with_module("compiled", module, prebuilt)
    if mode == "cupy" or (mode == "auto" and _gpu_visible()):
        try:
            from . import cupy_tier

            tier = cupy_tier.load()
            cpu = prebuilt if module is not None else "pure torch (no prebuilt fastpar._C)"
            reason = f"CUDA kernels compiled by NVRTC {tier.nvrtc_version} through CuPy; CPU ops: {cpu}"
            return _with_module("cupy", module, reason, cuda_tier=tier)
        except Exception as exc:  # missing CuPy, NVRTC or headers show up as several exception types
            reasons.append(f"CuPy/NVRTC tier unavailable ({exc})")
    if module is not None and mode == "auto":
        return _with_module("compiled", module, f"{prebuilt}; CUDA tensors use pure torch: {'; '.join(reasons)}")
    if mode in ("auto", "jit"):
        try:
            module = _jit_build()
            return _with_module("jit", module, f"built on first use into {Path(module.__file__).parent}")
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
    return _with_module("torch", None, reason)


def _get() -> dict:
    global _state
    if _state is None:
        with _lock:
            if _state is None:
                _state = _load()
    return _state


def extension() -> ModuleType | None:
    """The loaded ``_C`` module (prebuilt or JIT), or None when there is none."""
    return _get()["module"]


def kernels_for(device: torch.device) -> tuple[str, object | None]:
    """(name, implementation) serving tensors on ``device``: ``"compiled"``, ``"jit"`` or ``"cupy"`` with an object
    that has ``pack``/``unpack``/``norm_and_finite``, or ``("torch", None)`` for the pure-torch ops."""
    state = _get()
    if device.type == "cpu":
        return state["cpu"]
    if device.type != "cuda":
        return "torch", None
    name, impl = state["cuda"]
    if name == "cupy":
        try:
            impl.prepare(device)  # compiles or loads the kernels once per device
        except Exception as exc:
            _cuda_tier_failed(device, exc)
            return "torch", None
    return name, impl


def _cuda_tier_failed(device: torch.device, exc: Exception) -> None:
    """The CuPy tier could not load its kernels on ``device``: CUDA tensors take the torch path, said once."""
    with _lock:
        if _state is None or _state["cuda"][0] != "cupy":
            return
        _state["cuda"] = ("torch", None)
        _state["backend"] = _state["cpu"][0]
        _state["reason"] += f"; the CuPy tier failed on {device}, CUDA tensors use pure torch: {exc}"
    warnings.warn(
        f"fastpar: the CuPy kernel tier failed on {device}, CUDA tensors use pure-torch ops (slower): {exc}",
        RuntimeWarning,
        stacklevel=4,
    )


def ext_status() -> dict:
    """Which implementation of ``fastpar.ops`` is live: ``{"backend": "compiled"|"cupy"|"jit"|"torch", "reason": ...}``.

    Also: whether CUDA kernels are live (``"cuda"``: compiled in, or the CuPy tier), what serves CPU tensors
    (``"cpu"``) and, with the CuPy tier, the NVRTC version that compiles its kernels (``"nvrtc"``, else None).
    """
    state = _get()
    cuda_name, cuda_impl = state["cuda"]
    return {
        "backend": state["backend"],
        "reason": state["reason"],
        "cuda": cuda_name != "torch",
        "cpu": state["cpu"][0],
        "nvrtc": cuda_impl.nvrtc_version if cuda_name == "cupy" else None,
    }


def _reset_for_tests() -> None:
    global _state
    with _lock:
        _state = None
