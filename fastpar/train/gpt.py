"""A small GPT-style decoder for next-token training: what ``fastpar lm-demo`` and ``fastpar bench lm`` train.

Token embeddings tied to the LM head, learned positions, pre-LayerNorm blocks of causal self-attention
(``F.scaled_dot_product_attention(is_causal=True)``) and a GELU MLP, GPT-2's initialisation (normal(0, 0.02),
residual projections scaled by 1/sqrt(2 * n_layer)). No dropout: runs with the same seed and batches are
deterministic. ``forward(x)`` returns logits; :func:`lm_loss` is the next-token cross-entropy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

BYTE_VOCAB = 257  # the 256 byte values and the end-of-text id of fastpar's "bytes" tokenizer


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = BYTE_VOCAB
    seq_len: int = 128  # the longest sequence the learned positions cover
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_embd={self.n_embd} must be a multiple of n_head={self.n_head}")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape  # (B, T, C)
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # a token sees itself and earlier ones only
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-LayerNorm: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(), nn.Linear(4 * config.n_embd, config.n_embd)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """``GPT(GPTConfig(...))`` or ``GPT(n_layer=..., ...)``; ``forward(x)``: (B, T) token ids -> (B, T, vocab) logits."""

    def __init__(self, config: GPTConfig | None = None, **sizes: int) -> None:
        super().__init__()
        self.config = config = config or GPTConfig(**sizes)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.seq_len, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one (vocab, n_embd) matrix embeds and predicts
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                # residual projections: the residual stream's variance stays put as blocks add up (GPT-2)
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        """Parameters, the tied embedding counted once."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        if t > self.config.seq_len:
            raise ValueError(f"a sequence of {t} tokens is longer than the model's seq_len {self.config.seq_len}")
        positions = torch.arange(t, device=x.device)
        h = self.wte(x) + self.wpe(positions)  # (B, T, C)
        for block in self.blocks:
            h = block(h)
        return self.lm_head(self.ln_f(h))  # (B, T, vocab)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of (B, T, vocab) logits against (B, T) target ids, in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


__all__ = ["BYTE_VOCAB", "GPT", "GPTConfig", "lm_loss"]
