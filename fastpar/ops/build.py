"""The one list of sources and compile flags of ``fastpar._C``.

Both builds read it: ``setup.py`` (ahead of time, loading this file by path, before fastpar is importable)
and ``fastpar.ops.loader`` (the JIT build on first use). So this module imports nothing heavy at import time;
functions that need torch take it as an argument.

Environment:
  FASTPAR_CUDA=0|1         build the CUDA kernels or not (default: when a CUDA torch and toolkit are usable)
  CUDA_HOME / CUDA_PATH    the CUDA toolkit folder (default: found from nvcc on the PATH, see ``find_cuda_home``)
  TORCH_CUDA_ARCH_LIST     GPU architectures of the CUDA build (default: the visible GPUs'; with none visible,
                           the architectures torch itself was built for, see ``default_cuda_archs``)
  FASTPAR_BUILD_DEBUG=1    keep debug info (-g); the default -g0 halves the compile time of the bindings
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
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


CUDA_HEADER = Path("include") / "cuda_runtime_api.h"  # what marks a folder as a toolkit we can compile against


@dataclass(frozen=True)
class CudaToolkit:
    """Where the CUDA toolkit is (``root``, None when none was found) and, when it was not found, where we looked."""

    root: Path | None
    looked: str = ""


def _nvcc_top(nvcc: str, run: Callable[..., subprocess.CompletedProcess]) -> Path | None:
    """The toolkit folder nvcc itself uses: its ``TOP=`` line in ``nvcc --dryrun -v``. This sees through a wrapper
    script on the PATH (``exec /usr/local/cuda-13.0/bin/nvcc "$@"``) that a path derived from the wrapper's own
    location does not."""
    try:
        done = run(
            [nvcc, "--dryrun", "-v", "-E", "-x", "cu", os.devnull],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"^#\$ TOP=(.+)$", (done.stdout or "") + (done.stderr or ""), re.MULTILINE)
    return Path(match.group(1).strip()).resolve() if match else None


def find_cuda_home(
    environ: Mapping[str, str] | None = None,
    which: Callable[[str], str | None] = shutil.which,
    run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
    default_roots: tuple[str, ...] = ("/usr/local/cuda",),
    versioned_glob: str = "/usr/local/cuda-*",
) -> CudaToolkit:
    """The CUDA toolkit to compile against: the first folder whose ``include/cuda_runtime_api.h`` exists.

    CUDA_HOME or CUDA_PATH, when set, is the only candidate (the user chose it). Otherwise, in order: the folder
    above nvcc's real file (symlinks followed), the folder nvcc reports as its ``TOP`` (wrapper scripts followed),
    /usr/local/cuda, then /usr/local/cuda-* newest first. torch's own guess (the folder above the first nvcc on
    the PATH) names /usr/local when nvcc is a wrapper in /usr/local/bin, where no CUDA header lives."""
    environ = os.environ if environ is None else environ
    chosen = [(name, environ[name]) for name in ("CUDA_HOME", "CUDA_PATH") if environ.get(name)]
    if chosen:
        name, value = chosen[0]
        root = Path(value)
        if (root / CUDA_HEADER).is_file():
            return CudaToolkit(root)
        return CudaToolkit(None, f"{name}={value} has no {CUDA_HEADER}")

    def candidates():
        if nvcc := which("nvcc"):
            yield Path(nvcc).resolve().parent.parent
            if (top := _nvcc_top(nvcc, run)) is not None:  # run only when the cheaper guess failed
                yield top
        yield from (Path(p) for p in default_roots)
        yield from sorted((Path(p) for p in glob.glob(versioned_glob)), key=_version_key, reverse=True)

    looked = []
    for root in candidates():
        if (root / CUDA_HEADER).is_file():
            return CudaToolkit(root)
        if root not in looked:
            looked.append(root)
    where = ", ".join(map(str, looked)) or "nowhere (no nvcc on the PATH)"
    return CudaToolkit(None, f"no {CUDA_HEADER} under {where}")


def _version_key(path: Path) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", path.name))


def use_cuda_home(root: Path) -> None:
    """Point torch's cpp_extension at ``root``: through CUDA_HOME before it is imported (it reads the variable
    once, at import), and through its module attribute if it already was."""
    os.environ["CUDA_HOME"] = str(root)
    cpp_extension = sys.modules.get("torch.utils.cpp_extension")
    if cpp_extension is not None:
        cpp_extension.CUDA_HOME = str(root)


def choose_cuda(torch: ModuleType, find: Callable[[], CudaToolkit] = find_cuda_home) -> tuple[bool, str | None]:
    """Whether to build the CUDA kernels, and the one line to say about it (None: nothing to say).

    A CUDA torch and a toolkit with headers: yes, and torch's cpp_extension is pointed at that toolkit. A CUDA
    torch without one: the CPU extension, said in one line, never a failed install. FASTPAR_CUDA=0|1 overrides;
    FASTPAR_CUDA=1 with nothing to build against raises ValueError naming what is missing."""
    toolkit = find() if torch.version.cuda is not None else CudaToolkit(None, "torch is a CPU build")
    usable = toolkit.root is not None
    with_cuda = cuda_wanted(default=usable)
    if with_cuda and not usable:
        raise ValueError(
            f"FASTPAR_CUDA=1 but no CUDA build is possible: torch.version.cuda={torch.version.cuda!r}, "
            f"{toolkit.looked}. Install a CUDA build of torch and set CUDA_HOME to the toolkit folder whose "
            f"{CUDA_HEADER} exists."
        )
    if with_cuda:
        use_cuda_home(toolkit.root)
        return True, f"building the CUDA kernels with the toolkit in {toolkit.root}"
    if torch.version.cuda is not None and not usable:
        return False, (
            f"building the CPU extension only: torch {torch.__version__} is a CUDA build but {toolkit.looked}; "
            "set CUDA_HOME to the CUDA toolkit folder to build the CUDA kernels too"
        )
    return False, None


def cuda_toolkit_usable(torch: ModuleType) -> bool:
    """A CUDA build of torch and a CUDA toolkit with its headers to compile against; when one is found,
    torch's cpp_extension is pointed at it (see ``find_cuda_home``)."""
    if torch.version.cuda is None:
        return False
    toolkit = find_cuda_home()
    if toolkit.root is None:
        return False
    use_cuda_home(toolkit.root)
    return True


def with_cpu_fallback(build_ext_class: type, to_cpu: Callable[[object], None], say: Callable[[str], None]) -> type:
    """``build_ext_class`` (torch's BuildExtension) whose failed CUDA build is retried once as the CPU extension:
    ``to_cpu`` turns each extension into its CPU build, ``say`` reports the switch in one line. A toolkit whose
    headers exist can still fail to compile (a CUDA version torch refuses, an nvcc that rejects the host
    compiler); the CPU extension builds regardless, so the install does not fail for it."""

    class BuildWithCpuFallback(build_ext_class):
        def build_extensions(self):
            try:
                super().build_extensions()
            except Exception as exc:  # any failure of the CUDA build: the CPU build is the answer
                reason = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
                say(
                    f"the CUDA kernels did not build ({reason}); building the CPU extension instead "
                    "(FASTPAR_CUDA=0 skips the CUDA attempt, FASTPAR_CUDA=1 makes its failure an error)"
                )
                for extension in self.extensions:
                    to_cpu(extension)
                self.force = True  # objects compiled for the CUDA build must not be reused
                super().build_extensions()

    return BuildWithCpuFallback


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
