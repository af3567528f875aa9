"""Installing fastpar: setup.py builds on any machine, and README's install lines are ones that work.

- A CUDA build with no GPU visible and no TORCH_CUDA_ARCH_LIST targets a stated list of architectures
  (torch would otherwise ask the missing GPU and raise).
- A CUDA torch builds against the toolkit nvcc belongs to, found through a wrapper script or a symlink on the
  PATH; with no usable toolkit, or a CUDA build that fails, it builds the CPU extension and says so in one line.
- pyproject.toml's torch range starts at the oldest torch CI installs; the test extra installs what the tests
  import; [all] is every extra.
- Every README line that installs fastpar itself builds without isolation: an isolated build compiles the
  extension against whatever torch pip fetches for it (a CUDA torch, gigabytes, not the one you run).
  CI also runs those lines as written in a fresh clone (scripts/check-readme-install.py).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load(path: Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


build = _load(ROOT / "fastpar" / "ops" / "build.py", "_fastpar_build_under_test")
readme_check = _load(ROOT / "scripts" / "check-readme-install.py", "_readme_install_check")


def _fake_torch(gpus: int, archs: list[str]) -> types.SimpleNamespace:
    cuda = types.SimpleNamespace(device_count=lambda: gpus, get_arch_list=lambda: archs)
    return types.SimpleNamespace(cuda=cuda)


@pytest.mark.parametrize(
    "gpus, archs, environ, expected",
    [
        (
            0,
            ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"],
            {},
            "7.5;8.0;8.6;9.0;10.0;12.0+PTX",
        ),
        (0, [], {}, build.FALLBACK_CUDA_ARCHS),  # torch doesn't say: the stated default
        (0, ["sm_80"], {"TORCH_CUDA_ARCH_LIST": "9.0"}, None),  # the user's choice stands
        (1, ["sm_80", "sm_90"], {}, None),  # a GPU is visible: torch builds for it
    ],
)
def test_cuda_build_without_a_gpu_gets_a_stated_arch_list(gpus, archs, environ, expected):
    assert build.default_cuda_archs(_fake_torch(gpus, archs), environ) == expected


def test_fallback_arch_list_is_one_torch_accepts():
    from torch.utils import cpp_extension

    if not hasattr(cpp_extension, "_get_cuda_arch_flags"):
        pytest.skip("this torch has no _get_cuda_arch_flags")
    import os

    old = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = build.FALLBACK_CUDA_ARCHS
    try:
        flags = cpp_extension._get_cuda_arch_flags()
    finally:
        if old is None:
            del os.environ["TORCH_CUDA_ARCH_LIST"]
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = old
    assert "-gencode=arch=compute_90,code=compute_90" in flags and "-gencode=arch=compute_75,code=sm_75" in flags


def test_readme_lines_install_this_checkout_without_build_isolation():
    lines = readme_check.install_lines((ROOT / "README.md").read_text())
    assert lines, "README has no line installing fastpar"
    wrong = {line: found for line in lines if (found := readme_check.problems(line))}
    assert not wrong, f"README lines that would not install fastpar as written: {wrong}"


def test_install_lines_are_found_in_code_blocks_and_inline_code():
    text = """Install:

```bash
python3 -m venv .venv && pip install torch && pip install --no-build-isolation -e .
pip install numpy
```
Extras: `pip install -e '.[jobs]'` or `pip install 'fastpar[s3]'`.
"""
    lines = readme_check.install_lines(text)
    assert lines == [
        "python3 -m venv .venv && pip install torch && pip install --no-build-isolation -e .",
        "pip install -e '.[jobs]'",
        "pip install 'fastpar[s3]'",
    ]
    assert [readme_check.problems(line) for line in lines] == [
        [],
        ["builds with isolation (add --no-build-isolation)"],
        [
            "builds with isolation (add --no-build-isolation)",
            "installs the name fastpar from the package index, not this checkout (use . or '.[extra]')",
        ],
    ]


# --- finding the CUDA toolkit: nvcc on the PATH may be a wrapper script outside the toolkit folder ---


def _script(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return path


def _toolkit(root: Path) -> Path:
    """A folder that looks like a CUDA toolkit: its header, and an nvcc that reports its TOP as nvcc does."""
    (root / "include").mkdir(parents=True)
    (root / "include" / "cuda_runtime_api.h").write_text("")
    _script(root / "bin" / "nvcc", f"echo '#$ TOP={root}/bin/..' >&2")
    return root


@pytest.fixture
def bare_path(tmp_path, monkeypatch):
    """PATH holds only a folder the test fills (plus /bin for sh); CUDA_HOME / CUDA_PATH unset."""
    wrappers = tmp_path / "wrappers"
    wrappers.mkdir()
    monkeypatch.setenv("PATH", f"{wrappers}:/bin:/usr/bin")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    return wrappers


def _find(tmp_path: Path, **kwargs):
    # no system-wide guesses: only what the test sets up counts
    return build.find_cuda_home(default_roots=(), versioned_glob=str(tmp_path / "no-such-cuda-*"), **kwargs)


def test_toolkit_is_found_through_an_nvcc_wrapper_script(tmp_path, bare_path):
    toolkit = _toolkit(tmp_path / "opt" / "cuda-13.0")
    _script(bare_path / "nvcc", f'exec {toolkit}/bin/nvcc "$@"')
    # torch's own guess, the folder above the wrapper, holds no CUDA header
    assert not (bare_path.parent / "include" / "cuda_runtime_api.h").exists()
    assert _find(tmp_path) == build.CudaToolkit(toolkit.resolve())


def test_toolkit_is_found_through_a_symlinked_nvcc(tmp_path, bare_path):
    toolkit = _toolkit(tmp_path / "cuda-12.8")
    (bare_path / "nvcc").symlink_to(toolkit / "bin" / "nvcc")
    _script(toolkit / "bin" / "nvcc", "exit 1")  # reports nothing: the symlink alone leads there
    assert _find(tmp_path).root == toolkit.resolve()


def test_real_nvcc_behind_a_wrapper_reports_its_toolkit(tmp_path, monkeypatch):
    import shutil

    real = shutil.which("nvcc")  # on some machines itself a wrapper: wrapped twice, still found
    if real is None:
        pytest.skip("no nvcc on the PATH")
    _script(tmp_path / "wrappers" / "nvcc", f'exec {real} "$@"')
    monkeypatch.setenv("PATH", f"{tmp_path / 'wrappers'}:/bin:/usr/bin")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    root = _find(tmp_path).root
    assert root is not None and (root / "include" / "cuda_runtime_api.h").is_file()


def test_cuda_home_is_the_only_candidate_when_set(tmp_path, bare_path, monkeypatch):
    toolkit = _toolkit(tmp_path / "cuda")
    _script(bare_path / "nvcc", f'exec {toolkit}/bin/nvcc "$@"')
    monkeypatch.setenv("CUDA_HOME", str(toolkit))
    assert _find(tmp_path).root == toolkit
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "empty"))  # the user's choice, wrong: said, not overridden
    found = _find(tmp_path)
    assert found.root is None and f"CUDA_HOME={tmp_path / 'empty'} has no include/cuda_runtime_api.h" in found.looked


def test_newest_versioned_toolkit_is_the_last_resort(tmp_path, bare_path):
    for version in ("12.9", "12.10", "11.8"):
        _toolkit(tmp_path / f"cuda-{version}")
    found = build.find_cuda_home(default_roots=(str(tmp_path / "cuda"),), versioned_glob=str(tmp_path / "cuda-*"))
    assert found.root == tmp_path / "cuda-12.10"


def test_no_toolkit_says_where_it_looked(tmp_path, bare_path):
    _script(bare_path / "nvcc", "exit 127")  # a wrapper whose target is gone
    found = _find(tmp_path)
    assert found.root is None and str(bare_path.parent) in found.looked


def _cuda_torch() -> types.SimpleNamespace:
    return types.SimpleNamespace(version=types.SimpleNamespace(cuda="13.0"), __version__="2.14.1+cu130")


def test_cuda_torch_without_a_toolkit_builds_the_cpu_extension_and_says_so(monkeypatch):
    monkeypatch.delenv("FASTPAR_CUDA", raising=False)
    missing = build.CudaToolkit(None, "no include/cuda_runtime_api.h under /usr/local")
    with_cuda, line = build.choose_cuda(_cuda_torch(), find=lambda: missing)
    assert not with_cuda and line.startswith("building the CPU extension only") and "\n" not in line
    monkeypatch.setenv("FASTPAR_CUDA", "1")  # asked for CUDA explicitly: an error naming what is missing
    with pytest.raises(ValueError, match="no include/cuda_runtime_api.h under /usr/local"):
        build.choose_cuda(_cuda_torch(), find=lambda: missing)


def test_cuda_torch_with_a_toolkit_points_cpp_extension_at_it(tmp_path, monkeypatch):
    monkeypatch.delenv("FASTPAR_CUDA", raising=False)
    monkeypatch.delenv("CUDA_HOME", raising=False)  # restored after the test: choose_cuda sets it
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    toolkit = _toolkit(tmp_path / "cuda-13.0")
    with_cuda, line = build.choose_cuda(_cuda_torch(), find=lambda: build.CudaToolkit(toolkit))
    assert with_cuda and str(toolkit) in line
    assert os.environ["CUDA_HOME"] == str(toolkit) and cpp_extension.CUDA_HOME == str(toolkit)


# A stand-in for a CUDA build of torch, just enough for setup.py: its cpp_extension guesses CUDA_HOME the way torch
# does (the folder above the first nvcc on the PATH), and its CUDAExtension fails as the compile would when that
# folder holds no CUDA header.
_FAKE_TORCH = {
    "torch/__init__.py": """
import types
__version__ = "2.14.1+cu130"
version = types.SimpleNamespace(cuda="13.0")
__config__ = types.SimpleNamespace(parallel_info=lambda: "ATen parallel backend: native thread pool")
cuda = types.SimpleNamespace(device_count=lambda: 1, get_arch_list=lambda: ["sm_90"])
""",
    "torch/utils/__init__.py": "",
    "torch/utils/cpp_extension.py": """
import os, shutil, sys
from setuptools import Extension
from setuptools.command.build_ext import build_ext as BuildExtension
nvcc = shutil.which("nvcc")
CUDA_HOME = os.environ.get("CUDA_HOME") or (os.path.dirname(os.path.dirname(nvcc)) if nvcc else None)
def CppExtension(name, sources, **kwargs):
    return Extension(name, sources)
def CUDAExtension(name, sources, **kwargs):
    if not os.path.isfile(os.path.join(CUDA_HOME, "include", "cuda_runtime.h")):
        sys.exit(f"fatal error: cuda_runtime.h: No such file or directory (CUDA_HOME={CUDA_HOME})")
    print(f"CUDAExtension with CUDA_HOME={CUDA_HOME}", file=sys.stderr)
    return Extension(name, sources)
""",
}


def _setup_with_fake_cuda_torch(tmp_path: Path, **env_vars: str) -> subprocess.CompletedProcess:
    fake = tmp_path / "fake_torch"
    for name, text in _FAKE_TORCH.items():
        (fake / name).parent.mkdir(parents=True, exist_ok=True)
        (fake / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH", "FASTPAR_CUDA", "FASTPAR_NO_EXT")}
    env.update(PYTHONPATH=str(fake), **env_vars)
    return subprocess.run(
        [sys.executable, "setup.py", "--version"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_setup_with_a_wrapper_nvcc_builds_against_the_real_toolkit(tmp_path, bare_path):
    toolkit = _toolkit(tmp_path / "opt" / "cuda-13.0")
    (toolkit / "include" / "cuda_runtime.h").write_text("")
    _script(bare_path / "nvcc", f'exec {toolkit}/bin/nvcc "$@"')
    done = _setup_with_fake_cuda_torch(tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"CUDAExtension with CUDA_HOME={toolkit.resolve()}" in done.stderr


def test_setup_with_a_cuda_torch_and_no_usable_toolkit_builds_the_cpu_extension(tmp_path, bare_path):
    (tmp_path / "not-a-toolkit").mkdir()
    done = _setup_with_fake_cuda_torch(tmp_path, CUDA_HOME=str(tmp_path / "not-a-toolkit"))
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if line.startswith("fastpar setup:")]
    assert len(said) == 1 and "building the CPU extension only" in said[0], done.stderr


# --- what pyproject.toml promises: the extras and the torch range are ones CI installs ---


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _expand(extras: dict[str, list[str]], name: str) -> set[str]:
    """The distribution names extra ``name`` installs, following ``fastpar[a,b]`` self-references."""
    found = set()
    for requirement in extras[name]:
        if requirement.startswith("fastpar["):
            for inner in requirement[len("fastpar[") : requirement.index("]")].split(","):
                found |= _expand(extras, inner.strip())
        else:
            found.add(re.split(r"[\[<>=!~ ;]", requirement, maxsplit=1)[0].lower())
    return found


def test_all_extra_installs_every_extra():
    extras = _pyproject()["project"]["optional-dependencies"]
    everything = set().union(*(_expand(extras, name) for name in extras if name != "all"))
    assert _expand(extras, "all") == everything


# The modules the tests skip without (pytest.importorskip, available(...)) and the distribution that brings each.
# The DALI and CuPy tiers are large CUDA downloads: their own extras, said in README's test section.
_TEST_MODULE_DISTRIBUTIONS = {
    "submitit": "submitit",
    "pandas": "pandas",
    "moto": "moto",
    "lightning": "lightning",
    "accelerate": "accelerate",
    "fsspec": "fsspec",
    "boto3": "boto3",
    "PIL.Image": "pillow",
    "PIL": "pillow",
    "matplotlib": "matplotlib",
    "tokenizers": "tokenizers",
    "tqdm": None,  # a dependency of fastpar itself
    "tomllib": None,  # the standard library from Python 3.11
    "cupy": None,
    "nvidia.dali": None,
}


def test_test_extra_installs_what_the_tests_skip_without():
    extras = _pyproject()["project"]["optional-dependencies"]
    test_extra = _expand(extras, "test")
    pattern = re.compile(r"""(?:importorskip|available)\(\s*["']([\w.]+)["']""")
    modules = {m for path in (ROOT / "tests").rglob("*.py") for m in pattern.findall(path.read_text())}
    unknown = modules - _TEST_MODULE_DISTRIBUTIONS.keys()
    assert not unknown, f"tests skip without {sorted(unknown)}: add each to the test extra and to this table"
    wanted = {dist for module, dist in _TEST_MODULE_DISTRIBUTIONS.items() if dist and module in modules}
    # torch's own DDP tests import expecttest (tests/compat); `pytest -n 2` needs pytest-xdist
    wanted |= {"expecttest", "pytest-xdist", "pytest", "pytest-timeout"}
    assert wanted <= test_extra, f"the test extra lacks {sorted(wanted - test_extra)}"


def test_readme_installs_the_test_extra_before_its_test_command():
    readme = (ROOT / "README.md").read_text()
    setup = readme.find("pip install --no-build-isolation -e '.[test]'")
    assert setup != -1, "README's test section should install the test extra"
    assert setup < readme.index("python -m pytest -q tests")


def _torch_pins(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(n) for n in v.split(".")) for v in re.findall(r"\btorch==(\d+\.\d+(?:\.\d+)?)", text)]


def test_torch_lower_bound_is_the_oldest_torch_ci_tests():
    project = _pyproject()
    bounds = {
        where: re.fullmatch(r"torch>=(\d+\.\d+)", requirement).group(1)
        for where, requirements in (
            ("dependencies", project["project"]["dependencies"]),
            ("build-system requires", project["build-system"]["requires"]),
        )
        for requirement in requirements
        if requirement.startswith("torch")
    }
    pins = _torch_pins((ROOT / ".ci" / "run").read_text())
    assert pins, ".ci/run pins no torch version"
    oldest = ".".join(str(n) for n in min(pins)[:2])
    assert bounds == {"dependencies": oldest, "build-system requires": oldest}, (
        f"pyproject.toml accepts torch {bounds} but the oldest torch CI installs is {oldest}"
    )
    install_guide = (ROOT / "docs" / "guide" / "install.md").read_text()
    for pin in {".".join(map(str, p)) for p in pins}:
        assert f"torch {pin}" in install_guide or f"torch=={pin}" in install_guide, f"install guide omits {pin}"


def test_a_failed_cuda_build_is_retried_as_the_cpu_extension(tmp_path, monkeypatch):
    """A CUDA build that fails to compile (here: a source that cannot) is built again from the CPU sources, said in
    one line; the install goes on."""
    from setuptools import Distribution, Extension
    from torch.utils import cpp_extension

    (tmp_path / "cuda_part.cpp").write_text('#error "stands for a CUDA compile that fails"\n')
    (tmp_path / "cpu_part.cpp").write_text("int fastpar_probe() { return 1; }\n")
    monkeypatch.chdir(tmp_path)
    said = []

    def to_cpu(extension):
        extension.sources = ["cpu_part.cpp"]

    build_ext = build.with_cpu_fallback(cpp_extension.BuildExtension, to_cpu, said.append)
    dist = Distribution({"ext_modules": [Extension("probe", ["cuda_part.cpp"])], "cmdclass": {"build_ext": build_ext}})
    command = dist.get_command_obj("build_ext")
    command.build_lib, command.build_temp = str(tmp_path / "lib"), str(tmp_path / "temp")
    dist.run_command("build_ext")
    assert list((tmp_path / "lib").glob("probe*.so")), "the CPU build produced no extension"
    assert len(said) == 1 and "building the CPU extension instead" in said[0] and "\n" not in said[0], said
