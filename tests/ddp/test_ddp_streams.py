"""Gradients from several streams: each gradient's hook records an event on its own stream and a bucket's launch
waits for every member's event before packing (``fastpar.ddp.ready_events``, ``ReadyEvents`` in the extension).
On a GPU a module whose backward runs on a side stream gives torch's DDP bits; on the CPU the bookkeeping is
checked with a stand-in stream API. Also the extension's hooks under compiled autograd (torch's hint) and the
extension's start callback (retried by the next gradient while it has not run)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from fastpar.ops import loader

EXTENSION_ON_CPU = loader.kernels_for(torch.device("cpu"))[0] in ("compiled", "jit")


@pytest.fixture
def single_rank_group(no_process_group):
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield


def _ddp(module, python_hooks: bool, **kwargs):
    import fastpar

    os.environ["FASTPAR_DDP_HOT_PATH"] = "python" if python_hooks else "auto"
    try:
        return fastpar.DDP(module, **kwargs)
    finally:
        os.environ.pop("FASTPAR_DDP_HOT_PATH")


# ---- the bookkeeping on the CPU, with a stand-in stream API -------------------------------------------------
class _Stream:
    """Every current_stream() call answers a new stream, as if each hook and the launch ran on its own."""

    def __init__(self, log: list) -> None:
        self.log = log

    def wait_event(self, event) -> None:
        self.log.append(("wait", event))


class _Event:
    def __init__(self, log: list) -> None:
        self.log = log

    def record(self, stream) -> None:
        self.log.append(("record", self))


class _Streams:
    def __init__(self, log: list) -> None:
        self.log = log

    def current_stream(self):
        return _Stream(self.log)

    def new_event(self):
        return _Event(self.log)

    def used_on(self, tensor, stream) -> None:
        pass


def test_every_gradient_is_waited_for_on_its_own_event_before_its_bucket_is_packed(single_rank_group, monkeypatch):
    from fastpar.ddp import ready_events, reducer

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model = _ddp(module, python_hooks=True, bucket_cap_mb=0.0001)  # one bucket per parameter after the rebuild
    log: list = []
    red = model.reducer
    red._ready_events = ready_events.ReadyEvents(len(red.slots), _Streams(log))
    real_stage = reducer.gradient_path.stage

    def stage(bucket, slots, *args, **kwargs):
        log.append(("pack", bucket))
        return real_stage(bucket, slots, *args, **kwargs)

    monkeypatch.setattr(reducer.gradient_path, "stage", stage)
    for _ in range(3):  # the first layout, the rebuild, the rebuilt layout
        log.clear()
        model(torch.randn(5, 4)).square().mean().backward()
        packs = [(i, entry[1]) for i, entry in enumerate(log) if entry[0] == "pack"]
        assert len(packs) == len(red.buckets)
        for at, bucket in packs:
            for slot in bucket.slots:
                event = red._ready_events._events[slot.index]
                assert event is not None, f"no event recorded for {slot.name}"
                recorded = [i for i, e in enumerate(log[:at]) if e == ("record", event)]
                assert recorded, f"{slot.name}'s event was recorded after its bucket was packed"
                assert ("wait", event) in log[recorded[-1] : at], f"the pack did not wait for {slot.name}'s event"


def test_no_events_on_the_cpu(single_rank_group):
    model = _ddp(torch.nn.Linear(4, 2), python_hooks=True)
    assert model.reducer._ready_events is None


# ---- the extension's hooks ------------------------------------------------------------------------------------
@pytest.mark.skipif(not EXTENSION_ON_CPU, reason="fastpar._C does not serve CPU tensors here")
def test_compiled_autograd_gets_torchs_hint(single_rank_group):
    from torch._dynamo import compiled_autograd

    def message(wrap) -> str:
        torch.manual_seed(0)
        model = wrap(torch.nn.Linear(4, 2))
        loss = model(torch.randn(3, 4)).sum()
        with compiled_autograd._enable(torch.compile(backend="eager")):
            with pytest.raises(RuntimeError) as caught:
                loss.backward()
        return str(caught.value)

    torch._dynamo.reset()
    theirs = message(torch.nn.parallel.DistributedDataParallel)
    torch._dynamo.reset()
    ours = message(lambda m: _ddp(m, python_hooks=False))
    torch._dynamo.reset()
    hint = 'Compiled autograd is not compatible with C++ DDP Reducer, please use torch._dynamo.config.optimize_ddp="python_reducer".'
    assert hint in theirs
    assert hint in ours, ours


@pytest.mark.skipif(not EXTENSION_ON_CPU, reason="fastpar._C does not serve CPU tensors here")
def test_a_start_that_did_not_run_is_retried_by_the_next_gradient(single_rank_group, monkeypatch):
    from fastpar.ddp.reducer import Reducer

    calls = []
    real = Reducer._native_started

    def started(self):
        calls.append(len(calls))
        if len(calls) == 1:
            raise RuntimeError("start interrupted")
        real(self)

    monkeypatch.setattr(Reducer, "_native_started", started)
    torch.manual_seed(0)
    model = _ddp(torch.nn.Linear(4, 2), python_hooks=False)
    out = model(torch.randn(3, 4))
    with pytest.raises(RuntimeError, match="start interrupted"):
        out.sum().backward(retain_graph=True)
    out.sum().backward()  # same forward: the extension is still armed, its start still owed
    assert len(calls) == 2
    assert model.reducer.stats()["hot_path"] == "extension"


# ---- on a GPU: a module whose backward runs on a side stream ------------------------------------------------------
class _SlowBackward(torch.autograd.Function):
    """Identity whose backward first keeps its stream busy, so that gradients behind it come late on that stream."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        torch.cuda._sleep(200_000_000)  # a few hundred ms of GPU time on the current (side) stream
        return grad


class _TwoStreams(torch.nn.Module):
    """``main`` runs on the current stream; ``side`` under a side stream, so autograd runs its backward (and its
    parameters' AccumulateGrad hooks) there. Both parameters share a bucket; the side branch's gradients reach their
    hooks first on the host but are computed last on the GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.main = torch.nn.Linear(256, 256)
        self.side = torch.nn.Linear(256, 256)
        self.stream = None

    def forward(self, x):
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        y = self.main(x)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            z = _SlowBackward.apply(self.side(x))
        torch.cuda.current_stream().wait_stream(self.stream)
        return y + z


def _train_two_streams(wrap, steps: int = 3) -> dict:
    torch.manual_seed(0)
    module = _TwoStreams().cuda()
    model = wrap(module)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(64, 256, device="cuda", generator=gen)
        model(x).square().mean().backward()
        opt.step()
    torch.cuda.synchronize()
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


@pytest.fixture
def cuda_group(no_process_group):
    backend = "nccl" if dist.is_nccl_available() else "gloo"
    torch.cuda.set_device(0)
    device_id = torch.device("cuda", 0) if backend == "nccl" else None
    dist.init_process_group(backend, rank=0, world_size=1, store=dist.HashStore(), device_id=device_id)
    yield


@pytest.mark.cuda
@pytest.mark.parametrize("views", [True, False], ids=["views", "no_views"])
@pytest.mark.parametrize("python_hooks", [False, True], ids=["extension_hooks", "python_hooks"])
def test_side_stream_backward_gives_torchs_bits(cuda_group, python_hooks, views):
    local = _train_two_streams(lambda m: m)
    peer = _train_two_streams(lambda m: torch.nn.parallel.DistributedDataParallel(m, device_ids=[0]))
    got = _train_two_streams(lambda m: _ddp(m, python_hooks, device_ids=[0], gradient_as_bucket_view=views))
    assert [k for k in local if not torch.equal(local[k], got[k])] == [], "fastpar differs from a local backward"
    assert [k for k in peer if not torch.equal(peer[k], got[k])] == [], "fastpar differs from torch's DDP"
