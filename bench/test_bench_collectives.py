"""All-reduce and friends on 2 gloo ranks (same buffers and calls as ``fastpar bench allreduce ...``)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("nbytes", [64 << 10, 4 << 20], ids=["64K", "4M"])
@pytest.mark.parametrize("name", ["allreduce", "allgather", "reducescatter", "broadcast", "alltoall"])
def test_collective(two_ranks, benchmark, name, nbytes):
    benchmark.group = f"collective {nbytes} B"
    two_ranks("fastpar.bench.benchmarks.collective_cases:case_call", (name, nbytes))
