"""Loss scaling under ZeRO: ``fastpar.ShardedGradScaler`` with ``ShardedOptimizer`` (stages 1 and 2) gives torch DDP + AdamW +
``torch.amp.GradScaler`` bit for bit -- unscaling and the inf check on the shards, the skipped step on every rank
when one rank's batch overflows, the same scale after every ``update()`` -- with and without ``unscale_`` before
clipping, on spawned gloo ranks (2 and 3)."""

from __future__ import annotations

import pytest
import torch

from fastpar.launcher import spawn

STEPS, OVERFLOW_STEP = 6, 2


def _rank(rank: int, world_size: int, clip: bool, plain: bool = False) -> dict:
    import warnings

    from ddp_models import MLP

    import fastpar

    warnings.filterwarnings("ignore")
    out = {}
    for impl in ("torch", "zero", "zero2"):
        torch.manual_seed(0)
        module = MLP()
        scaler_args = {"init_scale": 2.0**10, "growth_interval": 2}
        if impl == "torch":
            model = torch.nn.parallel.DistributedDataParallel(module, bucket_cap_mb=0.002)  # the same buckets
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
            scaler = torch.amp.GradScaler("cpu", **scaler_args)
        else:
            model = fastpar.DDP(module, bucket_cap_mb=0.002)  # several buckets, shards cut parameters
            optimizer = fastpar.ShardedOptimizer(
                model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, shard_gradients=impl == "zero2"
            )
            scaler = (torch.amp.GradScaler if plain else fastpar.ShardedGradScaler)("cpu", **scaler_args)
        gen = torch.Generator().manual_seed(100 + rank)
        scales, norms = [], []
        for step in range(STEPS):
            optimizer.zero_grad()
            x = torch.randn(8, 16, generator=gen)
            if step == OVERFLOW_STEP and rank == world_size - 1:
                x[0, 0] = float("inf")  # one rank's batch overflows: every rank must skip this step
            scaler.scale(model(x).square().mean()).backward()
            if clip:
                scaler.unscale_(optimizer)
                if impl != "torch":
                    norms.append(optimizer.clip_grad_norm_(0.05).item())
                else:
                    norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05).item())
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
        state = model.module.state_dict()  # waits for ZeRO's last all-gather
        out[impl] = {
            "params": [state[n].clone() for n, _ in module.named_parameters()],
            "scales": scales,
            "norms": norms,
        }
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("clip", [False, True], ids=["step", "unscale_then_clip"])
def test_sharded_grad_scaler_matches_torch_ddp_with_grad_scaler(world_size, clip):
    for rank, out in enumerate(spawn(_rank, world_size, clip, timeout=300)):
        torch_run = out["torch"]
        assert torch_run["scales"][OVERFLOW_STEP] == torch_run["scales"][OVERFLOW_STEP - 1] / 2  # the step was skipped
        for stage in ("zero", "zero2"):
            zero_run, where = out[stage], f"rank {rank}, {stage}"
            assert zero_run["scales"] == torch_run["scales"], where
            assert list(map(repr, zero_run["norms"])) == list(map(repr, torch_run["norms"])), where  # nan too
            differ = [
                i
                for i, (a, b) in enumerate(zip(torch_run["params"], zero_run["params"], strict=True))
                if not torch.equal(a, b)
            ]
            assert differ == [], f"{where}: parameters {differ} differ from torch DDP + GradScaler"


def _plain_unscale(rank: int, world_size: int, backend: str, zero2: bool) -> str:
    from ddp_models import MLP

    import fastpar

    model = fastpar.DDP(MLP(), bucket_cap_mb=0.002)
    optimizer = fastpar.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-2, shard_gradients=zero2)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.randn(8, 16)).square().mean()).backward()
    scaler.unscale_(optimizer)  # finds no .grad: the shards stay scaled
    with pytest.raises(RuntimeError, match="fastpar.ShardedGradScaler") as error:
        scaler.step(optimizer)
    return str(error.value)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gloo", "fastpar"])
def test_plain_grad_scaler_matches_torch_ddp_with_grad_scaler(backend):
    """A plain ``torch.amp.GradScaler`` hands the step to ShardedOptimizer, which unscales the shards: the
    same scales (the overflow step skipped on every rank) and parameters as torch DDP + GradScaler."""
    for rank, out in enumerate(spawn(_rank, 2, False, True, backend=backend, timeout=300)):
        for stage in ("zero", "zero2"):
            assert out[stage]["scales"] == out["torch"]["scales"], f"rank {rank}, {stage}"
            for a, b in zip(out["torch"]["params"], out[stage]["params"], strict=True):
                assert torch.equal(a, b), f"rank {rank}, {stage}"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gloo", "fastpar"])
@pytest.mark.parametrize("zero2", [False, True], ids=["zero1", "zero2"])
def test_plain_grad_scaler_unscale_fails_loudly_in_the_first_step(backend, zero2):
    for message in spawn(_plain_unscale, 2, backend, zero2, backend=backend, timeout=300):
        assert "ShardedGradScaler" in message
