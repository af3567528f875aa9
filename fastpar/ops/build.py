"""The one list of sources and compile flags of ``fastpar._C``.

Both builds read it: ``setup.py`` (ahead of time, loading this file by path, before fastpar is importable)
and ``fastpar.ops.loader`` (the JIT build on first use). So this module imports nothing heavy at import time;
functions that need torch take it as an argument.

Environment:
  FASTPAR_CUDA=0|1         build the CUDA kernels or not (default: when a CUDA torch and toolkit are usable)
  TORCH_CUDA_ARCH_LIST     GPU architectures of the CUDA build (default: the visible GPUs'; with none visible,
                           the architectures torch itself was built for, see ``default_cuda_archs``)
  FASTPAR_BUILD_DEBUG=1    keep debug info (-g); the default -g0 halves the compile time of the bindings
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

CUDA_DEFINE = "FASTPAR_WITH_CUDA"


@dataclass(frozen=True)
class BuildConfig:
    """What to compile and how: the same for setup.py's Cpp/CUDAExtension and cpp_extension.load."""

    sources: list[Path]
    cxx_flags: list[str]  # host compiler, .cpp files (CUDA builds: also -D FASTPAR_WITH_CUDA)
    nvcc_flags: list[str]  # .cu files (CUDA builds only)
    ldflags: list[str]
    with_cuda: bool


def cuda_wanted(default: bool) -> bool:
    """FASTPAR_CUDA=0|1 if set, else ``default``; any other value is an error naming the variable."""
    flag = os.environ.get("FASTPAR_CUDA", "")
    if flag == "":
        return default
    if flag not in ("0", "1"):
        raise ValueError(f"FASTPAR_CUDA must be 0 or 1, got {flag!r}")
    return flag == "1"


def cuda_toolkit_usable(torch: ModuleType) -> bool:
    """A CUDA build of torch and a CUDA toolkit (CUDA_HOME) to compile against."""
    from torch.utils import cpp_extension

    return torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None


FALLBACK_CUDA_ARCHS = "7.5;8.0;8.6;8.9;9.0+PTX"  # Turing to Hopper, PTX for newer GPUs to JIT


def default_cuda_archs(torch: ModuleType, environ: dict[str, str] | None = None) -> str | None:
    """The TORCH_CUDA_ARCH_LIST a CUDA build needs when none is set and no GPU is visible (torch would ask the
    GPU which architecture to build for, and raise without one): the architectures torch itself was built
    for, PTX on the newest; ``FALLBACK_CUDA_ARCHS`` when torch doesn't say. None when nothing needs setting."""
    environ = os.environ if environ is None else environ
    if environ.get("TORCH_CUDA_ARCH_LIST") or torch.cuda.device_count() > 0:
        return None
    archs = []
    for name in torch.cuda.get_arch_list():  # "sm_80", "sm_120"; "compute_*" entries are PTX already
        digits = name.removeprefix("sm_")
        if name.startswith("sm_") and digits.isdigit() and len(digits) >= 2:
            archs.append(f"{digits[:-1]}.{digits[-1]}")
    return ";".join(archs) + "+PTX" if archs else FALLBACK_CUDA_ARCHS


def config(root: Path, torch: ModuleType, with_cuda: bool) -> BuildConfig:
    """Sources under ``root`` (csrc/) and flags for building against ``torch``."""
    # csrc/bindings.cpp defines the module; csrc/ops/ holds the bucket kernels, csrc/shm/ the shared-memory backend,
    # csrc/ddp/ DDP's per-gradient hot path.
    # Basenames are unique across the folders: the JIT build names object files after them.
    sources = sorted(root.glob("*.cpp")) + [
        p for part in ("ops", "shm", "ddp") for p in sorted((root / part).glob("*.cpp"))
    ]
    if with_cuda:
        sources += sorted((root / "ops" / "cuda").glob("*.cu"))
    # -fopenmp: at::parallel_for is a header-inline `omp parallel` when torch's backend is OpenMP; without the
    # flag it silently runs on one thread.
    openmp = ["-fopenmp"] if "parallel backend: OpenMP" in torch.__config__.parallel_info() else []
    debug = ["-g"] if os.environ.get("FASTPAR_BUILD_DEBUG") == "1" else ["-g0"]
    # -ffp-contract=off / --fmad=false: no fused multiply-add, so results match the pure-torch reference bit for bit.
    cxx = ["-O3", "-ffp-contract=off", *debug, *openmp]
    define = [f"-D{CUDA_DEFINE}"] if with_cuda else []
    return BuildConfig(
        sources=sources,
        cxx_flags=cxx + define,
        nvcc_flags=["-O3", "--fmad=false", *define],
        ldflags=[*openmp, "-lrt"],  # shm_open/shm_unlink (the fastpar backend) live in librt before glibc 2.34
        with_cuda=with_cuda,
    )
