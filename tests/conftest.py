"""Shared test setup: the fast default suite (``--full`` adds the tests marked ``slow``), loopback-only process
groups, CUDA skipping, and a clean extension state."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

HAS_CUDA = torch.cuda.is_available()


FULL_SUITE_COMMAND = "python -m pytest -q tests --full"
_LEFT_OUT = pytest.StashKey[int]()  # how many slow tests the default run deselected


def pytest_addoption(parser):
    parser.addoption(
        "--full",
        action="store_true",
        default=False,
        help="run the whole suite, including the tests marked 'slow' (the default run leaves them out)",
    )


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU; none is visible")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_cuda)
    if config.getoption("--full"):
        return
    # The default run answers in minutes: every part keeps its cheapest end-to-end tests, and the rest (more
    # ranks, more shapes, more models of the same check) is deselected, not skipped, so that the summary
    # counts what was left out instead of reporting it as passed or skipped.
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item.get_closest_marker("slow") is None]
    config.stash[_LEFT_OUT] = len(slow)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    left_out = config.stash.get(_LEFT_OUT, 0)
    if left_out:
        terminalreporter.write_line(
            f"fast suite: {left_out} {'test' if left_out == 1 else 'tests'} marked 'slow' left out (deselected); "
            f"run everything with: {FULL_SUITE_COMMAND}"
        )


@pytest.fixture
def no_process_group():
    """Destroys any process group a test left behind in this process."""
    import torch.distributed as dist

    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def fresh_loader(monkeypatch):
    """Lets a test re-run fastpar's extension loader under its own conditions (returns ``monkeypatch`` to set
    them); the real state is restored afterwards."""
    from fastpar.ops import loader

    loader._reset_for_tests()
    yield monkeypatch
    monkeypatch.undo()
    loader._reset_for_tests()
