"""Installing fastpar: setup.py builds on any machine, and README's install lines are ones that work.

- A CUDA build with no GPU visible and no TORCH_CUDA_ARCH_LIST targets a stated list of architectures
  (torch would otherwise ask the missing GPU and raise).
- Every README line that installs fastpar itself builds without isolation: an isolated build compiles the
  extension against whatever torch pip fetches for it (a CUDA torch, gigabytes, not the one you run).
  CI also runs those lines as written in a fresh clone (scripts/check-readme-install.py).
"""

from __future__ import annotations

import importlib.util
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
