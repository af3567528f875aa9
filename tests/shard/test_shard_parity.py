"""fully_shard_model trains bit-identically to FSDP2 applied by hand (same units, same seed, same precision
policy): losses and every full parameter after AdamW steps, with the model built on the meta device against
the one built eagerly; on gloo and the fastpar backend, 2 and 3 ranks, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from fastpar.launcher import spawn


def _parity_rank(rank: int, world: int, kind: str, precision: str | None, wrap) -> dict:
    import fsdp_training as ft
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fastpar.shard import fully_shard_model, precision_policy, select_units

    build = ft.tiny_transformer if kind == "transformer" else ft.mlp_stack
    ours = fully_shard_model(build, wrap=wrap, mixed_precision=precision, seed=0)
    torch.manual_seed(0)
    reference = build()
    units = select_units(reference, wrap)[:-1]
    policy = precision_policy(precision, torch.device("cpu")) if precision else MixedPrecisionPolicy()
    by_hand = ft.shard_by_hand(reference, units, mp_policy=policy)
    initial = ft.differing(ft.full_parameters(ours), ft.full_parameters(by_hand))
    a, b = ft.train(ours, kind, rank), ft.train(by_hand, kind, rank)
    return {
        "units": units,
        "initial": initial,
        "losses": [x.item() for x in a["losses"]] if a["losses"] != b["losses"] else [],
        "loss_equal": all(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"], strict=True)),
        "params": ft.differing(a["params"], b["params"]),
        "dtype": str(next(iter(a["params"].values())).dtype),
    }


def _check(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert r["units"], f"rank {rank}: no units chosen"
        assert r["initial"] == [], f"rank {rank}: meta-built parameters differ from the eager build: {r['initial']}"
        assert r["loss_equal"], f"rank {rank}: losses differ from FSDP2 by hand: {r['losses']}"
        assert r["params"] == [], f"rank {rank}: parameters differ after training: {r['params']}"
        assert r["dtype"] == "torch.float32", r["dtype"]  # the sharded parameters stay fp32 under bf16 compute


def test_fully_shard_model_matches_fsdp2_by_hand_on_gloo():
    _check(spawn(_parity_rank, 2, "transformer", None, "auto", backend="gloo", timeout=300))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gloo", "fastpar"])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(
    ("kind", "precision", "wrap"),
    [("transformer", None, "auto"), ("transformer", "bf16", "auto"), ("mlp", None, "auto"), ("mlp", None, 300)],
)
def test_fully_shard_model_matches_fsdp2_by_hand(backend, world, kind, precision, wrap):
    if backend == "fastpar":
        import fastpar  # noqa: F401 - registers the backend
    _check(spawn(_parity_rank, world, kind, precision, wrap, backend=backend, timeout=600))
