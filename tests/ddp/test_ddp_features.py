"""fastpar DDP features beyond plain parity: comm hooks, grad_dtype, join, static graph, views, stats."""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch

from fastpar.launcher import spawn

sys.path.insert(0, __file__.rsplit("/", 1)[0])


def _equal(a: dict, b: dict) -> list[str]:
    return [k for k in a if not torch.equal(a[k], b[k])]


def _features_rank(rank: int, world_size: int) -> dict:
    from ddp_models import MLP, make_input, train
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import fastpar

    torch_ddp = torch.nn.parallel.DistributedDataParallel
    out = {}

    def hooked(cls, hook, **kw):
        def wrap(m):
            model = cls(m, **kw)
            model.register_comm_hook(None, hook)
            if cls is fastpar.DDP and hook is default_hooks.allreduce_hook:
                model.reducer.set_copy_on_arrival(0)  # hooks see unscaled gradients on this path too
            return model

        return wrap

    for hook in (default_hooks.allreduce_hook, default_hooks.fp16_compress_hook):
        ref = train(hooked(torch_ddp, hook), "mlp", rank, steps=8)
        got = train(hooked(fastpar.DDP, hook), "mlp", rank, steps=8)
        out[f"hook/{hook.__name__}"] = _equal(ref, got)

    ref = train(torch_ddp, "mlp", rank, steps=8)
    for dtype in (torch.bfloat16, torch.float16):

        def copy_on_arrival(m, dtype=dtype):
            model = fastpar.DDP(m, grad_dtype=dtype)
            model.reducer.set_copy_on_arrival(0)  # the CPU path for large gradients
            return model

        got = train(copy_on_arrival, "mlp", rank, steps=8)
        out[f"grad_dtype/{dtype}"] = max((ref[k] - got[k]).abs().max().item() for k in ref)
        no_views = train(
            lambda m, dtype=dtype: fastpar.DDP(m, grad_dtype=dtype, gradient_as_bucket_view=False), "mlp", rank, steps=8
        )
        out[f"grad_dtype/{dtype}/no_views"] = _equal(got, no_views)

        def bucket_pack(m, dtype=dtype):
            model = fastpar.DDP(m, grad_dtype=dtype)
            model.reducer.set_copy_on_arrival(None)  # the GPU path: one pack per complete bucket
            return model

        out[f"grad_dtype/{dtype}/bucket_pack"] = _equal(got, train(bucket_pack, "mlp", rank, steps=8))

    ref = train(lambda m: torch_ddp(m, static_graph=True), "mlp", rank, steps=8)
    got = train(lambda m: fastpar.DDP(m, static_graph=True), "mlp", rank, steps=8)
    out["static_graph"] = _equal(ref, got)

    # gradients are views of the bucket buffers, also after zero_grad(set_to_none=True)
    torch.manual_seed(0)
    model = fastpar.DDP(MLP())
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        model(make_input("mlp", gen)).sum().backward()
    flats = {b.grad_flat.untyped_storage().data_ptr() for b in model.reducer.buckets}
    out["views"] = all(p.grad.untyped_storage().data_ptr() in flats for p in model.parameters())
    out["stats"] = model.comm_stats()
    out["rebuilt"] = model._has_rebuilt_buckets
    tiny = fastpar.DDP(MLP(), bucket_cap_mb=1e-6)
    out["n_buckets_first"] = len(tiny.reducer.buckets)  # torch's first layout: one bucket until the rebuild
    for _ in range(2):  # the second forward rebuilds in the order gradients arrived
        tiny(make_input("mlp", gen)).sum().backward()
    out["n_buckets_bucket_cap"] = len(tiny.reducer.buckets)

    # mixed dtypes: one dtype per bucket, bf16 grads reduced in bf16
    torch.manual_seed(0)
    mixed = MLP()
    mixed.net[2].to(torch.bfloat16)
    model = fastpar.DDP(mixed)
    out["bucket_dtypes"] = sorted({str(p.dtype) for b in model.reducer.buckets for p in b.params})
    out["one_dtype_per_bucket"] = all(len({p.dtype for p in b.params}) == 1 for b in model.reducer.buckets)
    return out


def _join_rank(rank: int, world_size: int) -> list[str]:
    from ddp_models import MLP

    import fastpar

    results = []
    for cls in (torch.nn.parallel.DistributedDataParallel, fastpar.DDP):
        torch.manual_seed(0)
        model = cls(MLP())
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        gen = torch.Generator().manual_seed(rank)
        batches = [torch.randn(8, 16, generator=gen) for _ in range(3 + 2 * rank)]  # uneven
        with model.join():
            for x in batches:
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
        results.append({k: v.clone() for k, v in model.module.state_dict().items()})
    return _equal(*results)


@pytest.fixture(scope="module")
def features():
    return spawn(_features_rank, 2, timeout=240)


@pytest.mark.parametrize("hook", ["allreduce_hook", "fp16_compress_hook"])
def test_torch_comm_hooks_match_torch_ddp(features, hook):
    for rank_result in features:
        assert rank_result[f"hook/{hook}"] == []


@pytest.mark.parametrize("dtype", ["torch.bfloat16", "torch.float16"])
def test_low_precision_reduction_on_gloo_stays_close(features, dtype):
    for rank_result in features:
        assert 0 < rank_result[f"grad_dtype/{dtype}"] < 2e-2  # rounded, but the same training
        assert rank_result[f"grad_dtype/{dtype}/no_views"] == []  # same arithmetic with separate .grad tensors
        assert rank_result[f"grad_dtype/{dtype}/bucket_pack"] == []


def test_static_graph_matches(features):
    assert all(r["static_graph"] == [] for r in features)


def test_grads_are_bucket_views_and_stats(features):
    for r in features:
        assert r["views"] is True
        assert r["rebuilt"] is True
        assert r["stats"]["collectives"] >= 1 and r["stats"]["bytes"] == sum(
            p * 4 for p in (16 * 32 + 32, 32 * 32 + 32, 32 * 8 + 8)
        )
        assert r["stats"]["wait_s"] >= 0 and r["stats"]["step"] == 3
        assert r["n_buckets_first"] == 1
        assert r["n_buckets_bucket_cap"] == 6  # after the rebuild every tensor over the tiny cap has its own bucket


def test_mixed_dtypes_get_separate_buckets(features):
    for r in features:
        assert r["bucket_dtypes"] == ["torch.bfloat16", "torch.float32"]
        assert r["one_dtype_per_bucket"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gloo", "fastpar"])  # fastpar: its buckets live in shared memory
def test_join_with_uneven_inputs_matches_torch(backend):
    assert spawn(_join_rank, 2, backend=backend, timeout=120) == [[], []]


def _accumulate_rank(rank: int, world_size: int) -> dict:
    """Gradient accumulation as accelerate and Fabric run it: forward and backward inside ``no_sync()``, so the
    very first iteration of a static graph is not synchronised."""
    from ddp_models import MODELS, Unused, make_input

    import fastpar

    class AlwaysUnused(Unused):  # a static graph with an unused layer: ``never`` stays unused on every step
        def forward(self, x, step=0, rank=0):
            return self.out(torch.tanh(self.body(x))) + self.sometimes(x[:, :16])

    torch_ddp = torch.nn.parallel.DistributedDataParallel
    runs = {
        "mlp": ("mlp", None),
        "mlp_three_micro": ("mlp", None),
        "ckpt_middle_reentrant": ("ckpt_middle_reentrant", None),
        "unused_layer": ("unused", AlwaysUnused),
    }
    out = {}
    for name, (kind, module_cls) in runs.items():
        micro = 3 if name == "mlp_three_micro" else 2
        reference_args = {"find_unused_parameters": True} if module_cls is not None else {}
        states = []
        for cls, args in ((torch_ddp, reference_args), (fastpar.DDP, {"static_graph": True})):
            torch.manual_seed(0)
            model = cls((module_cls or MODELS[kind])(), **args)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
            gen = torch.Generator().manual_seed(100 + rank)
            for step in range(6):
                opt.zero_grad()
                for m in range(micro):
                    ctx = model.no_sync() if m < micro - 1 else contextlib.nullcontext()
                    with ctx:
                        model(make_input(kind, gen), step=step, rank=rank).square().mean().backward()
                opt.step()
            states.append({k: v.detach().clone() for k, v in model.module.state_dict().items()})
        out[name] = _equal(*states)
    return out


def test_static_graph_whose_first_iteration_is_under_no_sync_matches_torch_without_static_graph():
    for rank_result in spawn(_accumulate_rank, 2, timeout=300):
        assert rank_result == {"mlp": [], "mlp_three_micro": [], "ckpt_middle_reentrant": [], "unused_layer": []}


def _join_unused_rank(rank: int, world_size: int) -> dict:
    """join() with find_unused_parameters: rank 0 runs out of batches first. Its last synchronised step used
    ``sometimes`` (even step), so in the shadowed steps torch counts that layer as used: rank 1 then gets a zero
    gradient for it (momentum and weight decay move it), where a map of zeros would leave its .grad None."""
    from ddp_models import Unused

    import fastpar

    steps = {0: 3, 1: 7}[rank]
    history = []
    for cls in (torch.nn.parallel.DistributedDataParallel, fastpar.DDP):
        torch.manual_seed(0)
        model = cls(Unused(), find_unused_parameters=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
        gen = torch.Generator().manual_seed(rank)
        snapshots = []
        with model.join():
            for step in range(steps):
                opt.zero_grad()
                model(torch.randn(8, 16, generator=gen), step=step, rank=rank).square().mean().backward()
                opt.step()
                grads = {n: p.grad is None for n, p in model.module.named_parameters()}
                snapshots.append(({k: v.clone() for k, v in model.module.state_dict().items()}, grads))
        snapshots.append(({k: v.clone() for k, v in model.module.state_dict().items()}, {}))
        history.append(snapshots)
    differ = []
    for step, ((ref, ref_none), (got, got_none)) in enumerate(zip(*history, strict=True)):
        differ += [f"step {step}: {k}" for k in _equal(ref, got)]
        differ += [
            f"step {step}: {n}.grad is None: torch {ref_none[n]}" for n in ref_none if ref_none[n] != got_none[n]
        ]
    torch_run = history[0]  # rank 0 joins after 3 steps: does torch move "sometimes" in the shadowed steps?
    moved = not torch.equal(torch_run[2][0]["sometimes.weight"], torch_run[-1][0]["sometimes.weight"])
    return {"differ": differ, "sometimes_moved_in_shadow": moved}


@pytest.mark.parametrize("backend", ["gloo", "fastpar"])
def test_join_with_unused_parameters_matches_torch(backend):
    results = spawn(_join_unused_rank, 2, backend=backend, timeout=180)
    differ = {f"rank {rank}": r["differ"] for rank, r in enumerate(results) if r["differ"]}
    assert not differ, f"differs from torch DDP: {differ}"
    assert results[1]["sometimes_moved_in_shadow"]  # the case exercises the joined rank's used map
