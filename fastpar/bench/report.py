"""``fastpar bench all --json DIR``: run the suite and write one JSON per benchmark plus ``summary.md``.

``summary.md`` starts with the machine (CPU model and cores, GPUs, torch/NCCL/DALI versions, the live
kernel backend) and then gives every benchmark's table as printed: the form README numbers are copied
from. Quick settings by default (a few minutes on a small CPU machine); ``--full`` runs every benchmark
with its own defaults.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

from .harness import BenchUsageError, WrongResultError
from .table import BenchReport, render_table, write_json, write_plot

DESCRIPTION = "run the whole suite; --json DIR gets one JSON per benchmark and summary.md"
USES = {"nproc"}
DEFAULTS: dict = {}

# benchmark -> flags of the quick suite (the --full suite passes none: each benchmark's defaults)
QUICK = {
    "allreduce": ["-b", "1K", "-e", "4M", "-f", "4", "-n", "5", "-w", "2", "--rounds", "3"],
    "reducescatter": ["-b", "1K", "-e", "4M", "-f", "4", "-n", "5", "-w", "2", "--rounds", "3"],
    "allgather": ["-b", "1K", "-e", "4M", "-f", "4", "-n", "5", "-w", "2", "--rounds", "3"],
    "broadcast": ["-b", "1K", "-e", "4M", "-f", "4", "-n", "5", "-w", "2", "--rounds", "3"],
    "alltoall": ["-b", "1K", "-e", "4M", "-f", "4", "-n", "5", "-w", "2", "--rounds", "3"],
    "fusion": ["--rounds", "3"],
    "pack": ["--rounds", "3"],
    "ddp": ["--rounds", "3", "--iters", "1"],
    "data": ["--rounds", "2"],
}
DISTRIBUTED = {"allreduce", "reducescatter", "allgather", "broadcast", "alltoall", "fusion", "ddp"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("all")
    group.add_argument("--only", help=f"comma-separated subset of {','.join(QUICK)}")
    group.add_argument("--full", action="store_true", help="each benchmark's full defaults instead of quick ones")
    parser.epilog = "With 'all', --json and --plot name DIRECTORIES (one file per benchmark)."


def machine_facts() -> dict:
    """What a reader needs to judge the numbers: CPU, cores, GPUs, versions, kernel backend."""
    from ..info import collect

    facts = collect()
    cpu_model = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpus = []
    if facts["cuda_available"]:
        import torch

        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    facts.update(cpu_model=cpu_model, gpus=gpus, date=datetime.datetime.now().isoformat(timespec="seconds"))
    return facts


def _machine_markdown(facts: dict) -> str:
    ext = facts["extension"]
    gpus = ", ".join(f"{n} x {name}" for name, n in _counts(facts["gpus"]).items()) or "none"
    rows = [
        ("date", facts["date"]),
        ("CPU", f"{facts['cpu_model']} ({facts['cpu_count']} logical cores)"),
        ("GPUs", gpus),
        ("torch", f"{facts['torch']} (CUDA {facts['torch_cuda'] or 'none'})"),
        ("NCCL", facts["nccl"] or "not available"),
        ("DALI", facts["dali"] or "not installed"),
        ("fastpar kernels", f"{ext['backend']} ({ext['reason']})"),
        ("python", f"{facts['python']} on {facts['platform']}"),
    ]
    return "\n".join(["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows])


def _counts(names: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    return counts


def _run_one(name: str, argv: list[str]) -> BenchReport:
    import importlib

    from .cli import BENCHMARKS, _explicit_flags, _validate, build_parser

    module = importlib.import_module(BENCHMARKS[name])
    parser = build_parser(name, module)
    args = parser.parse_args(argv)
    args.benchmark = name
    _validate(name, module, args, _explicit_flags(parser, argv))
    report = module.run(args)
    report.config = {k: v for k, v in vars(args).items() if k not in ("json", "plot", "explicit")}
    return report


def run(args: argparse.Namespace) -> None:
    if "RANK" in os.environ:
        raise BenchUsageError("run 'fastpar bench all' without torchrun: it spawns the ranks of each benchmark itself")
    fixed = sorted(getattr(args, "explicit", set()) & {"iters", "warmup", "rounds"})
    if fixed:
        raise BenchUsageError(
            f"'all' sets -n/-w/--rounds per benchmark ({', '.join(fixed)} given); use --full or run one benchmark"
        )
    if not args.json:
        raise BenchUsageError("'all' needs --json DIR: the folder for one JSON per benchmark and summary.md")
    names = list(QUICK) if not args.only else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in QUICK]
    if unknown:
        raise BenchUsageError(f"unknown benchmark(s) {unknown} in --only; choose from {', '.join(QUICK)}")
    out_dir = Path(args.json)
    out_dir.mkdir(parents=True, exist_ok=True)
    facts = machine_facts()
    (out_dir / "machine.json").write_text(json.dumps(facts, indent=2, default=str) + "\n")
    sections, failures = [], []
    for name in names:
        argv = [] if args.full else list(QUICK[name])
        argv += ["--threads", str(args.threads)]
        if name in DISTRIBUTED:
            argv += ["--backend", args.backend] + (["--nproc", str(args.nproc)] if args.nproc else [])
        print(f"# running: fastpar bench {name} {' '.join(argv)}", flush=True)
        try:
            report = _run_one(name, argv)
        except (WrongResultError, BenchUsageError) as exc:
            failures.append(name)
            kind = "WRONG RESULTS" if isinstance(exc, WrongResultError) else "could not run"
            print(f"fastpar bench {name}: {kind}: {exc}", file=sys.stderr)
            sections.append(f"## {name}\n\n**{kind}**: {exc}\n")
            continue
        table = render_table(report)
        print(table, flush=True)
        write_json(report, out_dir / f"{name}.json")
        if args.plot:
            write_plot(report, Path(args.plot) / f"{name}.png")
        sections.append(f"## {name}\n\nCommand: `fastpar bench {name} {' '.join(argv)}`\n\n```text\n{table}\n```\n")
    summary = "\n".join(["# fastpar bench report", "", "## Machine", "", _machine_markdown(facts), "", *sections])
    (out_dir / "summary.md").write_text(summary)
    print(f"# wrote {out_dir / 'summary.md'} and {len(names) - len(failures)} JSON file(s) to {out_dir}")
    if failures:
        raise WrongResultError(f"benchmarks that failed: {', '.join(failures)} (see {out_dir / 'summary.md'})")
