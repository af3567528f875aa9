"""``fastpar shard-demo``: train a transformer whose fp32 model state is several times one process's memory
budget, with the sharding strategy the memory planner picks.

The model is fastpar's reference decoder (``fastpar.costmodel.reference_transformer``); the data are token
sequences that follow a fixed rule (each token determines the next), so the loss falls from ln(vocab)
towards zero within a few dozen steps. The run:

1. prints the model's fp32 model state (parameters + gradients + AdamW's two moments) against the budget,
2. trains with ``TrainingOptions(sharding="auto", memory_budget=...)``: the Trainer asks the planner with a
   real batch, prints the plan, and refuses the run before the first step if nothing fits,
3. after the first step every process measures the parameters, gradients and optimizer state it really
   holds; the largest is checked against the budget and printed beside the plan's prediction,
4. prints the loss curve's start and end.
"""

from __future__ import annotations

import argparse
import functools
import math
import tempfile
from pathlib import Path

import torch

from ..costmodel.plan_result import fmt_bytes, parse_bytes
from ..costmodel.reference_transformer import ReferenceTransformer
from ..user_errors import UserError
from .options import TrainingOptions
from .trainer import Trainer

_STATE_BYTES_PER_PARAMETER = 16  # fp32: the parameter, its gradient, AdamW's exp_avg and exp_avg_sq
_RULE = (7, 3)  # token t+1 = (7 * token t + 3) mod vocab: a permutation of the vocabulary when gcd(7, vocab) = 1


def rule_sequences(count: int, seq_len: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """``count`` sequences (count, seq_len) of token ids, each token fixed by the one before it."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.empty(count, seq_len, dtype=torch.long)
    ids[:, 0] = torch.randint(0, vocab, (count,), generator=gen)
    a, b = _RULE
    for t in range(1, seq_len):
        ids[:, t] = (a * ids[:, t - 1] + b) % vocab
    return ids


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fastpar shard-demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12, help="decoder blocks (default 12)")
    p.add_argument("--hidden", type=int, default=256, help="model width (default 256)")
    p.add_argument("--vocab", type=int, default=512, help="vocabulary size (default 512)")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sequence (default 32)")
    p.add_argument("--processes", type=int, default=4, help="CPU processes (default 4)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per process per step (default 4)")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps (default 40)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate (default 3e-3)")
    p.add_argument(
        "--memory-budget",
        default=None,
        help="bytes each process may hold, e.g. 64MiB (default: a third of the model's fp32 model state)",
    )
    p.add_argument("--dir", type=Path, default=None, help="where outputs go (default: a new temp folder)")
    return p


def adamw(params, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for name in ("layers", "hidden", "vocab", "seq_len", "processes", "batch_size", "steps"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if math.gcd(_RULE[0], args.vocab) != 1:
        raise UserError(f"--vocab {args.vocab} is a multiple of {_RULE[0]}: the demo's rule needs one that is not")
    build = functools.partial(
        ReferenceTransformer, layers=args.layers, hidden=args.hidden, vocab=args.vocab, seq_len=args.seq_len
    )
    with torch.device("meta"):
        parameters = sum(p.numel() for p in build().parameters())
    state = parameters * _STATE_BYTES_PER_PARAMETER
    budget = parse_bytes(args.memory_budget) if args.memory_budget is not None else state // 3
    print(
        f"fastpar shard-demo: a {args.layers}-block transformer, {parameters / 1e6:.2f}M parameters: fp32 model state "
        f"{fmt_bytes(state)} = {state / budget:.1f}x the memory budget of {fmt_bytes(budget)} per process, "
        f"{args.processes} processes"
    )
    root = args.dir or Path(tempfile.mkdtemp(prefix="fastpar-shard-demo-"))
    samples = args.steps * args.batch_size * args.processes
    ids = rule_sequences(samples, args.seq_len, args.vocab)
    opts = TrainingOptions(
        max_epochs=1,
        batch_size=args.batch_size,
        execution_environment="cpu",
        devices=args.processes,
        sharding="auto",
        memory_budget=budget,
        log_every=5,
        progress_bar=False,
        output_dir=str(root / "output"),
    )
    trainer = Trainer(build, functools.partial(adamw, lr=args.lr), ReferenceTransformer.loss, (ids, ids), options=opts)
    result = trainer.fit()
    measured = result.model_state_bytes
    print(
        f"\nmeasured model state on the largest process: {fmt_bytes(measured['total'])} "
        f"(parameters {fmt_bytes(measured['parameters'])}, gradients {fmt_bytes(measured['gradients'])}, "
        f"optimizer state {fmt_bytes(measured['optimizer_state'])}) with sharding={result.sharding!r}: "
        f"{'within' if measured['total'] <= budget else 'OVER'} the budget of {fmt_bytes(budget)}"
    )
    losses = [r["loss"] for r in result.history if r.get("loss") is not None]
    print(
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {result.steps} steps (ln(vocab) = {math.log(args.vocab):.3f})"
    )
    print(f"metrics        {result.metrics_path}")
    return 0 if measured["total"] <= budget and losses[-1] < losses[0] else 1
