"""A bucket whose collective cannot be launched (an aborted group, an allocation failure): the buckets launched
before it are handed over and waited for, the backward ends, its error names the real cause, and the next step
starts clean instead of reporting unused parameters. Both hook paths: the extension's and Python's."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from fastpar.ddp import extension_hooks
from fastpar.ops import loader

EXTENSION_ON_CPU = loader.kernels_for(torch.device("cpu"))[0] in ("compiled", "jit")


@pytest.fixture
def single_rank_group(no_process_group):
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield


def _model(python_hooks: bool):
    import fastpar

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    os.environ["FASTPAR_DDP_HOT_PATH"] = "python" if python_hooks else "auto"
    try:
        model = fastpar.DDP(module, bucket_cap_mb=0.0001)  # one bucket per parameter after the rebuild
    finally:
        os.environ.pop("FASTPAR_DDP_HOT_PATH")
    model(torch.randn(3, 4)).sum().backward()  # the rebuild follows: four buckets from the next forward
    return model


def _step_after_failure(model) -> None:
    """The next step runs normally (no error about unused parameters from the failed one)."""
    model.zero_grad()
    model(torch.randn(3, 4)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.skipif(not EXTENSION_ON_CPU, reason="fastpar._C does not serve CPU tensors here")
def test_extension_launch_failure_names_the_cause_and_the_next_step_is_clean(single_rank_group, monkeypatch):
    model = _model(python_hooks=False)
    real_layout = extension_hooks.layout

    def broken_second_bucket(buckets):  # the second bucket's buffer cannot be packed: launch() throws there
        entries = real_layout(buckets)
        comm, grads, members = entries[1]
        entries[1] = (torch.empty(comm.numel(), dtype=comm.dtype, device="meta"), grads, members)
        return entries

    monkeypatch.setattr(extension_hooks, "layout", broken_second_bucket)
    out = model(torch.randn(3, 4)).sum()
    with pytest.raises(RuntimeError, match=r"bucket 1 .* could not be launched: .*no kernels for meta"):
        out.backward()
    assert model.reducer.buckets[0].work is None  # handed over, waited for, then the backward was ended
    monkeypatch.setattr(extension_hooks, "layout", real_layout)
    model.reducer._native_layout = None  # give the extension the real buffers again
    _step_after_failure(model)
    assert model.reducer.stats()["hot_path"] == "extension"


def test_python_launch_failure_names_the_cause_and_the_next_step_is_clean(single_rank_group):
    model = _model(python_hooks=True)
    calls = []

    def hook(state, bucket):
        calls.append(bucket.index())
        if len(calls) == 2:
            raise RuntimeError("injected: the group was aborted")
        return dist.all_reduce(bucket.buffer(), async_op=True).get_future()

    model.register_comm_hook(None, hook)
    out = model(torch.randn(3, 4)).sum()
    with pytest.raises(RuntimeError, match=r"could not be launched: injected: the group was aborted"):
        out.backward()
    _step_after_failure(model)
    assert len(calls) == 2 + len(model.reducer.buckets)
