"""Acceptance: fastpar DDP gives bit-identical parameters to torch DDP, run side by side on spawned gloo ranks
(world sizes 2 and 3; 12 SGD steps with momentum and weight decay; inputs differing per rank), and the same
parameters on every rank. Each case is compared with torch's DDP given the same arguments.

fastpar variants: ``views`` (the default: gradients live in the buckets, torch's default arithmetic),
``copy_on_arrival`` (every gradient copied into its bucket as it arrives: the CPU path for large tensors),
``bucket_pack`` (one pack per complete bucket: the GPU path), ``no_views`` (separate ``.grad``), and
``torch_views`` (``gradient_as_bucket_view=True`` against torch's ``True``).
"""

from __future__ import annotations

import pytest
import torch
from selection import selected_params

from fastpar.launcher import spawn

# name -> (model kind, DDP arguments, train() arguments)
CASES = {
    "mlp": ("mlp", {}, {}),
    "cnn_batchnorm": ("cnn", {}, {}),
    "cnn_channels_last": ("cnn", {}, {"channels_last": True}),
    "resnet": ("resnet", {}, {}),
    "resnet_channels_last": ("resnet", {}, {"channels_last": True}),
    "resnet_channels_last_static": ("resnet", {"static_graph": True}, {"channels_last": True}),
    "strided_params": ("strided", {}, {}),
    "unused_find_unused": ("unused", {"find_unused_parameters": True}, {}),
    "unused_find_unused_zero_grads": ("unused", {"find_unused_parameters": True}, {"set_to_none": False}),
    "no_sync_find_unused": ("unused", {"find_unused_parameters": True}, {"accumulate": "no_sync"}),
    "no_sync_accumulation": ("mlp", {}, {"accumulate": "no_sync"}),
    "require_backward_grad_sync_attr": ("mlp", {}, {"accumulate": "attr"}),
    "tied_weights": ("tied", {}, {}),
    "frozen_layers": ("frozen", {}, {}),
    "zero_grad_set_to_none_false": ("mlp", {}, {"set_to_none": False}),
    "cnn_zero_grads_accumulate": ("cnn", {}, {"set_to_none": False, "accumulate": "attr"}),
    "static_graph": ("mlp", {"static_graph": True}, {}),
    "static_graph_no_sync": ("mlp", {"static_graph": True}, {"accumulate": "no_sync"}),
    "ckpt_middle_reentrant": ("ckpt_middle_reentrant", {}, {}),
    "ckpt_last_reentrant": ("ckpt_last_reentrant", {}, {}),
    "ckpt_all_reentrant": ("ckpt_all_reentrant", {}, {}),
    "ckpt_middle_reentrant_static": ("ckpt_middle_reentrant", {"static_graph": True}, {}),
    "ckpt_last_reentrant_static": ("ckpt_last_reentrant", {"static_graph": True}, {}),
    "ckpt_middle": ("ckpt_middle", {}, {}),
    "ckpt_last": ("ckpt_last", {}, {}),
    "ckpt_middle_static": ("ckpt_middle", {"static_graph": True}, {}),
    "ckpt_last_static": ("ckpt_last", {"static_graph": True}, {}),
    "ckpt_last_find_unused": ("ckpt_last", {"find_unused_parameters": True}, {}),
    "gradient_clipping": ("mlp", {}, {"clip": 0.05}),
    "bf16_autocast": ("cnn", {}, {"autocast": True}),
    "two_forwards_one_loss": ("mlp", {}, {"forwards": 2}),
    "broadcast_buffers_false": ("cnn", {"broadcast_buffers": False}, {}),
    "torch_save_roundtrip": ("cnn", {}, {"roundtrip": "save"}),
    "deepcopy_roundtrip": ("mlp", {}, {"roundtrip": "deepcopy"}),
    "small_buckets": ("resnet", {"bucket_cap_mb": 0.004}, {}),
}
# the default suite's cases (the rest are marked slow and run with --full)
FAST_CASES = ("mlp", "cnn_batchnorm", "unused_find_unused", "no_sync_accumulation", "static_graph")
VARIANTS = ("views", "copy_on_arrival", "bucket_pack", "no_views", "torch_views")
THREE_RANK_VARIANTS = ("views", "no_views", "torch_views")


def _fastpar(module, ddp_args: dict, variant: str):
    import fastpar

    views = {"no_views": False, "torch_views": True}.get(variant)
    model = fastpar.DDP(module, gradient_as_bucket_view=views, **ddp_args)
    if variant in ("copy_on_arrival", "bucket_pack"):
        model.reducer.set_copy_on_arrival(0 if variant == "copy_on_arrival" else None)
    return model


def _torch(module, ddp_args: dict, variant: str):
    return torch.nn.parallel.DistributedDataParallel(
        module, gradient_as_bucket_view=variant == "torch_views", **ddp_args
    )


def _matrix_rank(rank: int, world_size: int, variants: tuple[str, ...], names: tuple[str, ...] = ()) -> dict:
    import sys
    import warnings

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from ddp_models import train

    warnings.filterwarnings("ignore")  # torch's checkpoint and DDP notices, once per case
    outcome = {}
    for name, (kind, ddp_args, train_args) in CASES.items():
        if names and name not in names:
            continue
        references = {}
        for variant in variants:
            ref_key = "torch_views" if variant == "torch_views" else "default"
            if ref_key not in references:
                references[ref_key] = train(lambda m, v=variant, a=ddp_args: _torch(m, a, v), kind, rank, **train_args)
            ref = references[ref_key]
            try:
                got = train(lambda m, v=variant, a=ddp_args: _fastpar(m, a, v), kind, rank, **train_args)
            except Exception as exc:  # report per case, keep the ranks in step
                outcome[f"{name}/{variant}"] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            outcome[f"{name}/{variant}"] = {
                "differ": [k for k in ref if not torch.equal(ref[k], got[k])],
                "state": got,
            }
    return outcome


def _check(results: list[dict], case: str, variant: str) -> None:
    key = f"{case}/{variant}"
    for rank, outcome in enumerate(results):
        entry = outcome[key]
        assert "error" not in entry, f"rank {rank}: {entry.get('error')}"
        assert entry["differ"] == [], f"rank {rank}: differs from torch DDP in {entry['differ']}"
    first = results[0][key]["state"]
    for rank, outcome in enumerate(results[1:], start=1):
        other = outcome[key]["state"]
        assert all(torch.equal(first[k], other[k]) for k in first if "running" not in k and "batches" not in k), (
            f"rank {rank} holds different parameters than rank 0"
        )


@pytest.fixture(scope="module")
def two_ranks(request):
    return spawn(_matrix_rank, 2, VARIANTS, selected_params(request, "case"), timeout=900)


@pytest.fixture(scope="module")
def three_ranks(request):
    return spawn(_matrix_rank, 3, THREE_RANK_VARIANTS, selected_params(request, "case"), timeout=900)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", [c if c in FAST_CASES else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_bit_identical_to_torch_ddp_two_ranks(two_ranks, case, variant):
    _check(two_ranks, case, variant)


@pytest.mark.slow
@pytest.mark.parametrize("variant", THREE_RANK_VARIANTS)
@pytest.mark.parametrize("case", list(CASES))
def test_bit_identical_to_torch_ddp_three_ranks(three_ranks, case, variant):
    _check(three_ranks, case, variant)
