"""One training step of the 96-block model on 2 gloo ranks (same variants as ``fastpar bench ddp``)."""

from __future__ import annotations

import pytest

from fastpar.bench.benchmarks.ddp_step import available_variants


@pytest.mark.parametrize("variant", available_variants()[0])
def test_ddp_step(two_ranks, benchmark, variant):
    benchmark.group = "ddp step blocks"
    two_ranks("fastpar.bench.benchmarks.ddp_step:step_call", (variant, "blocks"), rounds=3, warmup=1)
