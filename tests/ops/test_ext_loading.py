"""How fastpar finds its extension: status structure, forced fallback, one warning when nothing loads."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

import fastpar
from fastpar import ops
from fastpar.ops import loader


def test_ext_status_structure():
    status = fastpar.ext_status()
    assert set(status) == {"backend", "reason", "cuda", "cpu", "nvrtc"}
    assert status["backend"] in ("compiled", "cupy", "jit", "torch")
    assert status["cpu"] in ("compiled", "jit", "torch")
    assert isinstance(status["reason"], str) and status["reason"]
    assert isinstance(status["cuda"], bool)
    assert (status["nvrtc"] is not None) == (status["backend"] == "cupy")
    module = loader.extension()
    assert (module is None) == (status["cpu"] == "torch")
    if module is not None:
        if status["backend"] != "cupy":
            assert status["cuda"] == module.has_cuda()
        assert ops._impl(torch.device("cpu")) is module
        assert ops.last_implementation("cpu") == status["cpu"]


@pytest.mark.skipif("FASTPAR_EXPECT_EXT" not in os.environ, reason="set FASTPAR_EXPECT_EXT=compiled|jit to require it")
def test_expected_backend_is_live():
    """CI builds the extension first and sets FASTPAR_EXPECT_EXT, so a broken build cannot hide behind the fallback."""
    status = fastpar.ext_status()
    assert status["backend"] == os.environ["FASTPAR_EXPECT_EXT"], status["reason"]


def test_failed_load_warns_once_and_falls_back(fresh_loader):
    def no_module(name):
        raise ImportError(f"No module named {name!r}")

    def no_compiler():
        raise RuntimeError("Ninja is required to load C++ extensions\nmore detail")

    fresh_loader.setenv("FASTPAR_EXT", "auto")
    fresh_loader.setattr(loader.importlib, "import_module", no_module)
    fresh_loader.setattr(loader, "_jit_build", no_compiler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert loader.extension() is None
        status = fastpar.ext_status()
        out = ops.pack([torch.ones(2)], torch.zeros(2), 0.5)
    assert [type(w.message) for w in caught] == [RuntimeWarning]
    assert "pure-torch ops" in str(caught[0].message) and "FASTPAR_EXT=torch" in str(caught[0].message)
    assert status["backend"] == "torch"
    assert "no prebuilt fastpar._C" in status["reason"] and "Ninja is required" in status["reason"]
    assert out.tolist() == [0.5, 0.5]


def test_unknown_mode_warns_and_uses_auto(fresh_loader):
    fresh_loader.setenv("FASTPAR_EXT", "fastest")
    with pytest.warns(UserWarning, match="FASTPAR_EXT='fastest' is not one of auto"):
        status = fastpar.ext_status()
    assert status["backend"] in ("compiled", "jit", "torch")


def test_forced_torch_backend_in_a_fresh_process():
    code = (
        "import fastpar, torch\n"
        "from fastpar import ops\n"
        "s = fastpar.ext_status()\n"
        "assert s['backend'] == 'torch' and 'FASTPAR_EXT=torch' in s['reason'] and not s['cuda'], s\n"
        "out = ops.pack([torch.ones(3)], torch.zeros(3), 2.0)\n"
        "assert out.tolist() == [2.0, 2.0, 2.0]\n"
        "print('ok')\n"
    )
    env = dict(os.environ, FASTPAR_EXT="torch")
    # -W error: choosing the fallback explicitly must not warn
    result = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


needs_jit = pytest.mark.skipif(
    os.environ.get("FASTPAR_TEST_JIT") != "1", reason="compiles the extension (~1 min); FASTPAR_TEST_JIT=1"
)


@pytest.fixture(scope="module")
def jit_dir(tmp_path_factory):
    """A JIT cache built by three processes starting at once, as ranks of a job do: the file lock must
    let one build while the others wait, then all load the same module."""
    cache = tmp_path_factory.mktemp("jit")
    code = "import fastpar; s = fastpar.ext_status(); print(s['backend'], s['reason'])"
    env = dict(os.environ, FASTPAR_EXT="jit", FASTPAR_JIT_DIR=str(cache))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    outputs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0 and out.startswith("jit "), f"stdout: {out}\nstderr: {err}"
    assert len({out.split(" ", 1)[1] for out, _ in outputs}) == 1  # one build directory for all
    return cache


@needs_jit
def test_jit_build_loads_and_matches(fresh_loader, jit_dir):
    fresh_loader.setenv("FASTPAR_EXT", "jit")
    fresh_loader.setenv("FASTPAR_JIT_DIR", str(jit_dir))
    status = fastpar.ext_status()
    assert status["backend"] == "jit", status["reason"]
    tensors = [torch.randn(1000), torch.randn(7).half()]
    out, expected = torch.zeros(1007, dtype=torch.bfloat16), torch.zeros(1007, dtype=torch.bfloat16)
    ops.pack(tensors, out, 1 / 3)
    from fastpar.ops import reference

    reference.pack(tensors, expected, 1 / 3)
    assert torch.equal(out, expected)
