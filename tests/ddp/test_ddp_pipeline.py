"""The pipelined bucket path: buckets finished from the hooks as soon as their collectives are back, with the
same bits as torch's DDP; and the pipelined ``all_reduce_coalesced`` / ``CoalescedAllReduce``.

A gate in the middle of the model holds backward until the reducer's first bucket (the last layer's
gradients) is back, so the next hook finds a completed bucket: a deterministic early finish, not a race.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn

from fastpar.ddp.finish_queue import FinishQueue, is_done
from fastpar.launcher import spawn

TINY_CAP_MB = 0.0005  # 524 bytes: the last layer (bias + weight) is the first bucket after the rebuild


class _WaitForFirstBucket(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, holder):
        ctx.holder = holder
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        reducer = ctx.holder.reducer
        if reducer is not None and len(reducer.buckets) > 1 and reducer.buckets[0].launched:
            deadline = time.monotonic() + 60
            while not is_done(reducer.buckets[0].work):
                if time.monotonic() > deadline:
                    raise TimeoutError("the first bucket's collective did not complete within 60 s")
                time.sleep(0.001)
        return grad, None


class Gated(nn.Module):
    """``first -> gate -> mid -> last``; ``extra`` is used on rank 0 at even steps (for find_unused)."""

    def __init__(self):
        super().__init__()
        self.first, self.mid, self.last = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 8)
        self.extra = nn.Linear(32, 8)
        self.holder = type("Holder", (), {"reducer": None})()  # not a module: invisible to state_dict/DDP

    def forward(self, x, step=0, rank=0, use_extra=False):
        h = _WaitForFirstBucket.apply(torch.tanh(self.first(x)), self.holder)
        h = torch.tanh(self.mid(h))
        y = self.last(h)
        return y + self.extra(h) if use_extra and rank == 0 and step % 2 == 0 else y


def _train(make, rank: int, steps: int = 6, find_unused: bool = False) -> tuple[dict, list[int]]:
    torch.manual_seed(0)
    module = Gated()
    if not find_unused:
        module.extra.requires_grad_(False)
    model = make(module)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)
    early = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        model(torch.randn(8, 16, generator=gen), step=step, rank=rank, use_extra=find_unused).square().mean().backward()
        opt.step()
        if hasattr(model, "comm_stats"):
            early.append(model.comm_stats()["finished_early"])
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}, early


def _pipeline_rank(rank: int, world_size: int) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import fastpar

    def fastpar_ddp(hook=None, **kw):
        def make(module):
            model = fastpar.DDP(module, bucket_cap_mb=TINY_CAP_MB, **kw)
            if hook is not None:
                model.register_comm_hook(None, hook)
            module.holder.reducer = model.reducer
            return model

        return make

    def torch_ddp(hook=None, **kw):
        def make(module):
            model = torch.nn.parallel.DistributedDataParallel(module, bucket_cap_mb=TINY_CAP_MB, **kw)
            if hook is not None:
                model.register_comm_hook(None, hook)
            return model

        return make

    out = {}
    cases = {
        "views": ({}, None),
        "no_views": ({"gradient_as_bucket_view": False}, None),
        "torch_views": ({"gradient_as_bucket_view": True}, None),
        "fp16_hook": ({}, default_hooks.fp16_compress_hook),
        "find_unused": ({"find_unused_parameters": True}, None),
    }
    for name, (kw, hook) in cases.items():
        find_unused = kw.get("find_unused_parameters", False)
        ref, _ = _train(torch_ddp(hook, **kw), rank, find_unused=find_unused)
        got, early = _train(fastpar_ddp(hook, **kw), rank, find_unused=find_unused)
        out[name] = ([k for k in ref if not torch.equal(ref[k], got[k])], early)

    # grad_dtype has no torch twin: the same run with early finishing switched off must give the same bits
    def no_early(module):
        model = fastpar_ddp(grad_dtype=torch.bfloat16)(module)
        model.reducer.finishing.poll = lambda *args, **kwargs: 0
        return model

    got, early = _train(fastpar_ddp(grad_dtype=torch.bfloat16), rank)
    ref, none = _train(no_early, rank)
    out["bf16"] = ([k for k in ref if not torch.equal(ref[k], got[k])], early, none)
    return out


@pytest.fixture(scope="module")
def pipeline_results():
    return spawn(_pipeline_rank, 2, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["views", "no_views", "torch_views", "fp16_hook"])
def test_buckets_finished_early_give_torchs_bits(pipeline_results, case):
    for rank, result in enumerate(pipeline_results):
        differing, early = result[case]
        assert differing == [], f"rank {rank}: {differing} differ from torch DDP"
        # after the rebuild (step 2 on) the gate guarantees an early finish; step 1's single bucket may be back
        # by the time its own launching hook polls
        assert all(n >= 1 for n in early[1:]), early


@pytest.mark.slow
def test_find_unused_never_finishes_a_bucket_with_a_locally_unused_parameter_early(pipeline_results):
    for result in pipeline_results:
        differing, early = result["find_unused"]
        assert differing == []
        # find_unused keeps torch's first layout (no rebuild); what it finished early is still exact
        assert len(early) == 6


@pytest.mark.slow
def test_low_precision_buckets_finished_early_are_unchanged(pipeline_results):
    for result in pipeline_results:
        differing, early, none = result["bf16"]
        assert differing == []
        assert all(n >= 1 for n in early[1:]) and none == [0] * len(none)


class _Handle:
    def __init__(self, done: bool) -> None:
        self.done = done

    def is_completed(self) -> bool:
        return self.done


def test_finish_queue_finishes_in_order_and_stops_at_the_first_busy():
    handles = [_Handle(True), _Handle(False), _Handle(True)]
    finished: list[int] = []
    queue = FinishQueue()
    items = list(range(3))
    assert queue.poll(items, 3, handles.__getitem__, finished.append) == 1
    assert finished == [0] and queue.finished == 1  # item 2 is done, but item 1 is not: order is kept
    handles[1].done = True
    assert queue.poll(items, 2, handles.__getitem__, finished.append) == 1  # only launched items
    assert queue.poll(items, 3, handles.__getitem__, finished.append, may_finish=lambda i: i != 2) == 0
    queue.drain(items, finished.append)
    assert finished == [0, 1, 2] and queue.early == 2
    queue.reset()
    assert queue.finished == queue.early == 0
    assert not is_done(None)


def _coalesced_rank(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from fastpar.ddp import CoalescedAllReduce, all_reduce_coalesced
    from fastpar.ddp.coalesced import _plans

    g = torch.Generator().manual_seed(rank)
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    tensors = [torch.randn(37 + i, generator=g).to(dtypes[i % 3]) for i in range(300)]
    expected = [t.clone() for t in tensors]
    for t in expected:
        dist.all_reduce(t)
        t.copy_((t.float() * 0.25).to(t.dtype))
    reduce = CoalescedAllReduce(tensors, bucket_cap_mb=0.001)  # ~100 buckets: many in flight, unpacked as they land
    saved = [t.clone() for t in tensors]
    reduce(scale=0.25)
    prepared = all(torch.equal(a, b) for a, b in zip(tensors, expected, strict=True))
    for t, s in zip(tensors, saved, strict=True):
        t.copy_(s)
    all_reduce_coalesced(tensors, bucket_cap_mb=0.001, scale=0.25)
    all_reduce_coalesced(saved, bucket_cap_mb=0.001, scale=0.25)  # same signature: the cached plan
    return {
        "buckets": len(reduce.buckets),
        "prepared": prepared,
        "call": all(torch.equal(a, b) for a, b in zip(tensors, expected, strict=True)),
        "cached": all(torch.equal(a, b) for a, b in zip(saved, expected, strict=True)),
        "plans": len(_plans._plans),
    }


@pytest.mark.slow
def test_coalesced_paths_match_per_tensor_all_reduce():
    for result in spawn(_coalesced_rank, 2, timeout=180):
        assert result["buckets"] > 50
        assert result["prepared"] and result["call"] and result["cached"]
        assert result["plans"] == 1


def test_coalesced_rejects_unsupported_dtypes_before_any_collective(no_process_group):
    from fastpar.ddp import CoalescedAllReduce

    with pytest.raises(TypeError, match=r"tensors\[1\] has dtype torch.int64"):
        CoalescedAllReduce([torch.zeros(2), torch.zeros(2, dtype=torch.int64)])


def test_cuda_hook_futures_are_not_polled_but_works_are(no_process_group):
    """On CUDA a comm hook's future is done when queued, not run: DDP must not finish it early (the compute
    stream would wait for the collective); a Work's is_completed() is the GPU's own answer. Checked on a
    1-rank gloo group with the reducer told it lives on CUDA."""
    import torch.distributed as dist

    import fastpar
    from fastpar.launcher import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    model = fastpar.DDP(nn.Linear(4, 4))
    reducer = model.reducer
    bucket = reducer.buckets[0]
    work = dist.all_reduce(torch.zeros(4), async_op=True)
    work.wait()
    for device, handle, expected in (
        ("cpu", work.get_future(), "same"),
        ("cuda", work.get_future(), None),
        ("cuda", work, "same"),
        ("cpu", work, "same"),
    ):
        reducer.device, bucket.work = torch.device(device), handle
        assert reducer._pollable(bucket) is (handle if expected == "same" else None)
    reducer.device, bucket.work = torch.device("cpu"), None
