"""The reducer holds one bucket layout at a time: after torch's rebuild (which may come in a no_sync forward) the
old buffers are released at once -- by Python and by the extension's hooks -- not at the next synchronised
backward, so no_sync steps never carry a second model's worth of gradient memory."""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch
import torch.distributed as dist


@pytest.fixture
def single_rank_group(no_process_group):
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield


@pytest.mark.parametrize("python_hooks", [False, True], ids=["extension_hooks", "python_hooks"])
@pytest.mark.parametrize("views", [True, False], ids=["views", "no_views"])
def test_the_old_layout_is_released_at_the_rebuild_under_no_sync(single_rank_group, python_hooks, views):
    import fastpar

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    os.environ["FASTPAR_DDP_HOT_PATH"] = "python" if python_hooks else "auto"
    try:
        model = fastpar.DDP(module, bucket_cap_mb=0.001, gradient_as_bucket_view=views)
    finally:
        os.environ.pop("FASTPAR_DDP_HOT_PATH")
    model(torch.randn(2, 16)).sum().backward()  # synchronised: records the arrival order
    reducer = model.reducer
    old = [weakref.ref(t) for b in reducer.buckets for t in (b.comm_flat, b.grad_flat) if t is not None]
    layout = reducer.layout()
    for _ in range(2):
        with model.no_sync():  # the first forward rebuilds the buckets
            model(torch.randn(2, 16)).sum().backward()
        gc.collect()
        assert reducer.layout() != layout
        assert [r for r in old if r() is not None] == [], "the old bucket buffers are still referenced"
    model(torch.randn(2, 16)).sum().backward()  # and the next synchronised step uses the new layout
    assert all(p.grad is not None for p in model.parameters())
