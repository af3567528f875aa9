"""Shared set-up of the benchmark tests: each runs as a plain process, whatever launched pytest."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _not_under_torchrun(monkeypatch):
    """A benchmark under torchrun runs as one of its ranks; these tests start their own ranks."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
