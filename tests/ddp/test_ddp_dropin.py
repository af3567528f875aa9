"""Drop-in fidelity on a one-rank process group: signature, isinstance, attributes, state_dict, compile."""

from __future__ import annotations

import copy
import inspect
import io
import pickle
import re
import sys

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
    data = model._get_ddp_logging_data()
    assert data["world_size"] == 1 and data["module_name"] == "Sequential"
    assert data["iteration"] == 0  # torch's: the sampled iteration, written at the next synchronised forward
    model(torch.randn(5, 4)).sum().backward()
    assert model._get_ddp_logging_data()["iteration"] == 1


def test_state_dict_keeps_module_prefix_and_loads(group):
    model = fastpar.DDP(_model())
    reference = torch.nn.parallel.DistributedDataParallel(_model())
    assert list(model.state_dict()) == list(reference.state_dict())
    assert all(k.startswith("module.") for k in model.state_dict())
    other = fastpar.DDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)))
    other.load_state_dict(model.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), model.state_dict().values(), strict=True))


def test_pickle_deepcopy_and_save_rebuild_the_reducer(group):
    model = fastpar.DDP(_model())
    model(torch.randn(3, 4)).sum().backward()
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert isinstance(clone, fastpar.DDP) and clone.reducer is not model.reducer
        assert all(
            torch.equal(a, b) for a, b in zip(clone.state_dict().values(), model.state_dict().values(), strict=True)
        )
        clone(torch.randn(3, 4)).sum().backward()
        assert clone.comm_stats()["step"] == 1 and model.comm_stats()["step"] == 1  # hooks on the clone's params
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    loaded(torch.randn(3, 4)).sum().backward()
    assert loaded.comm_stats()["step"] == 1


def _calls(pattern: str) -> set[str]:
    source = inspect.getsource(sys.modules[torch.nn.parallel.DistributedDataParallel.__module__])
    return set(re.findall(pattern, source))


def test_everything_torchs_ddp_calls_on_its_reducer_and_logger_exists(group):
    """torch's DDP methods drive fastpar's reducer and logger: each method the installed torch calls on them
    must exist (frameworks call the same ones: prepare_for_backward, _rebuild_buckets, _delay_all_reduce)."""
    model = fastpar.DDP(_model())
    reducer_calls = _calls(r"\breducer\.([A-Za-z_]+)") | {"prepare_for_backward", "_rebuild_buckets"}
    logger_calls = _calls(r"(?:self|ddp)\.logger\.([A-Za-z_]+)")
    assert reducer_calls and logger_calls
    assert sorted(m for m in reducer_calls if not callable(getattr(model.reducer, m, None))) == []
    assert sorted(m for m in logger_calls if not callable(getattr(model.logger, m, None))) == []
    # the methods torch's DDP would route through its C++ reducer are ours
    for name in ("_ddp_init_helper", "register_comm_hook", "_register_builtin_comm_hook"):
        assert getattr(type(model), name) is not getattr(torch.nn.parallel.DistributedDataParallel, name), name


def test_comm_hook_registered_once(group):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model = fastpar.DDP(_model())
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    with pytest.raises(RuntimeError, match="only be called once"):
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    model(torch.randn(3, 4)).sum().backward()
    assert model.comm_stats()["collectives"] == len(model.reducer.buckets)


def test_no_sync_accumulates_into_bucket_views_without_communication(group):
    model = fastpar.DDP(_model())
    x = torch.randn(3, 4)
    with model.no_sync():
        model(x).sum().backward()
    assert model.comm_stats()["step"] == 0  # nothing reduced
    first = [p.grad.clone() for p in model.parameters()]
    model(x).sum().backward()
    assert model.comm_stats()["step"] == 1
    views = {id(s.grad_view) for b in model.reducer.buckets for s in b.slots}
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


def test_arguments_left_at_none_take_the_installed_torchs_default(monkeypatch):
    """torch before 2.13 had ``broadcast_buffers=True`` (not None) as its default and stored what it was given:
    fastpar's None ("torch's default") must not reach it, or torch's logger fails on ``int(None)``."""
    from fastpar.ddp import _setup

    def older_torch_init(self, module, device_ids=None, broadcast_buffers=True, bucket_cap_mb=None):
        pass

    monkeypatch.setattr(_setup, "_PARENT_PARAMS", inspect.signature(older_torch_init).parameters)
    kwargs = _setup.parent_kwargs(device_ids=None, broadcast_buffers=None, bucket_cap_mb=25, forward_sync_buffers=None)
    assert kwargs == {"bucket_cap_mb": 25}
    with pytest.raises(TypeError, match=r"forward_sync_buffers=\.\.\.\) needs a newer torch"):
        _setup.parent_kwargs(forward_sync_buffers=True)
