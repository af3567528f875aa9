"""The reducer as frameworks drive it (``model.reducer``), and what it does beyond parity: unused parameters
found from the graph before backward reaches them, no used-map all-reduce with a static graph, and the
NCCL-style completion watch run on gloo through the same code."""

from __future__ import annotations

import sys
import time

import pytest
import torch

from fastpar.launcher import RankError, spawn

sys.path.insert(0, __file__.rsplit("/", 1)[0])


def _equal(a: dict, b: dict) -> list[str]:
    return [k for k in a if not torch.equal(a[k], b[k])]


def _framework_calls_rank(rank: int, world_size: int) -> dict:
    """accelerate's ``trigger_sync_in_backward`` and Lightning's manual-optimization ``prepare_for_backward``,
    replayed on torch's DDP and on fastpar's; the parameters must match bit for bit."""
    from ddp_models import MLP, Unused

    import fastpar

    def accelerate_style(cls):
        torch.manual_seed(0)
        model = cls(MLP())
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(6):
            opt.zero_grad()
            with model.no_sync():  # accelerate's accumulate(): every forward without sync ...
                losses = [model(torch.randn(8, 16, generator=gen)).square().mean() for _ in range(2)]
                losses[0].backward()
            # ... and trigger_sync_in_backward for the last backward
            model.require_backward_grad_sync = model.require_forward_param_sync = True
            model.reducer.prepare_for_backward([])
            losses[1].backward()
            opt.step()
        return {k: v.clone() for k, v in model.module.state_dict().items()}

    def lightning_manual(cls, find_unused: bool):
        torch.manual_seed(0)
        model = cls(Unused(), find_unused_parameters=find_unused)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(rank)
        for step in range(6):
            opt.zero_grad()
            out = model(torch.randn(8, 16, generator=gen), step=step, rank=rank)
            loss = out.square().mean()
            # lightning.pytorch.overrides.distributed.prepare_for_backward
            model.require_forward_param_sync = True
            model.reducer._rebuild_buckets()
            model.reducer.prepare_for_backward([loss] if find_unused else [])
            loss.backward()
            opt.step()
        return {k: v.clone() for k, v in model.module.state_dict().items()}

    torch_ddp = torch.nn.parallel.DistributedDataParallel
    return {
        "accelerate": _equal(accelerate_style(torch_ddp), accelerate_style(fastpar.DDP)),
        "lightning_find_unused": _equal(lightning_manual(torch_ddp, True), lightning_manual(fastpar.DDP, True)),
    }


@pytest.mark.slow
def test_framework_reducer_calls_match_torch():
    for outcome in spawn(_framework_calls_rank, 2, timeout=180):
        assert outcome == {"accelerate": [], "lightning_find_unused": []}


class _Chain(torch.nn.Module):
    """a -> (b unused) -> c: with one bucket per layer, b's bucket sits between c's and a's."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 64)
        self.c = torch.nn.Linear(64, 64)

    def forward(self, x):
        return self.c(torch.relu(self.a(x)))


def _unused_up_front_rank(rank: int, world_size: int) -> dict:
    import fastpar

    torch.manual_seed(0)
    module = _Chain()
    seen = {}

    def before_fastpar(param) -> None:  # registered before DDP's own hook: a's gradient is ready, not yet marked
        seen.setdefault("launched", [b.launched for b in model.reducer.buckets])

    module.a.weight.register_post_accumulate_grad_hook(before_fastpar)
    model = fastpar.DDP(module, find_unused_parameters=True, bucket_cap_mb=64 * 64 * 4 / 2**20)
    names = [[s.name for s in b.slots] for b in model.reducer.buckets]
    model(torch.randn(4, 64)).sum().backward()
    out = {"names": names, "launched": seen["launched"], "collectives": model.comm_stats()["collectives"]}

    static = fastpar.DDP(_Chain(), static_graph=True)
    counts = []
    for _ in range(3):
        static(torch.randn(4, 64)).sum().backward()
        counts.append(static.comm_stats()["collectives"] - len(static.reducer.buckets))
    out["static_extra_collectives"] = counts
    out["b_grad"] = static.module.b.weight.grad is None
    return out


@pytest.mark.slow
def test_unused_parameters_are_ready_before_backward_reaches_them():
    for out in spawn(_unused_up_front_rank, 2, timeout=120):
        order = [n for bucket in out["names"] for n in bucket]
        assert order.index("b.weight") < order.index("a.weight")  # b's bucket comes before a's
        b_bucket = next(i for i, bucket in enumerate(out["names"]) if "b.weight" in bucket)
        a_bucket = next(i for i, bucket in enumerate(out["names"]) if "a.weight" in bucket)
        # when a's gradient arrives, every bucket before a's -- b's included -- is already on the wire
        assert out["launched"][:a_bucket] == [True] * a_bucket and b_bucket < a_bucket
        assert out["collectives"] == len(out["names"]) + 1  # the buckets and one used-parameter map
        # static graph: the used map is all-reduced in the first iteration only
        assert out["static_extra_collectives"] == [1, 0, 0]
        assert out["b_grad"]  # never used: .grad stays None


# ---- the completion watch (the NCCL path), on gloo ---------------------------------------------------


class _FakeWork:
    def __init__(self):
        self.done = False

    def is_completed(self):
        return self.done


def test_completion_watch_deadline_names_the_bucket_once():
    from fastpar.ddp.errors import BucketTimeoutError
    from fastpar.ddp.waiting import CompletionWatch

    now = [100.0]
    calls = []

    def diagnose(step, index, names, cause):
        calls.append((step, index, names, str(cause)))
        return BucketTimeoutError(f"bucket {index} of step {step}: {names}")

    watch = CompletionWatch(5.0, diagnose, clock=lambda: now[0], start_thread=False)
    finished, stuck = _FakeWork(), _FakeWork()
    watch.track(3, 0, ["w0"], finished)
    watch.track(3, 1, ["w1", "b1"], stuck)
    finished.done = True
    now[0] += 4.9
    assert watch.check() is None and calls == []
    now[0] += 0.2
    error = watch.check()
    assert isinstance(error, BucketTimeoutError) and calls[0][:3] == (3, 1, ["w1", "b1"])
    assert "host-side deadline" in calls[0][3]
    with pytest.raises(BucketTimeoutError, match="bucket 1 of step 3"):
        watch.raise_if_failed()
    watch.raise_if_failed()  # raised once
    assert watch.check() is None and len(calls) == 1


def test_wait_timer_on_cpu_measures_host_time():
    from fastpar.ddp.waiting import WaitTimer

    timer = WaitTimer(torch.device("cpu"))
    timer.start()
    time.sleep(0.02)
    timer.stop()
    assert 0.015 < timer.seconds() < 1.0


def _stream_ordered_rank(rank: int, world_size: int) -> str:
    """Rank 0 waits the NCCL way (no host block; the watch thread keeps the deadline); rank 1 is late."""
    from ddp_models import MLP

    import fastpar

    model = fastpar.DDP(MLP())
    model.reducer.waiter.host_blocking = False  # what NCCL does; on CPU the test skips only the stream wait
    loss = model(torch.randn(4, 16)).sum()
    if rank == 1:
        time.sleep(8)  # past rank 0's deadline, then catch up so nothing is left in flight
        loss.backward()
        return "late"
    loss.backward()  # returns at once: the all-reduce is still waiting for rank 1
    time.sleep(6)
    try:
        model(torch.randn(4, 16))
    except fastpar.ddp.BucketTimeoutError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow
def test_stream_ordered_wait_reports_the_missing_rank_at_the_next_step(capfd):
    results = spawn(_stream_ordered_rank, 2, timeout=90, pg_timeout=5)
    message = results[0]
    assert results[1] == "late"
    assert "rank(s) [1] never reached it" in message and "bucket 0" in message and "host-side deadline" in message
    assert "[fastpar DDP]" in capfd.readouterr().err  # also written at once, for a host blocked in a CUDA sync


class _CheckpointedOnly(torch.nn.Module):
    """Its only used layer is recomputed by a reentrant checkpoint; ``unused`` never takes part."""

    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(64, 64)
        self.unused = torch.nn.Linear(64, 64)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.used, x, use_reentrant=True)


def _incomplete_backward_rank(rank: int, world_size: int) -> dict:
    """A backward that leaves parameters without gradients is reported: at its end, or -- when it ended inside
    a reentrant checkpoint -- at the next forward; never silently carried on."""
    import fastpar

    out = {}
    model = fastpar.DDP(_Chain())
    try:
        model(torch.randn(4, 64)).sum().backward(inputs=[model.module.c.weight, model.module.c.bias])
        out["backward"] = "no error"
    except fastpar.ddp.UnusedParametersError as exc:
        out["backward"] = str(exc)
    model = fastpar.DDP(_CheckpointedOnly())
    model(torch.randn(4, 64, requires_grad=True)).sum().backward()  # hooks fire inside the nested backward only
    try:
        model(torch.randn(4, 16))
        out["next_forward"] = "no error"
    except fastpar.ddp.UnusedParametersError as exc:
        out["next_forward"] = str(exc)
    return out


@pytest.mark.slow
def test_incomplete_backward_is_reported():
    for out in spawn(_incomplete_backward_rank, 2, timeout=60):
        assert "a.weight" in out["backward"] and "find_unused_parameters=True" in out["backward"]
        assert "c.weight" not in out["backward"]
        assert "unused.weight" in out["next_forward"] and "used.weight" not in out["next_forward"].replace(
            "unused.weight", ""
        )


def _graph_changed_rank(rank: int, world_size: int) -> str:
    from ddp_models import Unused

    import fastpar

    model = fastpar.DDP(Unused(), static_graph=True)
    try:
        for step in range(3):
            model(torch.randn(4, 16), step=step, rank=0).sum().backward()  # `sometimes` used at even steps
    except RuntimeError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow
def test_static_graph_that_changes_is_named():
    for message in spawn(_graph_changed_rank, 2, timeout=60):
        assert "static_graph=True" in message and "sometimes.weight" in message


def test_rank_error_type_is_exported():
    assert issubclass(RankError, RuntimeError)


class _SharedInTwoCheckpoints(torch.nn.Module):
    """One layer recomputed by two reentrant checkpoints: its hook fires twice per backward."""

    def __init__(self):
        super().__init__()
        self.pre = torch.nn.Linear(16, 16)
        self.shared = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.shared, self.pre(x), use_reentrant=True)
        h = checkpoint(self.shared, torch.tanh(h), use_reentrant=True)
        return self.out(h)


def _twice_rank(rank: int, world_size: int) -> dict:
    import fastpar

    out = {}
    x = torch.randn(4, 16, requires_grad=True, generator=torch.Generator().manual_seed(rank))
    try:
        fastpar.DDP(_SharedInTwoCheckpoints())(x).sum().backward()
        out["dynamic"] = "no error"
    except RuntimeError as exc:
        out["dynamic"] = str(exc)
    results = []
    for cls in (torch.nn.parallel.DistributedDataParallel, fastpar.DDP):
        torch.manual_seed(0)
        model = cls(_SharedInTwoCheckpoints(), static_graph=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(4):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        results.append({k: v.clone() for k, v in model.module.state_dict().items()})
    out["static"] = _equal(*results)
    return out


@pytest.mark.slow
def test_gradient_twice_in_one_backward_is_named_and_static_graph_counts_it():
    for out in spawn(_twice_rank, 2, timeout=120):
        assert (
            "received a gradient twice" in out["dynamic"]
            and "shared." in out["dynamic"]
            and "static_graph=True" in out["dynamic"]
        )
        assert out["static"] == []  # static_graph learns the hook fires twice, as torch's reducer does
