"""The models ``fastpar bench shard --memory`` measures: shapes the memory planner was not tuned on.

  decoder     a 4-block decoder (width 256, vocab 4096), its token embedding tied to the output head (12 MiB)
  cnn         convolutions with BatchNorm (running statistics: buffers, not parameters) on 32 x 32 images
  embedding   one large embedding table (50k x 128) and 24 small Linear layers
  encdec      an encoder-decoder (torch's nn.Transformer, 2 + 2 layers) with its own source and target embeddings
  gpt2        GPT-2 small (124M parameters, tied embedding; Hugging Face ``transformers``, built from its config)

Each is a :class:`ModelCase`: a builder (seeded), a batch maker and a loss ``loss(output, batch)``; a batch that
is a dict is passed as keyword arguments (``model(**batch)``), as the planner's probe calls it. ``tiny=True``
builds the same structure at toy sizes (the tests' runs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...costmodel.reference_transformer import ReferenceTransformer

MODELS = ("decoder", "cnn", "embedding", "encdec", "gpt2")
DEFAULT_MODELS = ("decoder", "cnn", "embedding", "encdec")


@dataclass(frozen=True)
class ModelCase:
    name: str
    describe: str
    build: Callable[[], nn.Module]  # seeded: the same parameters on every rank
    batch: Callable[[int, torch.Generator], Any]  # (per-rank batch size, generator) -> the batch, on CPU
    loss: Callable[[Any, Any], torch.Tensor]  # (model output, batch) -> scalar
    default_batch: int


def call(model: nn.Module, batch: Any) -> Any:
    return model(**batch) if isinstance(batch, dict) else model(batch)


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, dict):
        return {k: v.to(device) for k, v in batch.items()}
    return batch.to(device)


def _seeded(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def seeded() -> nn.Module:
        torch.manual_seed(0)
        return build()

    return seeded


# --- decoder ------------------------------------------------------------------------------------------------
def _tied_decoder(layers: int, hidden: int, vocab: int, seq: int) -> nn.Module:
    model = ReferenceTransformer(layers=layers, hidden=hidden, vocab=vocab, seq_len=seq, ffn_mult=2)
    model.head.out.weight = model.embed.tokens.weight  # (vocab, hidden): one tensor, two uses
    return model


def _decoder(tiny: bool) -> ModelCase:
    layers, hidden, vocab, seq = (2, 32, 256, 16) if tiny else (4, 256, 4096, 128)

    def batch(b: int, gen: torch.Generator) -> torch.Tensor:
        return torch.randint(0, vocab, (b, seq), generator=gen)  # (B, L)

    return ModelCase(
        "decoder",
        f"{layers}-block decoder, width {hidden}, vocab {vocab}, embedding tied to the head, {seq} tokens",
        _seeded(lambda: _tied_decoder(layers, hidden, vocab, seq)),
        batch,
        ReferenceTransformer.loss,
        8,
    )


# --- cnn ----------------------------------------------------------------------------------------------------
class ConvNet(nn.Module):
    """conv-BN-ReLU stages, each halving the image, then global pooling and a linear classifier."""

    def __init__(self, widths: tuple[int, ...], classes: int = 10) -> None:
        super().__init__()
        stages, c = [], 3
        for w in widths:
            stages.append(
                nn.Sequential(
                    nn.Conv2d(c, w, 3, padding=1, bias=False),
                    nn.BatchNorm2d(w),
                    nn.ReLU(),
                    nn.Conv2d(w, w, 3, padding=1, bias=False),
                    nn.BatchNorm2d(w),
                    nn.ReLU(),
                    nn.MaxPool2d(2),
                )
            )
            c = w
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W) -> (B, classes)
        return self.fc(self.stages(x).mean(dim=(2, 3)))


def _classes(out: torch.Tensor, batch: Any) -> torch.Tensor:
    # a fixed target per sample from its position (the benchmark measures memory, not learning)
    target = torch.arange(out.shape[0], device=out.device) % out.shape[-1]
    return F.cross_entropy(out, target)


def _cnn(tiny: bool) -> ModelCase:
    widths, side = ((8, 16), 8) if tiny else ((64, 128, 256), 32)

    def batch(b: int, gen: torch.Generator) -> torch.Tensor:
        return torch.randn(b, 3, side, side, generator=gen)  # (B, C, H, W)

    return ModelCase(
        "cnn",
        f"CNN with BatchNorm, widths {widths}, {side}x{side} images",
        _seeded(lambda: ConvNet(widths)),
        batch,
        _classes,
        32,
    )


# --- one large embedding, many small layers -------------------------------------------------------------------
class EmbeddingTower(nn.Module):
    def __init__(self, vocab: int, hidden: int, depth: int, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(depth))
        self.out = nn.Linear(hidden, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, L) -> (B, classes)
        x = self.embed(ids)
        for layer in self.layers:
            x = x + F.relu(layer(x))
        return self.out(x.mean(dim=1))


def _embedding(tiny: bool) -> ModelCase:
    vocab, hidden, depth, seq = (2048, 16, 6, 8) if tiny else (50_000, 128, 24, 32)

    def batch(b: int, gen: torch.Generator) -> torch.Tensor:
        return torch.randint(0, vocab, (b, seq), generator=gen)

    return ModelCase(
        "embedding",
        f"Embedding({vocab}, {hidden}) + {depth} x Linear({hidden}), {seq} tokens",
        _seeded(lambda: EmbeddingTower(vocab, hidden, depth)),
        batch,
        _classes,
        16,
    )


# --- encoder-decoder ------------------------------------------------------------------------------------------
class EncoderDecoder(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, heads: int) -> None:
        super().__init__()
        self.src_embed = nn.Embedding(vocab, hidden)
        self.tgt_embed = nn.Embedding(vocab, hidden)
        self.transformer = nn.Transformer(
            hidden, heads, layers, layers, dim_feedforward=2 * hidden, dropout=0.0, batch_first=True
        )
        self.head = nn.Linear(hidden, vocab)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:  # (B, S), (B, T) -> (B, T, vocab)
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], device=tgt.device)
        return self.head(self.transformer(self.src_embed(src), self.tgt_embed(tgt), tgt_mask=mask, tgt_is_causal=True))


def _next_token(out: torch.Tensor, batch: dict) -> torch.Tensor:
    tgt = batch["tgt"]
    return F.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), tgt[:, 1:].reshape(-1))


def _encdec(tiny: bool) -> ModelCase:
    vocab, hidden, layers, heads, seq = (256, 32, 1, 2, 16) if tiny else (4096, 256, 2, 4, 64)

    def batch(b: int, gen: torch.Generator) -> dict:
        return {
            "src": torch.randint(0, vocab, (b, seq), generator=gen),
            "tgt": torch.randint(0, vocab, (b, seq), generator=gen),
        }

    return ModelCase(
        "encdec",
        f"encoder-decoder, {layers} + {layers} layers, width {hidden}, vocab {vocab}, {seq} + {seq} tokens",
        _seeded(lambda: EncoderDecoder(vocab, hidden, layers, heads)),
        batch,
        _next_token,
        8,
    )


# --- GPT-2 small ------------------------------------------------------------------------------------------------
def _gpt2(tiny: bool) -> ModelCase:
    from ..._optional import require

    transformers = require("transformers", purpose="bench shard --memory --models gpt2")
    sizes = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=256, n_positions=64) if tiny else {}
    config = transformers.GPT2Config(**sizes)
    seq = 16 if tiny else 128
    vocab = config.vocab_size

    def build() -> nn.Module:
        model = transformers.GPT2LMHeadModel(config)
        model.config.use_cache = False
        return model

    def batch(b: int, gen: torch.Generator) -> dict:
        ids = torch.randint(0, vocab, (b, seq), generator=gen)
        return {"input_ids": ids, "labels": ids}

    return ModelCase(
        "gpt2",
        f"GPT-2 {'(toy size)' if tiny else 'small'}, {config.n_layer} layers, width {config.n_embd}, "
        f"vocab {vocab}, tied embedding, {seq} tokens",
        _seeded(build),
        batch,
        lambda out, _batch: out.loss,
        2,
    )


_CASES = {"decoder": _decoder, "cnn": _cnn, "embedding": _embedding, "encdec": _encdec, "gpt2": _gpt2}


def model_case(name: str, tiny: bool = False) -> ModelCase:
    return _CASES[name](tiny)
