"""Compile fastpar's CUDA kernels at run time with NVRTC, for the CuPy tier (``fastpar.ops.cupy_tier``).

The source is ``csrc/ops/cuda/bucket_kernels.cu``, the file nvcc builds into ``fastpar._C``: NVRTC sees its device
code only (the host launchers sit behind ``__CUDACC_RTC__``) and the kernels are ``extern "C"``, found by name.
fastpar drives NVRTC itself (CuPy's low-level binding) instead of ``cupy.RawModule(code=...)``, because CuPy's
compile adds ``-ftz=true``, which flushes subnormals and would break bit-exactness with the torch reference.
The binary for one GPU architecture is compiled on first use, cached on disk (``$FASTPAR_JIT_DIR/nvrtc``, default
``~/.cache/fastpar/nvrtc``) under a file lock, so ranks starting together compile it once, and loaded with
``cupy.RawModule(path=...)``.

Environment: ``FASTPAR_CUDA_INCLUDE=DIR`` holds ``cuda_fp16.h``/``cuda_bf16.h`` (default: found through
cuda-pathfinder: pip's nvidia-cuda-runtime wheel, conda, or the toolkit under CUDA_HOME).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from pathlib import Path

from .._optional import require
from .sources import cache_dir, csrc_dir, file_lock

SOURCE = "bucket_kernels.cu"
ABI_HEADER = "bucket_kernels.h"  # dtype codes, entry-table layout and launch shape shared with the host
ENTRY_POINTS = ("fastpar_scaled_copy", "fastpar_sum_squares", "fastpar_finish_norm")
# The nvcc build's arithmetic (setup.py: --fmad=false), spelled out: no FMA contraction, no flush of subnormals,
# IEEE division and square root. The PTX then rounds exactly like the CPU reference.
ARITHMETIC_OPTIONS = ("--fmad=false", "--ftz=false", "--prec-div=true", "--prec-sqrt=true")


class NvrtcError(RuntimeError):
    """NVRTC could not compile the kernels; the message carries NVRTC's log."""


def _binding():
    return require("cupy_backends.cuda.libs.nvrtc", extra="cupy", purpose="compiling CUDA kernels with NVRTC")


def kernel_dir() -> Path:
    """``csrc/ops/cuda`` of a source checkout, or the copy shipped inside the package."""
    root = csrc_dir()
    if root is None or not (root / "ops" / "cuda" / SOURCE).is_file():
        raise RuntimeError("the CUDA sources (csrc/ops/cuda) are not shipped with this installation of fastpar")
    return root / "ops" / "cuda"


@functools.cache
def abi() -> dict[str, int]:
    """The ``constexpr`` numbers of ``bucket_kernels.h`` (``kChunkElems``, ``kBlockThreads``, ...): the one copy."""
    text = (kernel_dir() / ABI_HEADER).read_text()
    values = {name: int(value) for name, value in re.findall(r"^constexpr\s+\w+\s+(k\w+)\s*=\s*(\d+);", text, re.M)}
    wanted = {"kChunkElems", "kBlockThreads", "kMaxBlocks", "kCopyEntryBytes", "kReduceEntryBytes"}
    if not wanted <= set(values):
        raise RuntimeError(f"{ABI_HEADER} no longer defines {sorted(wanted - set(values))} as plain constexpr literals")
    return values


def version() -> str:
    """NVRTC's version, e.g. ``"13.0"``."""
    major, minor = _binding().getVersion()
    return f"{major}.{minor}"


def supported_archs() -> tuple[int, ...]:
    """The ``sm_XY`` architectures this NVRTC compiles for, as ``XY`` numbers."""
    return tuple(int(a) for a in _binding().getSupportedArchs())


def target_for(capability: tuple[int, int]) -> str:
    """``sm_XY`` (a cubin) when NVRTC knows the GPU, else PTX for the newest older architecture it knows, which
    the driver compiles for the GPU (that needs a driver at least as new as NVRTC)."""
    arch, archs = capability[0] * 10 + capability[1], supported_archs()
    if arch in archs:
        return f"sm_{arch}"
    older = [a for a in archs if a < arch]
    if not older:
        raise NvrtcError(
            f"NVRTC {version()} compiles for sm_{archs[0]}..sm_{archs[-1]}; this GPU is sm_{arch}. "
            "Install the NVRTC of an older CUDA (pip install 'nvidia-cuda-nvrtc==12.*') or build fastpar with nvcc."
        )
    return f"compute_{max(older)}"


def cuda_include_dir() -> Path:
    """The folder with the CUDA headers the kernels include (``cuda_fp16.h``, ``cuda_bf16.h``)."""
    configured = os.environ.get("FASTPAR_CUDA_INCLUDE")
    candidates = [Path(configured)] if configured else []
    if not configured:
        try:
            from cuda.pathfinder import find_nvidia_header_directory  # comes with CuPy

            found = find_nvidia_header_directory("cudart")
            candidates += [Path(found)] if found else []
        except (ImportError, RuntimeError):
            pass
        candidates += [Path(os.environ[v]) / "include" for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    for folder in candidates:
        if (folder / "cuda_fp16.h").is_file():
            return folder
    where = f"FASTPAR_CUDA_INCLUDE={configured}" if configured else "cuda-pathfinder, CUDA_HOME and CUDA_PATH"
    raise RuntimeError(
        f"no cuda_fp16.h found through {where}: install the CUDA runtime headers (pip install "
        "'nvidia-cuda-runtime==13.*', which a CUDA build of torch usually brings) or set FASTPAR_CUDA_INCLUDE"
    )


def options(target: str) -> list[str]:
    """NVRTC flags for ``target`` (``sm_XY`` for a cubin, ``compute_XY`` for PTX)."""
    return [
        "--std=c++17",
        *ARITHMETIC_OPTIONS,
        f"--gpu-architecture={target}",
        f"--include-path={kernel_dir()}",
        f"--include-path={cuda_include_dir()}",
    ]


def compile_kernels(target: str) -> bytes:
    """Compile ``bucket_kernels.cu`` for ``target``: a cubin for ``sm_XY``, PTX for ``compute_XY``.

    Raises :class:`NvrtcError` with NVRTC's log on any compile error, or when an entry point is missing."""
    nvrtc = _binding()
    source = kernel_dir() / SOURCE
    flags = options(target)
    program = nvrtc.createProgram(source.read_text(), str(source), (), ())
    try:
        try:
            nvrtc.compileProgram(program, flags)
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(program).strip()
            raise NvrtcError(f"NVRTC {version()} could not compile {source} for {target} ({exc}):\n{log}") from None
        binary = nvrtc.getCUBIN(program) if target.startswith("sm_") else nvrtc.getPTX(program)
    finally:
        nvrtc.destroyProgram(program)
    missing = [name for name in ENTRY_POINTS if name.encode() not in binary]
    if missing:
        raise NvrtcError(f"{source} compiled for {target} but lacks the kernels {missing}")
    return binary


def _cache_path(target: str) -> Path:
    """Where the binary for ``target`` is cached: named by everything that changes it (sources, flags, NVRTC)."""
    digest = hashlib.sha256(f"{version()} {options(target)}".encode())
    folder = kernel_dir()
    for path in sorted(folder.glob("*.cu")) + sorted(folder.glob("*.cuh")) + sorted(folder.glob("*.h")):
        digest.update(path.name.encode() + path.read_bytes())
    root = cache_dir() / "nvrtc"
    suffix = "cubin" if target.startswith("sm_") else "ptx"
    return root / f"bucket_kernels-{target}-{digest.hexdigest()[:16]}.{suffix}"


def cached_kernels(target: str) -> Path:
    """The compiled kernels for ``target`` on disk, compiling them first if no process has yet."""
    path = _cache_path(target)
    if path.is_file():
        return path
    with file_lock(path.with_suffix(".lock")):  # another rank may be compiling the same file
        if not path.is_file():
            binary = compile_kernels(target)
            partial = path.with_suffix(f".{os.getpid()}.tmp")
            partial.write_bytes(binary)
            os.replace(partial, path)  # readers never see a half-written file
    return path
