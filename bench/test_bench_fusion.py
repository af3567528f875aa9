"""All-reduce of 4000 x 1K floats on 2 gloo ranks (same paths as ``fastpar bench fusion``, minus the slow
one-by-one ones)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("path", ["torch_coalesced", "fastpar_bucketed", "fastpar_views", "single"])
def test_fusion(two_ranks, benchmark, path):
    benchmark.group = "fusion 4000x1K"
    two_ranks("fastpar.bench.benchmarks.fusion:path_call", (path, 4000, 1024, 25.0))
