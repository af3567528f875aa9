"""What a ShardedOptimizer holds per rank, measured by ``memory_report()`` from the tensors themselves: at stage 2
the gradients after backward are this rank's 1/N shards plus the pool's full-size buffers for the buckets in flight
(and during backward at most one more bucket of autograd's gradients, not yet launched, and one large parameter's
gradient being reduced in place); at stage 1 the whole
gradient; parameters in full and optimizer state 1/N at both stages. Spawned gloo ranks (2; 3 with --full)."""

from __future__ import annotations

import pytest
import torch

from fastpar.launcher import spawn

LAYERS, WIDTH, BUCKET_MB = 12, 64, 0.02  # ~16 KiB per layer, ~20 KiB buckets: more buckets than the pool holds


def _rank(rank: int, world_size: int) -> dict:
    import warnings

    import fastpar

    warnings.filterwarnings("ignore")
    out = {}
    for stage in (1, 2):
        torch.manual_seed(0)
        module = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))
        model = fastpar.DDP(module, bucket_cap_mb=BUCKET_MB)
        opt = fastpar.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-3, shard_gradients=stage == 2)
        peak = [0]

        def record(_param, opt=opt, peak=peak):
            peak[0] = max(peak[0], opt.memory_report()["gradients"])

        handles = [p.register_post_accumulate_grad_hook(record) for p in module.parameters()]  # after the reducer's
        gen = torch.Generator().manual_seed(rank)
        for step in range(3):
            opt.zero_grad()
            peak[0] = 0
            model(torch.randn(16, WIDTH, generator=gen)).square().mean().backward()
            if step < 2:
                opt.step()
        for handle in handles:
            handle.remove()
        out[stage] = {
            "stage": opt.stage,
            "after_backward": opt.memory_report(),
            "peak_in_backward": peak[0],
            "grads_none": all(p.grad is None for p in module.parameters()),
            "bucket_bytes": [zb.bucket.numel * 4 for zb in opt._sharded],
        }
        opt.step()
        opt.wait_for_params()
        # between steps a stage-2 bucket holds no pool buffer, and reading its comm_flat (as a memory count or a
        # logger does) borrows none: only acquire_comm_flat() does
        out[stage]["comm_flat_devices"] = {zb.bucket.comm_flat.device.type for zb in opt._sharded}
        out[stage]["lent_between_steps"] = sum(getattr(zb, "buffer", None) is not None for zb in opt._sharded)
    out["model_bytes"] = sum(p.numel() * p.element_size() for p in module.parameters())
    return out


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_stage_two_keeps_a_shard_of_the_gradients_and_a_pool_of_buckets_in_flight(world_size):
    from fastpar.zero.gradient_pool import POOL_CAPACITY

    for rank, out in enumerate(spawn(_rank, world_size, timeout=300)):
        model = out["model_bytes"]
        one, two = out[1], out[2]
        buckets = two["bucket_bytes"]
        assert (one["stage"], two["stage"]) == (1, 2)
        assert len(buckets) > POOL_CAPACITY, "the model must have more buckets than the pool has buffers"
        padding = 4 * len(buckets)  # a shard is ceil(bucket / N) elements: at most one more per bucket
        largest = max(buckets)
        report = two["after_backward"]
        assert set(report) == {"parameters", "gradients", "optimizer_state", "gradient_pool", "total"}
        assert two["grads_none"] and one["grads_none"], f"rank {rank}: .grad is not None after backward"
        # the pool: at most its capacity of the largest bucket (+ the p2p scratch, (N - 1) / N of one), not one per bucket
        assert 0 < report["gradient_pool"] <= POOL_CAPACITY * largest * (2 * world_size - 1) / world_size
        assert report["gradients"] <= model / world_size + padding + report["gradient_pool"], f"rank {rank}: {report}"
        assert report["gradients"] < one["after_backward"]["gradients"]
        # during backward: autograd's gradients are dropped as their bucket launches -- at most one of torch's buckets
        # pending (a cap's worth and the parameter that closed it) -- and at most OWN_IN_FLIGHT parameters larger
        # than the pool's buffers are in flight, each reduced in its own gradient with its point-to-point scratch
        # ((N - 1) / N of it) and, when padded to a multiple of N, a padded copy of the last rank's region (1 / N)
        from fastpar.zero.sharded_gradients import OWN_IN_FLIGHT

        param = WIDTH * WIDTH * 4
        pending = BUCKET_MB * 2**20 + param
        own = OWN_IN_FLIGHT * 2 * param
        assert two["peak_in_backward"] <= model / world_size + padding + report["gradient_pool"] + own + pending
        assert two["comm_flat_devices"] == {"meta"} and two["lent_between_steps"] == 0, f"rank {rank}: {two}"
        assert one["comm_flat_devices"] == {"cpu"}
        # stage 1 keeps the whole gradient, bucket by bucket
        assert one["after_backward"]["gradients"] >= model
        assert one["after_backward"]["gradient_pool"] == 0
        for stage in (one, two):
            measured = stage["after_backward"]
            assert model <= measured["parameters"] <= model + world_size * padding  # replicated, padded buckets
            # AdamW: exp_avg and exp_avg_sq of this rank's shards, and a step count per bucket
            assert 0 < measured["optimizer_state"] <= 2 * (model / world_size + padding) + 8 * len(buckets)
            assert measured["total"] == measured["parameters"] + measured["gradients"] + measured["optimizer_state"]
        # the same state, apart from ZeRO-2's smaller buckets (split to fit its staging): a padding element and a
        # step count more per bucket
        assert abs(one["after_backward"]["optimizer_state"] - report["optimizer_state"]) <= 16 * len(buckets)


def _default_layout(rank: int, world_size: int) -> dict:
    """ZeRO-2 with fastpar's default bucket caps (no bucket_cap_mb) on a model of ~12 MiB."""
    import fastpar

    torch.manual_seed(0)
    module = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(12)))
    model = fastpar.DDP(module)
    opt = fastpar.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-3, shard_gradients=True)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, 512, generator=torch.Generator().manual_seed(rank))).square().mean().backward()
        opt.step()
    opt.wait_for_params()
    return {
        "bucket_bytes": [zb.bucket.numel * 4 for zb in opt._sharded],
        "report": opt.memory_report(),
        "params": [p.detach().clone() for p in module.parameters()],
    }


def test_zero_buckets_on_the_fastpar_backend_are_sized_as_private_buckets():
    """DDP's buckets on the fastpar backend live in shared memory with larger default caps; ZeRO's stay private, so
    they keep the private caps -- else ZeRO-2's pool (buffers the size of the largest bucket) grows several-fold."""
    from fastpar.ddp.buckets import CPU_BUCKET_BYTES

    gloo = spawn(_default_layout, 2, backend="gloo", timeout=300)
    shm = spawn(_default_layout, 2, backend="fastpar", timeout=300)
    for rank in range(2):
        assert shm[rank]["bucket_bytes"] == gloo[rank]["bucket_bytes"]
        assert max(shm[rank]["bucket_bytes"]) <= CPU_BUCKET_BYTES + 512 * 512 * 4
        assert shm[rank]["report"] == gloo[rank]["report"]
        for a, b in zip(shm[rank]["params"], gloo[rank]["params"], strict=True):
            assert torch.equal(a, b)  # and the same bits: each element is one a + b at two ranks
