"""``fastpar info``: what fastpar found on this machine (versions, devices, kernel backend).

``--no-probe`` answers at once: versions from the installed packages' metadata and GPUs from the driver,
without importing torch or loading fastpar's kernels.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
from pathlib import Path


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


def _dali_version() -> str | None:
    for dist_name in ("nvidia-dali-cuda130", "nvidia-dali-cuda120", "nvidia-dali-cuda110", "nvidia-dali"):
        if (dali := _version(dist_name)) is not None:
            return f"{dali} ({dist_name})"
    return None


def _torch_cuda_build() -> str | None:
    """The CUDA version torch was built with, read from torch/version.py without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
    except OSError:
        return None
    found = re.search(r"^cuda(?:: .*?)?\s*=\s*['\"]([^'\"]+)['\"]", text, re.M)
    return found.group(1) if found else None


def collect_without_probe() -> dict:
    """What ``fastpar info --no-probe`` prints: no torch import, no kernel loading, no CUDA."""
    from ._version import __version__

    drivers = Path("/proc/driver/nvidia/gpus")
    return {
        "fastpar": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": _version("torch"),
        "torch_cuda": _torch_cuda_build(),
        "gpus_driver": len(list(drivers.iterdir())) if drivers.is_dir() else 0,
        "dali": _dali_version(),
        "nvidia_ml_py": _version("nvidia-ml-py"),
        "extension": None,
    }


def collect() -> dict:
    """Everything ``fastpar info`` prints, as a dict."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # do not create a CUDA context
    import torch
    import torch.distributed as dist

    from ._version import __version__
    from .ops.loader import ext_status

    dali = _dali_version()
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
    parser.add_argument(
        "--no-probe",
        action="store_true",
        help="answer at once: versions and GPUs without importing torch or loading the kernels",
    )
    args = parser.parse_args(argv)
    facts = collect_without_probe() if args.no_probe else collect()
    if args.json:
        print(json.dumps(facts, indent=2))
        return 0
    if args.no_probe:
        _print_rows(
            [
                ("fastpar", facts["fastpar"]),
                ("python", f"{facts['python']} on {facts['platform']}"),
                ("torch", facts["torch"] or "not installed"),
                ("CUDA (torch build)", facts["torch_cuda"] or "none (CPU build)"),
                ("GPUs (driver)", str(facts["gpus_driver"])),
                ("DALI", facts["dali"] or "not installed (pip install 'fastpar[dali]')"),
                ("NVML (nvidia-ml-py)", facts["nvidia_ml_py"] or "not installed (pip install 'fastpar[nvml]')"),
                ("kernels", "not probed (run 'fastpar info' to load torch and fastpar's kernels)"),
            ]
        )
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
    _print_rows(rows)
    return 0


def _print_rows(rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
