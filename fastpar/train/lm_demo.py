"""``fastpar lm-demo``: train a small GPT-style decoder on the Python standard library's own sources.

Text every machine has offline: the ``.py`` files at the top of the standard library's folder, sorted by
name and taken until they hold 2 MB (0.3 MB with ``--quick``), tokenized byte by byte (256 byte values and an end-of-text id) by
:func:`fastpar.data.prepare_tokens` into ``DIR/tokens``. The model is :class:`fastpar.train.gpt.GPT` (tied
embeddings, causal attention); the Trainer runs it on CPU processes with ``sharding="auto"``, bf16 autocast
where the CPU computes in bf16 natively (AVX512-BF16/AMX; elsewhere full precision), validation on the held-out
files, checkpoints, TensorBoard and CSV logs and the training-progress plot.

The loss starts at ln(257) ~ 5.55 (uniform over bytes); the run exits 1 unless the final validation loss is
below ``--threshold`` (default 2.5 nats per byte). On the default text, predicting each byte from its frequency
alone scores 3.14 and from the byte before it 2.40 (both counted on the training text itself).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..user_errors import UserError
from .demo import _number, _output_root
from .gpt import BYTE_VOCAB, GPT, GPTConfig, lm_loss
from .options import TrainingOptions
from .trainer import Trainer


@dataclass(frozen=True)
class Size:
    """A run's shape: the model, the batch per process, the steps and the data."""

    n_layer: int
    n_head: int
    n_embd: int
    seq_len: int
    batch_size: int
    steps: int
    megabytes: float
    lr: float
    threshold: float


DEFAULT = Size(n_layer=4, n_head=4, n_embd=128, seq_len=128, batch_size=16, steps=400, megabytes=2.0, lr=3e-3,
               threshold=2.5)  # fmt: skip
QUICK = Size(n_layer=2, n_head=2, n_embd=64, seq_len=64, batch_size=8, steps=60, megabytes=0.3, lr=3e-3,
             threshold=3.2)  # fmt: skip


def stdlib_sources(megabytes: float) -> list[Path]:
    """The standard library's top-level ``.py`` files, sorted by name, until they hold ``megabytes`` MB."""
    folder = Path(os.path.dirname(os.__file__))
    chosen, total = [], 0
    for path in sorted(folder.glob("*.py")):
        if total >= megabytes * 1e6:
            break
        chosen.append(path)
        total += path.stat().st_size
    if len(chosen) < 2:
        raise UserError(f"found {len(chosen)} .py file(s) in {folder}: the demo needs the standard library's sources")
    return chosen


def adamw(params, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


def warmup_cosine(optimizer: torch.optim.Optimizer, total_steps: int, warmup: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``warmup`` steps, then a cosine down to a tenth of the peak at ``total_steps``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class StopAt:
    """An output function that stops the run after step ``steps``."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def __call__(self, info: dict) -> bool:
        return info.get("state") == "iteration" and info.get("iteration", 0) >= self.steps


def cpu_computes_bf16() -> bool:
    """Whether this CPU has bf16 arithmetic (AVX512-BF16 or AMX): there bf16 autocast is faster; elsewhere it
    is emulated and slower than fp32."""
    probe = getattr(getattr(torch, "cpu", None), "_is_avx512_bf16_supported", None)
    amx = getattr(getattr(torch, "cpu", None), "_is_amx_tile_supported", None)
    return bool((probe and probe()) or (amx and amx()))


def _parser() -> argparse.ArgumentParser:
    positive = _number(int, 1)
    p = argparse.ArgumentParser(prog="fastpar lm-demo", description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    p.add_argument("--out", type=Path, default=None, help="where tokens and outputs go (default: a new temp folder)")
    p.add_argument("--steps", type=positive, default=None, help=f"optimizer steps (default {DEFAULT.steps})")
    p.add_argument("--processes", type=positive, default=2, help="CPU processes (default 2)")
    p.add_argument(
        "--threshold",
        type=_number(float, 0, above=True),
        default=None,
        help=f"fail unless the final validation loss is below this (default {DEFAULT.threshold}; --quick {QUICK.threshold})",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"a tiny run (~30 s): {QUICK.n_layer} blocks of width {QUICK.n_embd}, {QUICK.steps} steps, "
        f"{QUICK.megabytes} MB of text",
    )
    p.add_argument(
        "--precision", choices=("auto", "bf16", "fp32"), default="auto", help="auto: bf16 where the CPU has it"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    size = QUICK if args.quick else DEFAULT
    steps = args.steps or size.steps
    threshold = args.threshold if args.threshold is not None else size.threshold
    bf16 = args.precision == "bf16" or (args.precision == "auto" and cpu_computes_bf16())
    started = time.perf_counter()

    root = _output_root(args.out) if args.out is not None else Path(tempfile.mkdtemp(prefix="fastpar-lm-demo-"))
    from ..data import prepare_tokens, token_loader

    sources = stdlib_sources(size.megabytes)
    index = prepare_tokens(sources, root / "tokens", tokenizer="bytes", val_fraction=0.05, suffixes=(".py",))
    splits = index["splits"]
    print(
        f"fastpar lm-demo: {len(sources)} standard-library .py files ({sources[0].name} .. {sources[-1].name}) -> "
        f"{splits['train']['tokens']:,} train / {splits['val']['tokens']:,} val byte tokens in {root / 'tokens'}"
    )
    config = GPTConfig(
        vocab_size=BYTE_VOCAB, seq_len=size.seq_len, n_layer=size.n_layer, n_head=size.n_head, n_embd=size.n_embd
    )
    with torch.device("meta"):
        parameters = GPT(config).num_parameters()
    print(
        f"model: GPT, {config.n_layer} blocks x {config.n_head} heads, width {config.n_embd}, context {config.seq_len}, "
        f"{parameters / 1e6:.2f}M parameters (tied embeddings); {args.processes} CPU processes x batch "
        f"{size.batch_size}, {steps} steps, precision {'bf16 autocast' if bf16 else 'fp32'}"
    )
    train = token_loader(root / "tokens", seq_len=size.seq_len, batch_size=size.batch_size, split="train")
    val = token_loader(root / "tokens", seq_len=size.seq_len, batch_size=size.batch_size, split="val", shuffle=False)
    per_epoch = len(train) // args.processes
    if per_epoch == 0:
        raise UserError(f"the text holds {len(train)} batches, fewer than one per process: use fewer --processes")
    checkpoints = root / "checkpoints"
    shutil.rmtree(checkpoints, ignore_errors=True)  # the demo owns this folder: start fresh
    every = max(1, steps // 4)
    opts = TrainingOptions(
        max_epochs=math.ceil(steps / per_epoch),
        batch_size=size.batch_size,
        execution_environment="cpu",
        devices=args.processes,
        sharding="auto",
        mixed_precision="bf16" if bf16 else None,
        validation_data=val,
        validation_every=every,
        log_every=max(1, steps // 20),
        progress_bar=False,
        plots="training-progress",
        loggers=("tensorboard", "csv"),
        output_dir=str(root / "output"),
        checkpoint_dir=str(checkpoints),
        checkpoint_every=every,
        lr_scheduler=functools.partial(warmup_cosine, total_steps=steps, warmup=max(1, min(40, steps // 10))),
        output_fns=(StopAt(steps),),
    )
    result = Trainer(
        functools.partial(GPT, config), functools.partial(adamw, lr=size.lr), lm_loss, train, options=opts
    ).fit()
    return _report(result, steps, threshold, time.perf_counter() - started)


def _report(result, steps: int, threshold: float, wall: float) -> int:
    history = [r for r in result.history if r.get("loss") is not None]
    speeds = [r["tokens_per_s"] for r in history[1:] or history if r.get("tokens_per_s")]
    val_loss = result.last("val_loss")
    print(f"\nsharding: {result.sharding} (chosen by sharding='auto')")
    print("step   train loss   val loss")
    for record in result.history:
        val = record.get("val_loss")
        if record.get("loss") is not None or val is not None:
            loss = record.get("loss")
            print(
                f"{record['iteration']:>4}   {'' if loss is None else f'{loss:10.3f}':>10}   {'' if val is None else f'{val:8.3f}':>8}"
            )
    print(
        f"\n{result.steps} steps in {result.elapsed:.1f} s of training ({wall:.1f} s in all); "
        f"throughput {statistics.median(speeds) if speeds else float('nan'):,.0f} tokens/s (median of logged steps)"
    )
    print(f"progress plot  {result.plot_path}")
    print(f"metrics        {result.metrics_path}")
    for name, path in sorted(result.logger_paths.items()):
        print(f"{name:<14} {path}")
    print(f"checkpoints    {', '.join(result.checkpoints) or '(none)'}")
    start = math.log(BYTE_VOCAB)
    if val_loss is None or not val_loss < threshold:
        shown = "none" if val_loss is None else f"{val_loss:.3f}"
        print(
            f"fastpar lm-demo: FAILED: final val loss {shown} is not below the threshold {threshold} "
            f"(ln 257 = {start:.2f} at the start); train longer (--steps) or raise --threshold",
            file=sys.stderr,
        )
        return 1
    print(f"val loss {val_loss:.3f} < threshold {threshold} (from ln 257 = {start:.2f}): PASSED")
    return 0
