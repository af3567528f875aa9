"""Shared test setup: loopback-only process groups, CUDA skipping, and a clean extension state."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU; none is visible")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_cuda)


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
