"""A small decoder-only transformer: the model ``fastpar plan --transformer`` plans for, and the demo trains.

Plain torch (no fastpar import), so every layer of fastpar may build it. Its structure is the one the
sharded strategies cut along: ``embed`` (token + position embeddings), ``blocks`` (identical pre-norm
decoder blocks: causal self-attention, then an MLP), ``head`` (final LayerNorm + an untied output
projection). ``blocks`` are FSDP2's units and the pieces pipeline stages are made of.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DecoderBlock", "ReferenceTransformer", "TransformerConfig"]


@dataclass(frozen=True)
class TransformerConfig:
    layers: int
    hidden: int
    vocab: int
    heads: int = 0  # 0: hidden // 64, at least 1
    seq_len: int = 128  # the longest sequence (the position table's size)
    ffn_mult: int = 4  # MLP width = ffn_mult * hidden

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "vocab", "seq_len", "ffn_mult"):
            if getattr(self, name) < 1:
                raise ValueError(f"transformer {name} must be at least 1, got {getattr(self, name)}")
        if self.hidden % self.n_heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by heads={self.n_heads}; choose heads dividing it")

    @property
    def n_heads(self) -> int:
        return self.heads or max(1, self.hidden // 64)


class Embedding(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(cfg.vocab, cfg.hidden)
        self.positions = nn.Embedding(cfg.seq_len, cfg.hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, L) int64 -> (B, L, H)
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.tokens(ids) + self.positions(positions)


class DecoderBlock(nn.Module):
    """Pre-norm block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.heads = cfg.n_heads
        self.ln_attn = nn.LayerNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.ln_mlp = nn.LayerNorm(cfg.hidden)
        self.fc_in = nn.Linear(cfg.hidden, cfg.ffn_mult * cfg.hidden)
        self.fc_out = nn.Linear(cfg.ffn_mult * cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, L, H)
        b, n, h = x.shape
        q, k, v = self.qkv(self.ln_attn(x)).view(b, n, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads, L, H / heads)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, n, h))
        return x + self.fc_out(F.gelu(self.fc_in(self.ln_mlp(x))))


class Head(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.hidden)
        self.out = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, L, H) -> (B, L, vocab)
        return self.out(self.ln(x))


class ReferenceTransformer(nn.Module):
    """``ReferenceTransformer(layers=4, hidden=256, vocab=1000)`` maps token ids (B, L) to logits (B, L, vocab)."""

    def __init__(
        self, layers: int, hidden: int, vocab: int, heads: int = 0, seq_len: int = 128, ffn_mult: int = 4
    ) -> None:
        super().__init__()
        self.config = TransformerConfig(layers, hidden, vocab, heads, seq_len, ffn_mult)
        self.embed = Embedding(self.config)
        self.blocks = nn.ModuleList(DecoderBlock(self.config) for _ in range(layers))
        self.head = Head(self.config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def example_batch(self, batch_size: int, seq_len: int | None = None, device=None) -> torch.Tensor:
        """Random token ids (B, L) for this model (seeded by the caller)."""
        n = self.config.seq_len if seq_len is None else seq_len
        return torch.randint(0, self.config.vocab, (batch_size, n), device=device)

    @staticmethod
    def loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Next-token cross entropy: position t predicts token t + 1."""
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
