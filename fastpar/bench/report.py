"""``fastpar bench all --json DIR``: run the suite and write one JSON per benchmark plus ``summary.md``.

``summary.md`` starts with the machine (CPU model and cores, GPUs, torch/NCCL/DALI versions, the live
kernel backend), lists each benchmark's verdict lines, then gives every table as printed: the form
README numbers are copied from. ``machine.json`` holds the same machine facts.

Quick settings by default (a few minutes on a small CPU machine); ``--full`` runs every benchmark with
its own defaults. Shared flags given to ``all`` (``-b/-e/-f``, ``-n``, ``-w``, ``--rounds``, ``--dtype``,
``--nproc``, ``--backend``, ``--threads``) are passed on to every benchmark they apply to and win over
the quick settings. A benchmark that fails is reported in the summary; the others still run, and the
exit status is then 1.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import traceback
from pathlib import Path

from .context import BenchContext
from .harness import BenchUsageError, WrongResultError
from .table import BenchReport, render_table, write_json, write_plot

DESCRIPTION = "run the whole suite; --json DIR gets one JSON per benchmark, machine.json and summary.md"
USES = {"sizes", "nproc", "dtype"}
DEFAULTS: dict = {}
OUTPUTS_ARE_DIRECTORIES = True

_QUICK_SWEEP = ["-b", "1K", "-e", "4M", "-f", "4", "-n", "5", "-w", "2", "--rounds", "3"]
# benchmark -> flags of the quick suite (the --full suite passes none: each benchmark's defaults)
QUICK = {
    "allreduce": _QUICK_SWEEP,
    "reducescatter": _QUICK_SWEEP,
    "allgather": _QUICK_SWEEP,
    "broadcast": _QUICK_SWEEP,
    "alltoall": _QUICK_SWEEP,
    "fusion": ["--rounds", "3"],
    "pack": ["--rounds", "3"],
    "ddp": ["--rounds", "3", "--iters", "1"],
    "zero": ["--rounds", "3", "--iters", "1"],
    "shard": ["--rounds", "3", "--iters", "1"],
    "data": ["--rounds", "2"],
}
# shared flag (its dest) -> (command-line flag, the USES entry a benchmark needs to take it, or None for all)
_FORWARDED = {
    "min_bytes": ("-b", "sizes"),
    "max_bytes": ("-e", "sizes"),
    "factor": ("-f", "sizes"),
    "iters": ("-n", None),
    "warmup": ("-w", None),
    "rounds": ("--rounds", None),
    "dtype": ("--dtype", "dtype"),
    "nproc": ("--nproc", "nproc"),
    "backend": ("--backend", "nproc"),
    "threads": ("--threads", None),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("all")
    group.add_argument("--only", help=f"comma-separated subset of {','.join(QUICK)}")
    group.add_argument("--full", action="store_true", help="each benchmark's full defaults instead of quick ones")
    parser.epilog = (
        "With 'all', --json and --plot name DIRECTORIES (one file per benchmark). Shared flags given here "
        "are passed on to each benchmark they apply to, e.g. -b 1K -e 64K -n 2 -w 1 for a fast smoke run."
    )


def benchmark_argv(name: str, ctx: BenchContext) -> list[str]:
    """The flags ``all`` runs benchmark ``name`` with: quick (or none with --full), then the user's shared flags."""
    from .cli import BENCHMARKS

    uses = importlib.import_module(BENCHMARKS[name]).USES
    argv = [] if ctx.flags.full else list(QUICK[name])
    given = set(ctx.explicit)
    if given & {"min_bytes", "max_bytes", "factor"}:
        given |= {"min_bytes", "max_bytes", "factor"}  # a sweep is passed on whole: -b 1K -e 2K means -f 2 too
    for dest, (flag, needs) in _FORWARDED.items():
        if dest in given and (needs is None or needs in uses):
            argv += [flag, str(getattr(ctx, dest))]
    return argv


def _run_one(name: str, argv: list[str]) -> BenchReport:
    from .cli import finish, prepare

    module, ctx = prepare(name, argv)
    return finish(module.run(ctx), ctx)


def _verdicts(report: BenchReport) -> list[str]:
    """The lines a reader looks for first: floors, goal verdicts and warnings."""
    lines = [line for line in report.footer if line.startswith(("floor", "Avg bus"))]
    return lines + [v.line() for v in report.goals] + [f"warning: {w}" for w in report.warnings]


def _selected(only: str | None) -> list[str]:
    names = list(QUICK) if not only else [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in QUICK]
    if unknown or not names:
        raise BenchUsageError(f"unknown benchmark(s) {unknown} in --only; choose from {', '.join(QUICK)}")
    return names


def check_flags(flags: argparse.Namespace) -> None:
    """Refuse a bad --only before the --json folder is created."""
    _selected(flags.only)


def run(ctx: BenchContext) -> None:
    from ..launcher import launched_by_torchrun
    from .machine import machine_facts, machine_markdown

    if launched_by_torchrun():
        raise BenchUsageError("run 'fastpar bench all' without torchrun: it spawns the ranks of each benchmark itself")
    if not ctx.json:
        raise BenchUsageError("'all' needs --json DIR: the folder for one JSON per benchmark and summary.md")
    names = _selected(ctx.flags.only)
    out_dir = Path(ctx.json)
    out_dir.mkdir(parents=True, exist_ok=True)
    facts = machine_facts()
    (out_dir / "machine.json").write_text(json.dumps(facts, indent=2, default=str) + "\n")
    sections, glance, failures = [], [], []
    for name in names:
        argv = benchmark_argv(name, ctx)
        command = " ".join(["fastpar bench", name, *argv])
        print(f"# running: {command}", flush=True)
        try:
            report = _run_one(name, argv)
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # one failed benchmark must not lose the others' results
            kind = {WrongResultError: "WRONG RESULTS", BenchUsageError: "could not run"}.get(type(exc), "failed")
            detail = str(exc) if kind != "failed" else "".join(traceback.format_exception_only(exc)).strip()
            failures.append(name)
            print(f"fastpar bench {name}: {kind}: {detail}", file=sys.stderr, flush=True)
            glance.append(f"- **{name}**: {kind}")
            sections.append(f"## {name}\n\nCommand: `{command}`\n\n**{kind}**: {detail}\n")
            continue
        table = render_table(report)
        print(table, flush=True)
        write_json(report, out_dir / f"{name}.json")
        if ctx.plot:
            write_plot(report, Path(ctx.plot) / f"{name}.png")
        glance += [f"- **{name}**: {line}" for line in _verdicts(report)]
        sections.append(f"## {name}\n\nCommand: `{command}`\n\n```text\n{table}\n```\n")
    summary = ["# fastpar bench report", "", "## Machine", "", machine_markdown(facts), ""]
    summary += ["## At a glance", "", *glance, "", *sections]
    (out_dir / "summary.md").write_text("\n".join(summary))
    print(f"# wrote {out_dir / 'summary.md'}, machine.json and {len(names) - len(failures)} benchmark JSON file(s)")
    if failures:
        raise WrongResultError(f"benchmarks that failed: {', '.join(failures)} (see {out_dir / 'summary.md'})")
