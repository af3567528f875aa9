"""Builds the extension ``fastpar._C`` with torch.utils.cpp_extension.

CppExtension with a CPU-only torch; CUDAExtension when torch is a CUDA build and a CUDA toolkit with its headers
is found (fastpar/ops/build.py's find_cuda_home, which follows an nvcc wrapper script to the real toolkit; with no
GPU visible and no TORCH_CUDA_ARCH_LIST, for the architectures torch was built for, said in one line). A CUDA torch
with no usable toolkit builds the CPU extension, said in one line: the install never fails for want of CUDA.
FASTPAR_CUDA=0|1 overrides the choice; FASTPAR_NO_EXT=1 builds no extension (pure-torch ops).
Build without isolation so the extension links against the torch you run: `pip install --no-build-isolation .`
(an isolated build links against whatever torch pip fetched for it, also said in one line).
"""

import importlib.util
import os
import shutil
import sys
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


def _build_config():
    """fastpar/ops/build.py, loaded by path: importing the package would need it built already."""
    spec = importlib.util.spec_from_file_location("_fastpar_build", ROOT / "fastpar" / "ops" / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _say(line: str) -> None:
    print(f"fastpar setup: {line}", file=sys.stderr, flush=True)


def _extensions():
    if os.environ.get("FASTPAR_NO_EXT") == "1":
        return [], {}
    import torch

    build = _build_config()
    try:
        # before cpp_extension is imported: it reads CUDA_HOME once, and choose_cuda sets it to the toolkit it found
        with_cuda, line = build.choose_cuda(torch)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if line:
        _say(line)
    from torch.utils import cpp_extension

    if "pip-build-env" in torch.__file__:
        _say(
            f"building against pip's isolated torch {torch.__version__}, not the torch you run; if they differ "
            "fastpar's loader falls back to a JIT build or the torch ops. Build with `pip install --no-build-isolation ...` to link yours"
        )
    if with_cuda and (archs := build.default_cuda_archs(torch)) is not None:
        os.environ["TORCH_CUDA_ARCH_LIST"] = archs
        _say(
            f"no GPU visible and TORCH_CUDA_ARCH_LIST unset: building the CUDA kernels for {archs} "
            "(torch's own targets; set TORCH_CUDA_ARCH_LIST to choose, or FASTPAR_CUDA=0 for the CPU build)"
        )

    def cpu_extension():
        cfg = build.config(CSRC, torch, with_cuda=False)
        return cpp_extension.CppExtension(
            "fastpar._C",
            [str(p.relative_to(ROOT)) for p in cfg.sources],
            include_dirs=[str(CSRC)],
            extra_compile_args=cfg.cxx_flags,
            extra_link_args=cfg.ldflags,
        )

    if not with_cuda:
        return [cpu_extension()], {"build_ext": cpp_extension.BuildExtension}
    cfg = build.config(CSRC, torch, with_cuda=True)
    ext = cpp_extension.CUDAExtension(
        "fastpar._C",
        [str(p.relative_to(ROOT)) for p in cfg.sources],
        include_dirs=[str(CSRC)],
        extra_compile_args={"cxx": cfg.cxx_flags, "nvcc": cfg.nvcc_flags},
        extra_link_args=cfg.ldflags,
    )
    if os.environ.get("FASTPAR_CUDA") == "1":  # asked for CUDA: its failure is the user's error to see
        return [ext], {"build_ext": cpp_extension.BuildExtension}

    def to_cpu(extension):
        vars(extension).update(vars(cpu_extension()))

    return [ext], {"build_ext": build.with_cpu_fallback(cpp_extension.BuildExtension, to_cpu, _say)}


def _keep_objects(build_ext_class):
    """An editable install (``pip install -e .``, again with extras) compiles in a new temporary folder each time:
    compile in ``build/`` instead, one folder per platform, Python and torch, so that ninja recompiles only the
    sources that changed (it also rebuilds what was compiled with other flags)."""

    class KeepObjects(build_ext_class):
        def finalize_options(self):
            super().finalize_options()
            if not (getattr(self, "editable_mode", False) or self.inplace):
                return
            import sysconfig

            import torch

            tag = f"{sysconfig.get_platform()}-{sys.implementation.cache_tag}-torch{torch.__version__}"
            folder = ROOT / "build" / f"objects-{tag}"
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError:  # a read-only checkout: the temporary folder it is
                return
            self.build_temp = str(folder)

    return KeepObjects


ext_modules, cmdclass = _extensions()
if "build_ext" in cmdclass:
    cmdclass["build_ext"] = _keep_objects(cmdclass["build_ext"])
cmdclass["build_py"] = BuildPyWithSources
setup(ext_modules=ext_modules, cmdclass=cmdclass)
