"""Building on the meta device: the materialised shards hold exactly the values of the model built eagerly with
the same seed and then sharded (torch.equal on every gathered parameter and buffer, and the RNG state after),
with reset_parameters(), an init_fn and buffers -- also for the cases a replay in module order got wrong: a head
tied to the embedding after construction, blocks constructed before the embedding they are registered after, an
init_fn that writes one module's weight from another's, a buffer computed in __init__, and a Hugging Face GPT-2
built from a config (initialised by post_init); the full model is never alive on a rank (peak bytes measured
against the eager path, which must exceed them); and a tensor nothing initialises is refused on every rank."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from fastpar.launcher import spawn

WIDTH, DEPTH = 256, 8


class WithBuffers(nn.Module):
    """Embedding, repeated blocks with BatchNorm (floating and integer buffers), an untied head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(30, 16)
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16)) for _ in range(3)))
        self.head = nn.Linear(16, 7)

    def forward(self, tokens):
        return self.head(self.blocks(self.embed(tokens)))


class ComputedBuffer(nn.Module):
    """A buffer computed in __init__ (as rotary tables are): replayed like any other call of the construction."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("table", torch.arange(8.0), persistent=False)

    def forward(self, x):
        return self.proj(x) + self.table


class TiedLateDecoder(nn.Module):
    """GPT-2's pattern: blocks constructed before the embedding they are registered after, and the head tied to the
    embedding after construction (the head's own draw is made, then dropped)."""

    def __init__(self) -> None:
        super().__init__()
        blocks = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)) for _ in range(2)))
        self.embed = nn.Embedding(40, 16)
        self.blocks = blocks
        self.head = nn.Linear(16, 40, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(self.blocks(self.embed(tokens)))


def pair_init(module: nn.Module) -> None:
    """An init_fn that touches several modules: one block's weight drawn, the next one's derived from it."""
    if isinstance(module, TiedLateDecoder):
        nn.init.normal_(module.blocks[0][0].weight, std=0.02)
        module.blocks[1][0].weight.data.copy_(module.blocks[0][0].weight.data * 0.5)


class Unfilled(nn.Module):
    """A parameter made with torch.empty and never written: nothing to replay."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.empty(8))

    def forward(self, x):
        return self.proj(x) * self.scale


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def _compare(build, init_fn=None, wrap="root") -> dict:
    import fsdp_training as ft

    from fastpar.shard import build_eager, fully_shard_model

    meta = fully_shard_model(build, wrap=wrap, seed=5, init_fn=init_fn)
    meta_rng = torch.get_rng_state()
    eager = fully_shard_model(build_eager(build, seed=5, init_fn=init_fn), wrap=wrap)
    return {
        "params": ft.differing(ft.full_parameters(meta), ft.full_parameters(eager)),
        "buffers": ft.differing(dict(meta.named_buffers()), dict(eager.named_buffers())),
        "rng": torch.equal(meta_rng, torch.get_rng_state()),
        "tied": meta.head.weight is meta.embed.weight if isinstance(meta, TiedLateDecoder) else None,
    }


def _replay_rank(rank: int, world: int, with_transformers: bool) -> dict:
    out = {
        "tied": _compare(TiedLateDecoder),
        "tied+init_fn": _compare(TiedLateDecoder, pair_init),
        "computed buffer": _compare(ComputedBuffer),
    }
    if with_transformers:
        out["gpt2"] = _compare(_gpt2)
    try:
        _compare(Unfilled)
        out["refused"] = ""
    except ValueError as exc:
        out["refused"] = str(exc)
    return out


@pytest.mark.slow
def test_meta_building_replays_the_construction_in_the_order_it_ran():
    with_transformers = True
    try:
        import transformers  # noqa: F401
    except ImportError:  # the compat extra brings it; the rest of the test runs without
        with_transformers = False
    for rank, r in enumerate(spawn(_replay_rank, 2, with_transformers, backend="gloo", timeout=300)):
        refused = r.pop("refused")
        for case, got in r.items():
            assert got["params"] == [] and got["buffers"] == [], f"rank {rank} {case}: meta-built differs: {got}"
            assert got["rng"], f"rank {rank} {case}: the global RNG ends elsewhere than after the eager build"
        assert r["tied"]["tied"] and r["tied+init_fn"]["tied"], f"rank {rank}: the tie was lost: {r}"
        assert "scale" in refused and "never filled" in refused and "proj" not in refused, refused


def _meta_rank(rank: int, world: int) -> dict:
    import fsdp_training as ft

    from fastpar.shard import build_eager, fully_shard_model

    out = {}
    # values: meta-built == eager-built, with reset_parameters, init_fn and buffers; the RNG ends where it would
    for init_fn in (None, ft.gpt_style_init):
        meta = fully_shard_model(WithBuffers, wrap="auto", seed=3, init_fn=init_fn)
        meta_rng = torch.get_rng_state()
        eager = fully_shard_model(build_eager(WithBuffers, seed=3, init_fn=init_fn), wrap="auto")
        eager_rng = torch.get_rng_state()
        out[f"params/{init_fn is not None}"] = ft.differing(ft.full_parameters(meta), ft.full_parameters(eager))
        out[f"buffers/{init_fn is not None}"] = ft.differing(dict(meta.named_buffers()), dict(eager.named_buffers()))
        out[f"rng/{init_fn is not None}"] = torch.equal(meta_rng, eager_rng)
    # memory: the meta path never holds the model; the eager path does (so the measurement can see it)
    build = functools.partial(ft.mlp_stack, WIDTH, DEPTH)
    with ft.LiveBytes() as on_meta:
        fully_shard_model(build, wrap="auto")
    with ft.LiveBytes() as eagerly:
        fully_shard_model(build_eager(build), wrap="auto")
    out["peak_meta"], out["peak_eager"] = on_meta.peak, eagerly.peak
    return out


@pytest.mark.slow
def test_meta_building_equals_eager_building_and_never_holds_the_model():
    model_bytes = DEPTH * (WIDTH * WIDTH + WIDTH) * 4
    largest_module = (WIDTH * WIDTH + WIDTH) * 4
    world = 2
    for rank, r in enumerate(spawn(_meta_rank, world, backend="gloo", timeout=300)):
        for key in ("params/False", "params/True", "buffers/False", "buffers/True"):
            assert r[key] == [], f"rank {rank} {key}: meta-built differs from eager-built: {r[key]}"
        assert r["rng/False"] and r["rng/True"], (
            f"rank {rank}: the global RNG ends elsewhere than after the eager build"
        )
        assert r["peak_eager"] >= model_bytes, f"rank {rank}: the measurement missed the eager model: {r}"
        # this rank's shards + one module's parameters in full (the scratch), + 4 KiB for small temporaries
        bound = model_bytes // world + largest_module + 4096
        assert r["peak_meta"] <= bound, f"rank {rank}: {r['peak_meta']} bytes alive at once, over {bound}: {r}"


def _cuda_rank(rank: int, world: int) -> dict:
    import fsdp_training as ft

    from fastpar.shard import build_eager, fully_shard_model

    device = torch.device("cuda", torch.cuda.current_device())
    meta = fully_shard_model(WithBuffers, wrap="auto", seed=3, init_fn=ft.gpt_style_init, mixed_precision="bf16")
    eager = fully_shard_model(
        build_eager(WithBuffers, device=device, seed=3, init_fn=ft.gpt_style_init), mixed_precision="bf16"
    )
    losses = []
    for model in (meta, eager):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(3):
            tokens = torch.randint(0, 30, (8,), generator=torch.Generator().manual_seed(step + 10 * rank))
            loss = model(tokens.to(device)).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
    return {
        "device": str(next(meta.parameters()).device),
        "params": ft.differing(ft.full_parameters(meta), ft.full_parameters(eager)),
        "losses": all(torch.equal(x, y) for x, y in zip(losses[:3], losses[3:], strict=True)),
    }


@pytest.mark.cuda
@pytest.mark.slow
def test_meta_building_on_cuda_with_nccl():
    world = min(torch.cuda.device_count(), 2)
    for rank, r in enumerate(spawn(_cuda_rank, world, backend="nccl", timeout=300)):
        assert r["device"].startswith("cuda"), r
        assert r["params"] == [] and r["losses"], f"rank {rank}: meta-built on CUDA differs from eager-built: {r}"
