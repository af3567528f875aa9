"""Drop-in fidelity on a one-rank process group: signature, isinstance, attributes, state_dict, compile."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.distributed as dist

import fastpar
from fastpar.ddp import DistributedDataParallel


@pytest.fixture
def group(no_process_group):
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))


def test_constructor_matches_torch_keywords_and_order():
    theirs = list(inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters)
    ours = inspect.signature(DistributedDataParallel.__init__).parameters
    assert list(ours)[: len(theirs)] == theirs
    assert ours["grad_dtype"].kind is inspect.Parameter.KEYWORD_ONLY
    assert fastpar.DDP is fastpar.DistributedDataParallel is DistributedDataParallel


def test_isinstance_attributes_and_forward(group):
    model = fastpar.DDP(_model(), bucket_cap_mb=10)
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel)
    assert model.device_ids is None and model.output_device is None and model.dim == 0
    assert model.bucket_bytes_cap == 10 * 1024 * 1024
    assert model.process_group is dist.distributed_c10d._get_default_group()
    assert model.find_unused_parameters is False and model.static_graph is False
    assert model.gradient_as_bucket_view is True and model.broadcast_buffers is True
    assert model.require_backward_grad_sync and model.require_forward_param_sync
    out = model(torch.randn(5, 4))
    assert out.shape == (5, 2)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert not hasattr(model, "reducer")
    assert model._get_ddp_logging_data()["world_size"] == 1


def test_state_dict_keeps_module_prefix_and_loads(group):
    model = fastpar.DDP(_model())
    reference = torch.nn.parallel.DistributedDataParallel(_model())
    assert list(model.state_dict()) == list(reference.state_dict())
    assert all(k.startswith("module.") for k in model.state_dict())
    other = fastpar.DDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)))
    other.load_state_dict(model.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), model.state_dict().values(), strict=True))


def test_pickling_is_refused_with_advice(group):
    with pytest.raises(TypeError, match="state_dict"):
        copy.deepcopy(fastpar.DDP(_model()))


def test_comm_hook_registered_once(group):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model = fastpar.DDP(_model())
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    with pytest.raises(RuntimeError, match="only be called once"):
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    model(torch.randn(3, 4)).sum().backward()
    assert model.comm_stats()["collectives"] == len(model._reducer.buckets)


def test_no_sync_accumulates_into_bucket_views_without_communication(group):
    model = fastpar.DDP(_model())
    x = torch.randn(3, 4)
    with model.no_sync():
        model(x).sum().backward()
    assert model.comm_stats()["step"] == 0  # nothing reduced
    first = [p.grad.clone() for p in model.parameters()]
    model(x).sum().backward()
    assert model.comm_stats()["step"] == 1
    views = {id(v) for b in model._reducer.buckets for v in b.views}
    assert all(id(p.grad) in views for p in model.parameters())
    assert all(torch.allclose(p.grad, 2 * g) for p, g in zip(model.parameters(), first, strict=True))


def test_torch_compile_runs(group):
    torch._dynamo.reset()
    model = fastpar.DDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2)))
    compiled = torch.compile(model, backend="eager")
    for _ in range(2):
        compiled(torch.randn(3, 4)).square().mean().backward()
    assert model.comm_stats()["step"] == 2
    assert all(p.grad is not None for p in model.parameters())
