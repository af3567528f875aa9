"""``fastpar bench lm``: tokens/s of ``fastpar.Trainer`` training ``fastpar lm-demo``'s GPT against a hand-written
torch DDP loop of the same model and data in nanoGPT's style.

Data: the standard library's sources, byte-tokenized by :func:`fastpar.data.prepare_tokens`; the first
``steps x grad_accum x batch x nproc x seq_len`` train tokens are written to one raw ``train.bin`` (nanoGPT's
format), so the Trainer's epoch is exactly ``--steps`` steps. Variants (one call = one whole training run in
fresh processes; interleaved round by round; the tokens/s of a run count the steps after its first
``log_every`` ones, so process start and planning are left out):

  fastpar     ``fastpar.Trainer`` with ``sharding="auto"`` on ``token_loader(train.bin)``, ``grad_accum_steps``
  torch_ddp   the peer: nanoGPT's loop: ``np.memmap`` random windows, ``torch.nn.parallel.DistributedDataParallel``
              on gloo, ``no_sync()`` on all micro-batches but the last, ``loss / grad_accum``
  no_comm     the floor: the same loop without DDP (no gradient exchange): no data-parallel run is faster

Before timing, the curve check: the Trainer and the hand loop train the same configuration from the same seed on
the same batches (the hand loop reads ``token_loader(rank=, world_size=)``, the windows the Trainer's processes
get, instead of random windows, whose order cannot match); their per-step losses must agree to 1e-6 and their
parameters bit for bit, else the run fails with no speed printed. Goal: fastpar >= 1.0x torch_ddp's tokens/s.
It lives with the Trainer it measures; ``fastpar.cli`` registers it with ``fastpar bench``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..bench.context import BenchContext
from ..bench.goals import AT_LEAST, Goal, above_bound
from ..bench.harness import BenchUsageError, WrongResultError, median
from ..bench.table import BenchReport, Column, PlotSpec
from .gpt import BYTE_VOCAB, GPT, GPTConfig, lm_loss
from .lm_demo import DEFAULT, QUICK, adamw, cpu_computes_bf16, stdlib_sources

DESCRIPTION = "LM training tokens/s: fastpar.Trainer vs a nanoGPT-style torch DDP loop (memmap windows, no_sync)"
USES = {"nproc"}
DEFAULTS = {"iters": 1, "warmup": 0, "rounds": 3}
FASTPAR_VS_TORCH_DDP = Goal("fastpar", "torch_ddp", 1.0, AT_LEAST)
VARIANTS = ("fastpar", "torch_ddp", "no_comm")
# --model: fastpar lm-demo's size, lm-demo --quick's, or the smallest (smoke tests)
SIZES = {
    "demo": DEFAULT,
    "quick": QUICK,
    "tiny": dataclasses.replace(QUICK, n_layer=1, n_head=2, n_embd=32, seq_len=32, batch_size=4),
}
_LOSS_TOLERANCE = 1e-6


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("lm")
    group.add_argument("--model", choices=tuple(SIZES), default="demo", help="lm-demo's size (default demo)")
    group.add_argument("--steps", type=int, default=60, help="optimizer steps per run (default 60)")
    group.add_argument("--grad-accum", type=int, default=2, help="micro-batches per step (default 2)")
    group.add_argument(
        "--sharding",
        choices=("auto", "ddp"),
        default="auto",
        help="the Trainer's: auto (the planner picks, ddp for these models) or ddp (no planning: quicker starts)",
    )
    group.add_argument(
        "--precision", choices=("auto", "bf16", "fp32"), default="auto", help="auto: bf16 where the CPU has it"
    )
    parser.epilog = "-n must stay 1 (one call is one whole training run); --backend picks the Trainer's CPU backend."


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One training run, the same for every variant."""

    model: dict[str, int]
    batch_size: int
    grad_accum: int
    steps: int
    lr: float
    bf16: bool
    path: str  # train.bin: raw uint16 tokens
    log_every: int
    seed: int = 0

    @property
    def seq_len(self) -> int:
        return self.model["seq_len"]

    def build(self) -> GPT:
        return GPT(GPTConfig(**self.model))


# --- the hand-written loop (nanoGPT's train.py, cut to what is timed) ----------------------------------------------
def _random_windows(data: np.ndarray, spec: RunSpec, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(len(data) - spec.seq_len, (spec.batch_size,), generator=gen)
    x = torch.stack([torch.from_numpy(data[i : i + spec.seq_len].astype(np.int64)) for i in ix.tolist()])
    y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + spec.seq_len].astype(np.int64)) for i in ix.tolist()])
    return x, y


def hand_loop(rank: int, world_size: int, spec: RunSpec, mode: str) -> dict[str, Any]:
    """``mode``: "ddp" (the peer), "no_comm" (the floor: no DDP) or "check" (DDP on the Trainer's batches, every
    step's mean loss over the ranks recorded)."""
    import random

    import torch.distributed as dist

    random.seed(spec.seed)
    np.random.seed(spec.seed)
    torch.manual_seed(spec.seed)  # the same initial weights on every rank, as the Trainer's
    raw = spec.build()
    model = raw if mode == "no_comm" else torch.nn.parallel.DistributedDataParallel(raw)
    optimizer = adamw(model.parameters(), lr=spec.lr)
    autocast = functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16, enabled=spec.bf16)
    if mode == "check":
        from ..data import token_loader

        loader = token_loader(
            spec.path, seq_len=spec.seq_len, batch_size=spec.batch_size, dtype="uint16", rank=rank,
            world_size=world_size, seed=spec.seed, vocab_size=BYTE_VOCAB,
        )  # fmt: skip
        batches = iter(loader)
    else:
        data = np.memmap(spec.path, dtype=np.uint16, mode="r")
        gen = torch.Generator().manual_seed(1337 + rank)  # nanoGPT: a different stream of windows per rank
        batches = iter(lambda: _random_windows(data, spec, gen), None)
    losses, marks = [], {}
    for step in range(1, spec.steps + 1):
        total = torch.zeros(())
        for micro in range(spec.grad_accum):
            x, y = next(batches)
            sync = mode == "no_comm" or micro == spec.grad_accum - 1
            with contextlib.nullcontext() if sync else model.no_sync():
                with autocast():
                    loss = lm_loss(model(x), y)
                total += loss.detach()
                (loss / spec.grad_accum).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if mode == "check":
            dist.all_reduce(total)
            losses.append(total.item() / (spec.grad_accum * world_size))
        if step in (spec.log_every, spec.steps):
            marks[step] = time.perf_counter()
    out: dict[str, Any] = {"last_loss": loss.item()}
    if spec.steps > spec.log_every:
        tokens = (spec.steps - spec.log_every) * _tokens_per_step(spec, world_size)
        out["tokens_per_s"] = tokens / (marks[spec.steps] - marks[spec.log_every])
    if mode == "check":
        out["losses"] = losses
        out["params"] = {k: v.detach().clone() for k, v in raw.state_dict().items()} if rank == 0 else None
    return out


def _tokens_per_step(spec: RunSpec, world_size: int) -> int:
    return spec.grad_accum * spec.batch_size * spec.seq_len * world_size


# --- the Trainer --------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _stdout_to(path: Path):
    """This process's and its children's stdout into ``path`` (the Trainer's plan table, once per run)."""
    saved = os.dup(1)
    with open(path, "a") as fh:
        os.dup2(fh.fileno(), 1)
        try:
            yield
        finally:
            os.dup2(saved, 1)
            os.close(saved)


def trainer_run(
    spec: RunSpec, nproc: int, threads: int, backend: str, sharding: str, root: Path, log_every: int
) -> dict[str, Any]:
    from ..data import token_loader
    from .options import TrainingOptions
    from .trainer import Trainer

    loader = token_loader(
        spec.path,
        seq_len=spec.seq_len,
        batch_size=spec.batch_size,
        dtype="uint16",
        seed=spec.seed,
        vocab_size=BYTE_VOCAB,
    )
    options = TrainingOptions(
        max_epochs=1,
        batch_size=spec.batch_size,
        seed=spec.seed,
        execution_environment="cpu",
        devices=nproc,
        threads_per_process=threads,
        cpu_backend=backend,
        sharding=sharding,
        mixed_precision="bf16" if spec.bf16 else None,
        grad_accum_steps=spec.grad_accum,
        log_every=log_every,
        progress_bar=False,
        output_dir=str(root / "trainer-output"),
    )
    trainer = Trainer(functools.partial(GPT, GPTConfig(**spec.model)), functools.partial(adamw, lr=spec.lr), lm_loss, loader, options=options)  # fmt: skip
    with _stdout_to(root / "trainer.log"):
        result = trainer.fit()
    if result.steps != spec.steps:
        raise WrongResultError(f"the Trainer took {result.steps} steps, not {spec.steps}")
    per_step = _tokens_per_step(spec, nproc)
    tokens = seconds = 0.0
    previous = 0
    for record in result.history:
        if record.get("tokens_per_s") and previous >= spec.log_every:  # the first window (warm-up) is left out
            window = (record["iteration"] - previous) * per_step
            tokens, seconds = tokens + window, seconds + window / record["tokens_per_s"]
        previous = record["iteration"]
    return {
        "tokens_per_s": tokens / seconds if seconds else float("nan"),
        "last_loss": result.history[-1]["loss"],
        "losses": [r["loss"] for r in result.history],
        "params": result.model.state_dict(),
        "sharding": result.sharding,
    }


# --- the benchmark ------------------------------------------------------------------------------------------------
def _spec(ctx: BenchContext, nproc: int, root: Path) -> RunSpec:
    from ..data import prepare_tokens

    flags = ctx.flags
    size = SIZES[flags.model]
    if flags.steps < 2 or flags.grad_accum < 1:
        raise BenchUsageError("--steps must be at least 2 (the first ones are warm-up) and --grad-accum at least 1")
    bf16 = flags.precision == "bf16" or (flags.precision == "auto" and cpu_computes_bf16())
    model = {"vocab_size": BYTE_VOCAB, "seq_len": size.seq_len, "n_layer": size.n_layer, "n_head": size.n_head,
             "n_embd": size.n_embd}  # fmt: skip
    spec = RunSpec(model, size.batch_size, flags.grad_accum, flags.steps, size.lr, bf16, str(root / "train.bin"),
                   log_every=max(1, flags.steps // 6))  # fmt: skip
    needed = flags.steps * _tokens_per_step(spec, nproc) + 1  # windows share their boundary token
    index = prepare_tokens(stdlib_sources(needed * 1.1 / 1e6 + 0.1), root / "tokens", val_fraction=0.0)
    shard = root / "tokens" / index["splits"]["train"]["shards"][0]["file"]
    tokens = np.fromfile(shard, dtype=np.uint16)
    if len(tokens) < needed:
        raise BenchUsageError(f"the standard library's sources hold {len(tokens):,} tokens, fewer than the {needed:,} "
                              "needed: lower --steps or --grad-accum")  # fmt: skip
    tokens[:needed].tofile(spec.path)
    return spec


def _check_curves(trainer: dict[str, Any], hand: dict[str, Any]) -> str:
    """The curve check's footer line; raises WrongResultError when the two runs differ."""
    ours, theirs = trainer["losses"], hand["losses"]
    if len(ours) != len(theirs):
        raise WrongResultError(f"curve check: the Trainer logged {len(ours)} steps, the hand loop ran {len(theirs)}")
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours, theirs, strict=True))
    differ = [k for k, v in hand["params"].items() if not torch.equal(trainer["params"][k], v)]
    if worst > _LOSS_TOLERANCE or differ:
        raise WrongResultError(
            f"curve check: same seed and batches, the Trainer vs the hand-written DDP loop: largest loss difference "
            f"{worst:.2e} (tolerance {_LOSS_TOLERANCE}); parameters that differ: {differ or 'none'}"
        )
    return (
        f"curve check: same seed, same batches (the hand loop reads token_loader's windows): {len(ours)} step losses "
        f"agree to {worst:.1e} (tolerance {_LOSS_TOLERANCE}), parameters bit-identical -> IDENTICAL"
    )


def run(ctx: BenchContext) -> BenchReport:
    from ..host import usable_cpus
    from ..launcher import spawn

    nproc = ctx.nproc or 2
    if nproc < 2:
        raise BenchUsageError(f"--nproc must be at least 2 (data parallel), got {nproc}")
    if ctx.iters != 1:
        raise BenchUsageError("lm times whole training runs: -n must be 1 (use --rounds and --steps)")
    backend = ctx.backend if ctx.backend in ("fastpar", "gloo") else "auto"
    if ctx.backend not in ("auto", "fastpar", "gloo"):
        raise BenchUsageError(f"lm trains on CPU processes: --backend auto, fastpar or gloo, got {ctx.backend!r}")
    root = Path(tempfile.mkdtemp(prefix="fastpar-bench-lm-"))
    try:
        spec = _spec(ctx, nproc, root)
        hand = functools.partial(spawn, hand_loop, nproc, spec, backend="gloo", threads=ctx.threads, timeout=1800)
        trainer = functools.partial(trainer_run, spec, nproc, ctx.threads, backend, ctx.flags.sharding, root)
        check = _check_curves(trainer(log_every=1), hand("check")[0])
        calls = {
            "fastpar": lambda: trainer(log_every=spec.log_every),
            "torch_ddp": lambda: hand("ddp")[0],
            "no_comm": lambda: hand("no_comm")[0],
        }
        for _ in range(ctx.warmup):
            for call in calls.values():
                call()
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in calls}
        for _ in range(ctx.rounds):
            for name, call in calls.items():
                runs[name].append(call())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return _report(ctx, spec, nproc, runs, check, len(usable_cpus()))


def _report(
    ctx: BenchContext, spec: RunSpec, nproc: int, runs: dict[str, list[dict[str, Any]]], check: str, cpus: int
) -> BenchReport:
    speed = {name: median([r["tokens_per_s"] for r in values]) for name, values in runs.items()}
    sharding = runs["fastpar"][-1]["sharding"]
    rows = [
        {
            "variant": name,
            "tokens_per_s": speed[name],
            "x_torch_ddp": speed[name] / speed["torch_ddp"],
            "x_no_comm": speed[name] / speed["no_comm"],
            "last_loss": runs[name][-1]["last_loss"],
        }
        for name in VARIANTS
    ]
    ratio = speed["fastpar"] / speed["torch_ddp"]
    flag = above_bound("fastpar", speed["fastpar"], speed["no_comm"], "no_comm's tokens/s (no gradient exchange)")
    with torch.device("meta"):
        parameters = spec.build().num_parameters()
    m = spec.model
    return BenchReport(
        benchmark="lm",
        title=f"GPT {m['n_layer']}x{m['n_embd']} ({parameters / 1e6:.2f}M), {spec.steps} steps on {nproc} CPU processes",
        columns=[
            Column("variant", "variant", 10),
            Column("tokens_per_s", "tokens/s", 10, ".0f", "tokens/s"),
            Column("x_torch_ddp", "x torch_ddp", 12, ".3f", "x"),
            Column("x_no_comm", "x no_comm", 10, ".3f", "x"),
            Column("last_loss", "last loss", 10, ".3f"),
        ],
        rows=rows,
        header={
            "model": f"GPT n_layer={m['n_layer']} n_head={m['n_head']} n_embd={m['n_embd']} seq_len={m['seq_len']}, "
            f"vocab {m['vocab_size']} (bytes), tied embeddings",
            "batch": f"{spec.batch_size} sequences per process x {spec.grad_accum} micro-batches per step "
            f"= {_tokens_per_step(spec, nproc):,} tokens per step",
            "precision": "bf16 autocast" if spec.bf16 else "fp32",
            "processes": f"{nproc} x {ctx.threads} torch thread(s); {cpus} usable CPU(s)",
            "fastpar": f"Trainer, sharding={ctx.flags.sharding!r} -> {sharding}, cpu_backend={ctx.backend}",
            "timing": f"median of {ctx.rounds} interleaved rounds, one whole run per call; tokens/s over steps "
            f"{spec.log_every + 1}..{spec.steps} (the first {spec.log_every} are warm-up)",
        },
        footer=[
            check,
            f"peer: torch_ddp = nanoGPT-style loop (np.memmap random windows, torch DDP on gloo, no_sync "
            f"accumulation): fastpar {ratio:.3f}x",
            f"floor: no_comm = the same loop without DDP (no gradient exchange): fastpar "
            f"{speed['fastpar'] / speed['no_comm']:.3f}x, torch_ddp {speed['torch_ddp'] / speed['no_comm']:.3f}x",
        ],
        goals=[
            FASTPAR_VS_TORCH_DDP.check(
                ratio, detail=f"{speed['fastpar']:.0f} vs {speed['torch_ddp']:.0f} tokens/s", flag=flag
            )
        ],
        summary={
            "tokens_per_s": speed,
            "rounds_tokens_per_s": {name: [r["tokens_per_s"] for r in values] for name, values in runs.items()},
            "ratio_fastpar_to_torch_ddp": ratio,
            "curves_identical": True,
            "spec": {k: v for k, v in dataclasses.asdict(spec).items() if k != "path"},
        },
        plot=PlotSpec("bar", "variant", "tokens_per_s", ylabel="tokens/s"),
    )


__all__ = ["FASTPAR_VS_TORCH_DDP", "hand_loop", "run", "trainer_run"]
