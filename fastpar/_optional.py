"""One place to probe and import optional dependencies (DALI, NVML, matplotlib, ...).

Code that needs an optional package calls ``require(...)`` inside the code path that uses it, so
``import fastpar`` never pays for (or fails on) an extra the user did not install.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from types import ModuleType

# module name -> (pip extra that provides it, human name)
_EXTRAS = {
    "nvidia.dali": ("dali", "NVIDIA DALI"),
    "pynvml": ("nvml", "NVML bindings (nvidia-ml-py)"),
    "matplotlib": ("bench", "matplotlib"),
    "PIL": ("dev", "Pillow"),
    "pytest_benchmark": ("bench", "pytest-benchmark"),
    "cupy": ("cupy", "CuPy"),
    "cupy_backends.cuda.libs.nvrtc": ("cupy", "CuPy's NVRTC binding"),
    "submitit": ("jobs", "submitit"),
    "boto3": ("s3", "boto3 (the AWS SDK for Python)"),
    "fsspec": ("s3", "fsspec"),
    "moto": ("s3-test", "moto[server]"),
}


@functools.cache
def available(module: str) -> bool:
    """True when ``module`` can be imported (checked once, without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require(module: str, *, extra: str | None = None, purpose: str = "") -> ModuleType:
    """Import ``module`` or raise an ImportError that names the pip extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        default_extra, name = _EXTRAS.get(module, (None, module))
        extra = extra or default_extra
        what = f" for {purpose}" if purpose else ""
        hint = f"pip install 'fastpar[{extra}]'" if extra else f"pip install {module}"
        raise ImportError(f"{name} is needed{what} but could not be imported ({exc}). Install it: {hint}") from exc
