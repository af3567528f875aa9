"""fastpar.ops.pack/unpack next to memcpy and torch's peers (same callables as ``fastpar bench pack``)."""

from __future__ import annotations

import pytest
import torch

from fastpar.bench.benchmarks.pack import DEFAULT_SHAPES, pack_variants, parse_shapes, shape_name


@pytest.mark.parametrize("shape", parse_shapes(DEFAULT_SHAPES), ids=lambda s: shape_name(*s))
@pytest.mark.parametrize("op", ["pack:memcpy", "pack:fastpar.pack", "pack:torch.cat", "unpack:fastpar.unpack"])
def test_pack(benchmark, shape, op):
    count, numel = shape
    tensors = [torch.randn(numel) for _ in range(count)]
    out = torch.empty(count * numel)
    pack, unpack = pack_variants(tensors, out)
    direction, impl = op.split(":")
    benchmark.group = f"pack {count}x{numel}"
    benchmark.extra_info["bytes_moved"] = 2 * count * numel * 4
    benchmark((pack if direction == "pack" else unpack)[impl])
