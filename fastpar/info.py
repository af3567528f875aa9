"""``fastpar info``: what fastpar found on this machine (versions, devices, kernel backend)."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nccl_version() -> str | None:
    import torch

    if not torch.cuda.is_available() and torch.version.cuda is None:
        return None
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # NCCL not compiled into this torch
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def collect() -> dict:
    """Everything ``fastpar info`` prints, as a dict."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # do not create a CUDA context
    import torch
    import torch.distributed as dist

    from ._version import __version__
    from .ops.loader import ext_status

    dali = None
    for dist_name in ("nvidia-dali-cuda130", "nvidia-dali-cuda120", "nvidia-dali-cuda110", "nvidia-dali"):
        if (dali := _version(dist_name)) is not None:
            dali = f"{dali} ({dist_name})"
            break
    cuda_ok = torch.cuda.is_available()
    return {
        "fastpar": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": cuda_ok,
        "gpu_count": torch.cuda.device_count() if cuda_ok else 0,
        "nccl": _nccl_version(),
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "dali": dali,
        "nvidia_ml_py": _version("nvidia-ml-py"),
        "extension": ext_status(),
    }


def _kernels_line(ext: dict) -> str:
    """``compiled + CUDA (...)``, ``cupy, NVRTC 13.0 (...)``, ``torch (...)``: the backend first, then why."""
    if ext["nvrtc"]:
        return f"{ext['backend']}, NVRTC {ext['nvrtc']} ({ext['reason']})"
    return f"{ext['backend']}{' + CUDA' if ext['cuda'] else ''} ({ext['reason']})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fastpar info", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print the facts as one JSON object")
    args = parser.parse_args(argv)
    facts = collect()
    if args.json:
        print(json.dumps(facts, indent=2))
        return 0
    ext = facts["extension"]
    rows = [
        ("fastpar", facts["fastpar"]),
        ("python", f"{facts['python']} on {facts['platform']}"),
        ("torch", facts["torch"]),
        ("CUDA (torch build)", facts["torch_cuda"] or "none (CPU build)"),
        ("GPUs visible", f"{facts['gpu_count']}" if facts["cuda_available"] else "0 (no usable CUDA device)"),
        ("NCCL", facts["nccl"] or "not available"),
        ("gloo", "available" if facts["gloo"] else "not available"),
        ("DALI", facts["dali"] or "not installed (pip install 'fastpar[dali]')"),
        ("NVML (nvidia-ml-py)", facts["nvidia_ml_py"] or "not installed (pip install 'fastpar[nvml]')"),
        ("kernels", _kernels_line(ext)),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0
