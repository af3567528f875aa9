"""pytest-benchmark entry points over the ``fastpar bench`` code, for regression tracking in CI.

Run: ``pytest bench/ --benchmark-only`` (not collected by the normal test run: testpaths = tests); a
quick subset: ``pytest bench/ --benchmark-only -k "64K or 384x16K or single"``. Multi-rank benchmarks make
this process rank 0 of a local gloo group (``fastpar.bench.peers``).
"""

from __future__ import annotations

import os

import pytest

MISSING_PLUGIN = "the bench/ entry points need pytest-benchmark: pip install 'fastpar[bench]'"
try:
    import pytest_benchmark  # noqa: F401

    HAS_PLUGIN = True
except ImportError:
    HAS_PLUGIN = False


if not HAS_PLUGIN:

    def pytest_addoption(parser):
        # accept the plugin's main flag, so the run ends with the one-line hint below, not a usage error
        parser.addoption("--benchmark-only", action="store_true", help="(needs pytest-benchmark)")

    def pytest_configure(config):
        pytest.exit(MISSING_PLUGIN, returncode=pytest.ExitCode.USAGE_ERROR)


os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

WARMUP_ROUNDS = 2
ROUNDS = 5


def time_on_two_ranks(benchmark, factory: str, args: tuple, rounds: int = ROUNDS, warmup: int = WARMUP_ROUNDS) -> None:
    """Time rank 0's call of ``factory(rank, 2, *args)`` with pytest-benchmark, rank 1 mirroring it."""
    from fastpar.bench.peers import peer_group

    with peer_group(factory, args, calls=rounds + warmup) as call:
        benchmark.pedantic(call, rounds=rounds, warmup_rounds=warmup, iterations=1)


@pytest.fixture
def two_ranks(benchmark):
    return lambda factory, args, **kw: time_on_two_ranks(benchmark, factory, args, **kw)
