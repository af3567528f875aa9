"""PyTorch's own DDP tests (``torch.testing._internal.distributed.distributed_test``) with fastpar's class.

``tests/compat/_torch_ddp_suite.py`` runs them as torch's CI does on a CPU-only machine (gloo, WORLD_SIZE=3,
``TestDistBackend`` + ``DistributedTest._DistTestBase``, spawned ranks), after replacing
``torch.nn.parallel.DistributedDataParallel`` by ``fastpar.DistributedDataParallel`` in every rank. One pytest
item per torch DDP test: those torch itself skips here (GPU-only, flaky) are skipped with torch's reason; the
rest run once, in one runner process, when the first of them runs.

    python -m pytest -q tests/compat/test_torch_ddp_suite.py                 # ~12 spawned tests
    WORLD_SIZE=3 python tests/compat/_torch_ddp_suite.py --impl torch        # the same tests on stock torch
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_torch_ddp_suite.py")
WORLD_SIZE = "3"  # what torch's CI uses for gloo on a machine without 2 GPUs (run_test.py)
RUNNER_TIMEOUT_S = 2400

# torch tests that fail with today's fastpar, by root cause (none now). The xfail marks are strict, so a test that
# starts passing fails until its entry is removed. Where fastpar's default differs from torch's by design, the
# runner passes torch's value explicitly instead (_torch_ddp_suite.EXPLICIT_ARGUMENTS).
EXPECTED_TO_FAIL_TODAY: dict[str, str] = {}

# tests whose body never builds a DDP wrapper (so a pass proves nothing about fastpar's class, and says so)
BUILDS_NO_DDP = {"test_dump_DDP_relevant_env_vars"}


def _runner_env() -> dict[str, str]:
    env = dict(os.environ, WORLD_SIZE=WORLD_SIZE, BACKEND="gloo", PYTORCH_PRINT_REPRO_ON_FAILURE="0")
    env.pop("TEMP_DIR", None)  # torch's setUp makes a fresh one per test
    return env


def _list_tests() -> dict[str, str | None]:
    """{torch DDP test: why it skips without running, or None}; empty if torch's test module cannot load."""
    proc = subprocess.run(
        [sys.executable, RUNNER, "--list"], env=_runner_env(), capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        _LOAD_ERRORS.append(tail)
        return {}
    return json.loads(proc.stdout)


_LOAD_ERRORS: list[str] = []
TESTS = _list_tests()


def _param(name: str, skip_reason: str | None):
    marks = []
    if skip_reason is not None:
        marks.append(pytest.mark.skip(reason=f"torch skips it here: {skip_reason}"))
    elif name in EXPECTED_TO_FAIL_TODAY:
        marks.append(pytest.mark.xfail(strict=True, reason=EXPECTED_TO_FAIL_TODAY[name]))
    return pytest.param(name, marks=marks, id=name)


@pytest.fixture(scope="module")
def suite_results(request, tmp_path_factory) -> dict[str, dict]:
    """Runs every selected, runnable torch test in one runner process (each spawns its own ranks)."""
    selected = [
        item.callspec.params["name"]
        for item in request.session.items
        if item.module is request.module
        and item.originalname == "test_torch_ddp"
        and TESTS.get(item.callspec.params["name"], "") is None
    ]
    out = tmp_path_factory.mktemp("torch_ddp_suite")
    log = out / "runner.log"
    with open(log, "w") as f:
        proc = subprocess.run(
            [sys.executable, RUNNER, "--impl", "fastpar", "--json", str(out / "results.json"), *selected],
            env=_runner_env(),
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=RUNNER_TIMEOUT_S,
        )
    if proc.returncode != 0:
        tail = log.read_text()[-4000:]
        raise RuntimeError(f"the torch DDP suite runner exited with {proc.returncode}; log: {log}\n{tail}")
    return json.loads((out / "results.json").read_text())


def test_torch_ddp_suite_loads():
    """torch's test module imports (it needs expecttest) and still has the DDP tests this file expects."""
    if _LOAD_ERRORS and "ModuleNotFoundError" in _LOAD_ERRORS[0]:  # CI installs them: .ci/run
        pytest.skip(
            f"torch's distributed test module needs a package: {_LOAD_ERRORS[0]} (pip install 'fastpar[compat]')"
        )
    assert not _LOAD_ERRORS, f"torch's distributed test module did not load: {_LOAD_ERRORS[0]}"
    stale = sorted(set(EXPECTED_TO_FAIL_TODAY) - set(TESTS))
    assert not stale, f"EXPECTED_TO_FAIL_TODAY names tests this torch does not have: {stale}"
    assert sum(reason is None for reason in TESTS.values()) >= 10, "torch's suite runs almost no DDP test here"


@pytest.mark.slow
@pytest.mark.parametrize("name", [_param(name, reason) for name, reason in TESTS.items()])
def test_torch_ddp(name, suite_results):
    result = suite_results[name]
    if result["outcome"] == "skipped":  # a skip inside the test body (e.g. backend-specific)
        pytest.skip(f"torch skipped it in the ranks: {result['message']}")
    assert result["outcome"] == "passed", f"{name} failed with fastpar's DDP:\n{result['message']}"
    if name not in BUILDS_NO_DDP:
        assert result["fastpar_built"] > 0, f"{name} passed without building fastpar's DDP: the swap did not reach it"
