"""Models, data and training loops shared by the pipeline tests (imported by spawned ranks): the same seeded
model trained through ``fastpar.shard.pipeline_model`` on spawned ranks, and in one process over the same
microbatches (the reference)."""

from __future__ import annotations

import torch
from torch import nn

IN, HIDDEN, OUT, VOCAB, TOKENS = 12, 24, 6, 32, 5
MICROBATCHES, BATCH, LR = 4, 8, 1e-2


class Blocks(nn.Module):
    """Not an nn.Sequential: an embedding, a ModuleList of blocks and a head, applied in that order."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.GELU()) for _ in range(4)
        )
        self.head = nn.Linear(HIDDEN, OUT)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)  # (B, T, H)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        return nn.Sequential(
            nn.Linear(IN, HIDDEN),
            nn.Tanh(),
            nn.Linear(HIDDEN, HIDDEN),
            nn.ReLU(),
            nn.Linear(HIDDEN, HIDDEN),
            nn.Tanh(),
            nn.Linear(HIDDEN, HIDDEN),
            nn.Linear(HIDDEN, OUT),
        )
    return Blocks()


def batch(kind: str, step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of one step of one data-parallel replica."""
    gen = torch.Generator().manual_seed(1000 * replica + step)
    if kind == "mlp":
        return torch.randn(BATCH, IN, generator=gen), torch.randn(BATCH, OUT, generator=gen)
    return torch.randint(0, VOCAB, (BATCH, TOKENS), generator=gen), torch.randn(BATCH, TOKENS, OUT, generator=gen)


def train_pipelined(rank: int, world: int, kind: str, stages: int, schedule: str, virtual: int, steps: int) -> dict:
    """``steps`` AdamW steps through the pipeline; this rank's losses, last gradients and parameters."""
    import fastpar.shard as shard

    model = build(kind)
    dp = world // stages
    example, _ = batch(kind, 0, 0)
    pipelined = shard.pipeline_model(
        model,
        stages=stages,
        loss_fn=nn.functional.mse_loss,
        microbatches=MICROBATCHES,
        schedule=schedule,
        example_input=example,
        virtual_stages=virtual,
    )
    optimizer = torch.optim.AdamW(pipelined.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        x, y = batch(kind, step, pipelined.layout.dp_rank)
        losses.append(pipelined.step(x, y))
        grads = {n: p.grad.clone() for n, p in pipelined.module.named_parameters()}
        optimizer.step()
    assert pipelined.layout.dp == dp
    return {
        "losses": losses,
        "grads": grads,
        "params": {n: p.detach().clone() for n, p in pipelined.module.named_parameters()},
        "stage_indices": pipelined.stage_indices,
        "points": pipelined.split.points,
        "replica": pipelined.layout.dp_rank,
        "memory": shard.pipeline_memory_report(pipelined),
        "wrapped": type(pipelined.stages[0].submod).__name__,
    }


def train_reference(kind: str, dp: int, steps: int) -> dict:
    """The same steps in one process: each replica's microbatches accumulated in order as
    ``(loss / microbatches).backward()``, the replicas' gradients then averaged (what DDP's all-reduce does:
    ``g_0 / dp + g_1 / dp``; at dp = 2 the halving is exact, so the sum matches it bit for bit). Run it where
    the ranks run (a spawned rank, one thread): CPU kernels that reduce (LayerNorm's backward) split their sums
    by the thread count."""
    model = build(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses: list[list[torch.Tensor]] = []
    for step in range(steps):
        per_replica_grads, step_losses = [], []
        for replica in range(dp):
            optimizer.zero_grad()
            x, y = batch(kind, step, replica)
            total = None
            for xm, ym in zip(x.tensor_split(MICROBATCHES), y.tensor_split(MICROBATCHES), strict=True):
                loss = nn.functional.mse_loss(model(xm), ym) / MICROBATCHES
                loss.backward()
                total = loss.detach() if total is None else total + loss.detach()
            step_losses.append(total)
            per_replica_grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        for name, p in model.named_parameters():
            p.grad = per_replica_grads[0][name] / dp if dp > 1 else per_replica_grads[0][name]
            for other in per_replica_grads[1:]:
                p.grad += other[name] / dp
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        losses.append(step_losses)
    return {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def pipelined_and_reference(rank: int, world: int, kind: str, stages: int, schedule: str, virtual: int, steps: int):
    """Rank ``rank``'s pipelined training, and on rank 0 also the one-process reference (same process setup)."""
    result = train_pipelined(rank, world, kind, stages, schedule, virtual, steps)
    if rank == 0:
        result["reference"] = train_reference(kind, world // stages, steps)
    return result
