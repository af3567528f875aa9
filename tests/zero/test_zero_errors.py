"""What ZeRO refuses, before the first step, with a message naming what is wrong and what to do; and the
non-finite gradient report. One-rank gloo group in this process (the checks do not depend on the world size)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fastpar
from fastpar.launcher import free_port


@pytest.fixture
def group(no_process_group):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


class TrustRatioSGD(torch.optim.Optimizer):
    """SGD that, with ``trust=True``, scales each parameter's step by ||p|| / ||grad|| (LARS-like): not elementwise."""

    def __init__(self, params, lr=0.1, trust=False):
        super().__init__(params, {"lr": lr, "trust": trust})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    scale = p.norm() / (p.grad.norm() + 1e-12) if group["trust"] else 1.0
                    p.add_(p.grad, alpha=-group["lr"] * float(scale))


def test_lbfgs_needs_whole_parameters(group):
    with pytest.raises(ValueError, match="LBFGS: its step\\(\\) needs a closure"):
        fastpar.ShardedOptimizer(fastpar.DDP(mlp()), torch.optim.LBFGS)


def test_adafactor_is_not_elementwise(group):
    with pytest.raises(
        ValueError, match=r"cannot shard param group 0 \(0.weight, 0.bias, 2.weight, 2.bias\) with Adafactor"
    ):
        fastpar.ShardedOptimizer(fastpar.DDP(mlp()), torch.optim.Adafactor, lr=0.01)


def test_a_group_whose_hyperparameters_are_not_elementwise_is_named(group):
    model = fastpar.DDP(mlp())
    groups = [
        {"params": [model.module[0].weight, model.module[0].bias]},
        {"params": [model.module[2].weight, model.module[2].bias], "trust": True},
    ]
    with pytest.raises(ValueError, match=r"param group 1 \(2.weight, 2.bias\) with TrustRatioSGD: stepping one flat"):
        fastpar.ShardedOptimizer(model, TrustRatioSGD, groups)
    fastpar.ShardedOptimizer(model, TrustRatioSGD, [{**groups[1], "trust": False}, groups[0]])  # elementwise: fine


def test_tensor_that_is_not_the_models(group):
    model = fastpar.DDP(mlp())
    stranger = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"param group 1 \(\?\) holds a tensor of shape \[3\] that is not a parameter"):
        fastpar.ShardedOptimizer(model, torch.optim.SGD, [{"params": model.parameters()}, {"params": [stranger]}])


def test_trainable_parameter_in_no_group(group):
    model = fastpar.DDP(mlp())
    with pytest.raises(ValueError, match=r"1 trainable parameter\(s\) of the model are in no param group: 2.bias"):
        fastpar.ShardedOptimizer(
            model, torch.optim.SGD, [p for n, p in model.module.named_parameters() if n != "2.bias"]
        )


def test_frozen_parameters_in_a_group_are_fine(group):
    module = mlp()
    module[0].requires_grad_(False)
    opt = fastpar.ShardedOptimizer(fastpar.DDP(module), torch.optim.SGD, module.parameters(), lr=0.1)
    assert len(opt.param_groups[0]["params"]) == 4


def test_torch_ddp_is_refused(group):
    with pytest.raises(TypeError, match="needs a fastpar.DistributedDataParallel model"):
        fastpar.ShardedOptimizer(torch.nn.parallel.DistributedDataParallel(mlp()), torch.optim.SGD)


def test_comm_hooks_and_a_second_optimizer_are_refused(group):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    hooked = fastpar.DDP(mlp())
    hooked.register_comm_hook(None, allreduce_hook)
    with pytest.raises(RuntimeError, match="has a comm hook"):
        fastpar.ShardedOptimizer(hooked, torch.optim.SGD)
    model = fastpar.DDP(mlp())
    opt = fastpar.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    with pytest.raises(RuntimeError, match="optimizer is sharded"):
        model.register_comm_hook(None, allreduce_hook)
    with pytest.raises(RuntimeError, match="already has a ShardedOptimizer"):
        fastpar.ShardedOptimizer(model, torch.optim.SGD)
    with pytest.raises(NotImplementedError, match="pass every param group to the constructor"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})
    with pytest.raises(NotImplementedError, match="join\\(\\)"):
        model.reducer._get_zeros_like_grad_buckets()  # what torch's join hook calls on a joined rank
    with pytest.raises(ValueError, match="exchange must be one of"):
        fastpar.ShardedOptimizer(fastpar.DDP(mlp()), torch.optim.SGD, exchange="ring")


def test_non_finite_gradient_is_reported_by_name(group):
    model = fastpar.DDP(mlp())
    opt = fastpar.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    x = torch.ones(2, 4)
    model(x).sum().backward()
    assert all(p.grad is None for p in model.parameters())  # the reduced gradient lives in the shards
    with pytest.raises(ValueError, match="norm_type=1.0 is not supported"):
        opt.clip_grad_norm_(1.0, norm_type=1.0)
    assert torch.isfinite(opt.clip_grad_norm_(1e9))
    opt.zero_grad()
    model(torch.full((2, 4), float("inf"))).sum().backward()
    with pytest.raises(RuntimeError, match=r"non-finite.*inf/nan gradients: .*0.weight"):
        opt.clip_grad_norm_(1.0, error_if_nonfinite=True)
    assert not torch.isfinite(opt.clip_grad_norm_(1.0))  # as torch: reported in the returned norm
    assert not torch.isfinite(opt.clip_grad_norm_(1.0, exact=False))


def test_state_of_parameters_that_stepped_apart_loads_and_continues_as_torch(group):
    module = mlp()
    plain = torch.optim.AdamW(module.parameters(), lr=0.01)
    module(torch.ones(2, 4)).sum().backward()
    plain.step()
    module[0].weight.grad = None  # skipped once: its step count differs from the others', which share its shard
    plain.step()
    reference = copy.deepcopy(module)
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
    reference_opt.load_state_dict(plain.state_dict())
    model = fastpar.DDP(module)
    opt = fastpar.ShardedOptimizer(model, torch.optim.AdamW, lr=0.01)
    opt.load_state_dict(plain.state_dict())
    for _ in range(2):
        for m, o in ((model, opt), (reference, reference_opt)):
            o.zero_grad()
            m(torch.ones(2, 4)).square().sum().backward()
            o.step()
    state = model.module.state_dict()
    assert all(torch.equal(state[n], p) for n, p in reference.named_parameters())
    saved, expected = opt.state_dict(), reference_opt.state_dict()
    assert [saved["state"][i]["step"].item() for i in range(4)] == [3.0, 4.0, 4.0, 4.0]
    assert all(
        torch.equal(saved["state"][i][k], expected["state"][i][k]) for i in range(4) for k in expected["state"][i]
    )
    with pytest.raises(ValueError, match="different number of parameter groups"):
        opt.load_state_dict({"state": {}, "param_groups": []})


def _stuck_rank(rank: int, world_size: int, where: str) -> str:
    import time

    model = fastpar.DDP(mlp())
    opt = fastpar.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    model(torch.ones(2, 4)).sum().backward()  # one whole step first: DDP's bucket rebuild is behind us
    opt.step()
    opt.zero_grad()  # else the next backward first gathers the reduced gradients back, to add onto them
    loss = model(torch.ones(2, 4)).sum()
    if rank == 1 and where == "backward":
        time.sleep(30)  # never reaches the reduce-scatter; the parent ends this rank
    loss.backward()
    if rank == 1 and where == "step":
        time.sleep(30)  # never sends its updated shard
    opt.step()
    model(torch.ones(2, 4))  # waits for the all-gather
    return "no error"


@pytest.mark.slow
@pytest.mark.parametrize(
    "where, collective",
    [("backward", "reduce-scatter of gradient bucket 0"), ("step", "all-gather of the updated parameters of bucket")],
)
def test_a_rank_that_never_arrives_is_named_without_hanging(where, collective):
    import time

    from fastpar.launcher import RankError, spawn

    start = time.monotonic()
    with pytest.raises(RankError) as info:
        spawn(_stuck_rank, 2, where, timeout=90, pg_timeout=5)
    message = str(info.value)
    assert time.monotonic() - start < 60
    assert "rank 0 of 2 failed" in message and "BucketTimeoutError" in message
    assert collective in message and "rank(s) [1] never reached it" in message


def test_stage_two_refuses_what_cannot_shard_gradients(group):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    with pytest.raises(TypeError, match=r"\(ZeRO-2, shard_gradients=True\) needs a fastpar.*torch's Distributed"):
        fastpar.ShardedOptimizer(
            torch.nn.parallel.DistributedDataParallel(mlp()), torch.optim.SGD, shard_gradients=True
        )
    with pytest.raises(ValueError, match="gradients cannot be bucket views.*Leave gradient_as_bucket_view unset"):
        fastpar.ShardedOptimizer(
            fastpar.DDP(mlp(), gradient_as_bucket_view=True), torch.optim.SGD, shard_gradients=True
        )
    with pytest.raises(TypeError, match="shard_gradients must be True"):
        fastpar.ShardedOptimizer(fastpar.DDP(mlp()), torch.optim.SGD, shard_gradients="yes")
    hooked = fastpar.DDP(mlp())
    hooked.register_comm_hook(None, allreduce_hook)
    with pytest.raises(RuntimeError, match="cannot install a ShardedOptimizer with shard_gradients=True.*comm hook"):
        fastpar.ShardedOptimizer(hooked, torch.optim.SGD, shard_gradients=True)


def test_what_grad_holds_at_stage_two(group):
    module = mlp()
    reference = copy.deepcopy(module)
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    model = fastpar.DDP(module)
    plain = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = fastpar.ShardedOptimizer.from_optimizer(model, plain, shard_gradients=True)
    assert opt.stage == 2 and fastpar.ShardedOptimizer(fastpar.DDP(mlp()), torch.optim.SGD, lr=0.1).stage == 1
    x = torch.linspace(-1, 1, 8).reshape(2, 4)
    for step in range(2):
        reference_opt.zero_grad()
        reference(x * (step + 1)).square().sum().backward()
        local = [p.grad.clone() for p in reference.parameters()]
        reference(x).square().sum().backward()
        reference(x - 1).square().sum().backward()
        reference_opt.step()
        opt.zero_grad()
        with model.no_sync():
            model(x * (step + 1)).square().sum().backward()
        # under no_sync: this rank's own gradient, full size, in .grad
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), local, strict=True))
        model(x).square().sum().backward()  # synchronised: reduced into the shards, .grad dropped
        model(x - 1).square().sum().backward()  # another synchronised backward adds onto the reduced gradient
        assert all(p.grad is None for p in model.parameters())
        assert sum(g.numel() for g in opt.shard_grads()) >= sum(p.numel() for p in model.parameters())
        opt.step()
    state = model.module.state_dict()
    assert all(torch.equal(state[n], p) for n, p in reference.named_parameters())
    report = opt.memory_report()
    assert report["gradient_pool"] > 0 and report["gradients"] >= report["gradient_pool"]
