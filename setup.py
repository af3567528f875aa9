"""Builds the extension ``fastpar._C`` with torch.utils.cpp_extension.

CppExtension with a CPU-only torch; CUDAExtension when torch is a CUDA build and nvcc is found.
FASTPAR_CUDA=0|1 overrides the choice; FASTPAR_NO_EXT=1 builds no extension (pure-torch ops).
Build without isolation so the extension links against the torch you run: `pip install --no-build-isolation .`
"""

import os
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"


class BuildPyWithSources(build_py):
    """Ship csrc/ inside the package as fastpar/_csrc so a wheel without a prebuilt _C can JIT-build."""

    def run(self):
        super().run()
        target = Path(self.build_lib) / "fastpar" / "_csrc"
        if CSRC.is_dir():
            shutil.copytree(CSRC, target, dirs_exist_ok=True)


def _extensions():
    if os.environ.get("FASTPAR_NO_EXT") == "1":
        return [], {}
    import torch
    from torch.utils import cpp_extension

    flag = os.environ.get("FASTPAR_CUDA", "")
    cuda_usable = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    if flag not in ("", "0", "1"):
        raise SystemExit(f"FASTPAR_CUDA must be 0 or 1, got {flag!r}")
    with_cuda = cuda_usable if flag == "" else flag == "1"
    if with_cuda and not cuda_usable:
        raise SystemExit(
            "FASTPAR_CUDA=1 but no CUDA build is possible: torch.version.cuda="
            f"{torch.version.cuda!r}, CUDA_HOME={cpp_extension.CUDA_HOME!r}. Install a CUDA build of torch "
            "and set CUDA_HOME to the toolkit folder whose include/ holds cuda_runtime_api.h."
        )
    sources = [str(p.relative_to(ROOT)) for p in sorted(CSRC.glob("*.cpp"))]
    # -ffp-contract=off: no fused multiply-add, so results match the pure-torch reference bit for bit.
    # -fopenmp: at::parallel_for is a header-inline `omp parallel` when torch's backend is OpenMP; without the
    # flag it silently runs on one thread.
    openmp = ["-fopenmp"] if "parallel backend: OpenMP" in torch.__config__.parallel_info() else []
    cxx = ["-O3", "-ffp-contract=off", *openmp]
    link = [*openmp, "-lrt"]  # shm_open/shm_unlink (fastpar backend) live in librt before glibc 2.34
    if with_cuda:
        sources += [str(p.relative_to(ROOT)) for p in sorted((CSRC / "cuda").glob("*.cu"))]
        ext = cpp_extension.CUDAExtension(
            "fastpar._C",
            sources,
            include_dirs=[str(CSRC)],
            define_macros=[("FASTPAR_WITH_CUDA", None)],
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "--fmad=false"]},
            extra_link_args=link,
        )
    else:
        ext = cpp_extension.CppExtension(
            "fastpar._C", sources, include_dirs=[str(CSRC)], extra_compile_args=cxx, extra_link_args=link
        )
    return [ext], {"build_ext": cpp_extension.BuildExtension}


ext_modules, cmdclass = _extensions()
cmdclass["build_py"] = BuildPyWithSources
setup(ext_modules=ext_modules, cmdclass=cmdclass)
