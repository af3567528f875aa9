"""``fastpar bench sweep``: do a local sweep's slots really train at the same time?

Every trial is the same job: a fresh process training an MLP with ``fastpar.Trainer`` (one process,
``--steps`` optimizer steps). Variants, interleaved round by round (one call = one whole sweep):

  sequential    2 trials one after the other (``fastpar.sweep`` with one slot): the floor — a sweep of
                2 x SLOTS trials on SLOTS slots that runs truly in parallel takes exactly this long
  sweep         2 x SLOTS trials on SLOTS one-core slots (``fastpar.sweep``: pinned cores, 1 thread each)
  submitit      the peer: the same 2 x SLOTS trials as plain submitit local jobs, all started at once,
                unpinned, with torch's default thread count

Before timing, every sweep trial's trained parameters must equal the sequential trial with the same seed
(bit for bit), and every peer trial must finish. Goal: sweep <= 1.15x sequential; a sweep faster than its
floor is flagged (IMPOSSIBLE). It lives with the job system it measures; ``fastpar.cli`` registers it with
``fastpar bench``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from ..bench.context import BenchContext
from ..bench.goals import AT_MOST, Goal, beyond_floor
from ..bench.harness import BenchUsageError, Plan, WrongResultError, interleaved_rounds, median
from ..bench.table import BenchReport, Column, PlotSpec

DESCRIPTION = "parallel trials: fastpar.sweep on one-core slots vs 2 trials in a row vs plain submitit"
USES: set[str] = set()
DEFAULTS = {"iters": 1, "warmup": 0, "rounds": 3}
SWEEP_VS_SEQUENTIAL = Goal("sweep", "sequential", 1.15, AT_MOST)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sweep")
    group.add_argument("--slots", type=int, help="one-core slots (default: this process's CPUs)")
    group.add_argument("--steps", type=int, default=300, help="optimizer steps per trial (default 300)")
    group.add_argument("--width", type=int, default=256, help="hidden width of the trained MLP (default 256)")
    parser.epilog = "-n must stay 1 (one call is one whole sweep); --threads does not apply (slots set threads)."


def bench_trial(config: dict[str, Any]) -> dict[str, Any]:
    """One trial: train for exactly ``steps`` steps in this process; the trained parameters."""
    import torch

    from ..train import Trainer, TrainingOptions
    from . import job_dir

    g = torch.Generator().manual_seed(config["seed"])
    x = torch.randn(config["steps"] * 32, 64, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    width = config["width"]
    torch.manual_seed(config["seed"])  # the weights: a module passed to the Trainer is already initialised
    model = torch.nn.Sequential(
        torch.nn.Linear(64, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 3),
    )
    options = TrainingOptions(
        execution_environment="cpu",
        devices=1,
        max_epochs=1,
        batch_size=32,
        seed=config["seed"],
        progress_bar=False,
        log_every=50,
        output_dir=str(job_dir() or tempfile.mkdtemp(prefix="fastpar-bench-trial-")),
    )
    start = time.perf_counter()
    result = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.01), torch.nn.functional.cross_entropy, (x, y), options=options
    ).fit()
    return {"params": result.model.state_dict(), "train_s": time.perf_counter() - start, "steps": result.steps}


def _sweep(configs: list[dict], slots: int, root: Path) -> list[dict]:
    from . import sweep

    folder = Path(tempfile.mkdtemp(prefix="sweep-", dir=root))  # a fresh folder: nothing to resume
    result = sweep(
        bench_trial,
        configs,
        folder=folder,
        cpus_per_trial=1,
        max_parallel=slots,
        cluster="local",
        live=False,
        plot=False,
    )
    if result.failed:
        raise WrongResultError(f"sweep trials failed: {[r['error'] for r in result.failed]}")
    return result.results


def _plain_submitit(configs: list[dict], root: Path) -> list[dict]:
    import submitit

    executor = submitit.AutoExecutor(tempfile.mkdtemp(prefix="submitit-", dir=root), cluster="local")
    executor.update_parameters(timeout_min=60)
    return [job.result() for job in [executor.submit(bench_trial, c) for c in configs]]


def _check(sweep_results: list[dict], sequential: list[dict]) -> None:
    import torch

    for index, (ours, reference) in enumerate(zip(sweep_results, sequential, strict=False)):
        wrong = [k for k, v in reference["params"].items() if not torch.equal(ours["params"][k], v)]
        if wrong:
            raise WrongResultError(f"sweep trial {index} differs from the same trial run alone in: {wrong}")


def run(ctx: BenchContext) -> BenchReport:
    from ..host import usable_cpus

    flags = ctx.flags
    slots = flags.slots or len(usable_cpus())
    if not 1 <= slots <= len(usable_cpus()):
        raise BenchUsageError(f"--slots must be between 1 and this process's {len(usable_cpus())} CPU(s), got {slots}")
    if flags.steps < 1 or flags.width < 1:
        raise BenchUsageError("--steps and --width must be at least 1")
    if ctx.iters != 1 or "threads" in ctx.explicit:
        raise BenchUsageError("sweep times whole sweeps: -n must be 1 and --threads does not apply (slots set threads)")
    Plan(ctx.warmup, ctx.rounds, ctx.iters)
    configs = [{"seed": i, "steps": flags.steps, "width": flags.width} for i in range(2 * slots)]
    root = Path(tempfile.mkdtemp(prefix="fastpar-bench-sweep-"))
    try:
        seconds = _measure(configs, slots, ctx, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)  # every trial's job folder: pickles, logs, metrics
    return _report(ctx, slots, len(configs), seconds)


def _measure(configs: list[dict], slots: int, ctx: BenchContext, root: Path) -> dict[str, float]:
    """Check the results, then the median seconds of each variant."""
    import torch

    sequential = _sweep(configs[:2], 1, root)  # correctness first, on the first two trials
    _check(_sweep(configs, slots, root)[:2], sequential)
    peer = _plain_submitit(configs, root)
    if len(peer) != len(configs) or any(r["steps"] != ctx.flags.steps for r in peer):
        raise WrongResultError("plain submitit trials did not all finish their steps")
    calls = {
        "sequential": lambda: _sweep(configs[:2], 1, root),
        "sweep": lambda: _sweep(configs, slots, root),
        "submitit": lambda: _plain_submitit(configs, root),
    }
    times = interleaved_rounds(calls, Plan(ctx.warmup, ctx.rounds, 1), torch.device("cpu"))
    return {name: median(values) for name, values in times.items()}


def _report(ctx: BenchContext, slots: int, trials: int, seconds: dict[str, float]) -> BenchReport:
    flags = ctx.flags
    floor = seconds["sequential"]
    rows = [
        dict(variant="sequential", trials=2, slots=1, seconds=floor, vs_floor=1.0),
        dict(variant="sweep", trials=trials, slots=slots, seconds=seconds["sweep"], vs_floor=seconds["sweep"] / floor),
        dict(
            variant="submitit",
            trials=trials,
            slots="-",
            seconds=seconds["submitit"],
            vs_floor=seconds["submitit"] / floor,
        ),
    ]
    ratio = seconds["sweep"] / floor
    flag = beyond_floor("sweep", seconds["sweep"], floor, "sequential")
    return BenchReport(
        benchmark="sweep",
        title=f"{trials} trials on {slots} one-core slot(s) vs 2 trials in a row ({flags.steps} steps, width {flags.width})",
        columns=[
            Column("variant", "variant", 11),
            Column("trials", "trials", 7),
            Column("slots", "slots", 6),
            Column("seconds", "seconds", 9, ".2f", "s"),
            Column("vs_floor", "x floor", 8, ".2f", "x"),
        ],
        rows=rows,
        header={
            "cpus": f"{os.cpu_count()} online; slots {slots}",
            "timing": f"median of {ctx.rounds} interleaved rounds, one whole sweep per call (process starts included)",
        },
        footer=[
            f"floor: sequential = 2 trials in a row = what {trials} trials on {slots} slots take if the slots are truly parallel",
            f"peer: submitit = {trials} plain submitit local jobs at once, unpinned: {seconds['submitit'] / floor:.2f}x floor",
        ],
        goals=[SWEEP_VS_SEQUENTIAL.check(ratio, flag=flag)],
        summary={"seconds": seconds, "ratio_sweep_to_sequential": ratio},
        plot=PlotSpec("bar", "variant", "seconds", ylabel="seconds per sweep"),
    )
