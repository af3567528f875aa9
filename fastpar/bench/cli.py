"""``fastpar bench <name> [flags]``: one flag vocabulary for every benchmark.

Each benchmark module offers ``DESCRIPTION``, ``USES`` (which shared flags apply: ``sizes``, ``nproc``,
``dtype``), ``DEFAULTS`` (its own defaults for the shared flags), ``add_arguments(parser)`` and
``run(args) -> BenchReport | None``. Exit status: 0 ok, 1 wrong results, 2 bad flags.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from types import ModuleType

from .harness import BenchUsageError, WrongResultError, parse_bytes, parse_dtype, size_sweep
from .table import BenchReport, render_table, write_json, write_plot

BENCHMARKS = {
    "allreduce": "fastpar.bench.collectives",
    "reducescatter": "fastpar.bench.collectives",
    "allgather": "fastpar.bench.collectives",
    "broadcast": "fastpar.bench.collectives",
    "alltoall": "fastpar.bench.collectives",
    "fusion": "fastpar.bench.fusion",
    "pack": "fastpar.bench.pack",
    "ddp": "fastpar.bench.ddp_step",
    "data": "fastpar.bench.data",
    "all": "fastpar.bench.report",
}


def _usage() -> str:
    lines = ["usage: fastpar bench <benchmark> [flags]", "", "benchmarks:"]
    for name, module_name in BENCHMARKS.items():
        description = importlib.import_module(module_name).DESCRIPTION
        lines.append(f"  {name:<14} {description}")
    lines += ["", "Run 'fastpar bench <benchmark> --help' for its flags."]
    return "\n".join(lines)


def build_parser(name: str, module: ModuleType) -> argparse.ArgumentParser:
    """The shared flags, then the benchmark's own; defaults from the module's ``DEFAULTS``."""
    parser = argparse.ArgumentParser(prog=f"fastpar bench {name}", description=module.DESCRIPTION, allow_abbrev=False)
    shared = parser.add_argument_group("shared flags")
    shared.add_argument("-b", "--minbytes", dest="min_bytes", help="smallest size in bytes, K/M/G suffixes allowed")
    shared.add_argument("-e", "--maxbytes", dest="max_bytes", help="largest size in bytes, K/M/G suffixes allowed")
    shared.add_argument("-f", "--stepfactor", dest="factor", type=int, help="multiply the size by this each step")
    shared.add_argument("-n", "--iters", type=int, help="timed iterations per round")
    shared.add_argument("-w", "--warmup", type=int, help="untimed warm-up iterations per variant")
    shared.add_argument("--rounds", type=int, help="interleaved rounds; the reported time is their median")
    shared.add_argument("--dtype", default="float32", help="element type (float32, float16, bfloat16, ...)")
    shared.add_argument("--nproc", type=int, help="local ranks to spawn (under torchrun: the launched ranks run)")
    shared.add_argument("--backend", default="auto", help="auto (NCCL on GPUs, else gloo), gloo or nccl")
    shared.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    shared.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    shared.add_argument("--plot", metavar="FILE", help="also draw the results into a PNG (needs matplotlib)")
    module.add_arguments(parser)
    parser.set_defaults(**module.DEFAULTS)
    return parser


def _validate(name: str, module: ModuleType, args: argparse.Namespace, explicit: set[str]) -> None:
    uses = module.USES
    if "sizes" in uses:
        args.sizes = size_sweep(parse_bytes(args.min_bytes), parse_bytes(args.max_bytes), args.factor)
    elif explicit & {"min_bytes", "max_bytes", "factor"}:
        raise BenchUsageError(
            f"{name} does not sweep sizes, so -b/-e/-f do not apply; see its --help for its own flags"
        )
    if "nproc" not in uses and "nproc" in explicit:
        raise BenchUsageError(f"{name} runs in one process; --nproc does not apply")
    if "dtype" in uses:
        parse_dtype(args.dtype)  # before any rank starts
    elif "dtype" in explicit:
        raise BenchUsageError(f"{name} has no --dtype choice")
    if args.threads is not None and args.threads < 1:
        raise BenchUsageError(f"--threads must be at least 1, got {args.threads}")


def _explicit_flags(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """Destinations the user set on the command line (to refuse flags that do not apply)."""
    given = {token.split("=", 1)[0] for token in argv if token.startswith("-")}
    return {action.dest for action in parser._actions if given & set(action.option_strings)}


def emit(report: BenchReport, args: argparse.Namespace) -> None:
    """Print the table and write the ``--json`` / ``--plot`` files the user asked for."""
    report.config = {k: v for k, v in vars(args).items() if k not in ("json", "plot", "explicit")}
    print(render_table(report), flush=True)
    if args.json:
        print(f"# wrote {write_json(report, args.json)}")
    if args.plot:
        print(f"# wrote {write_plot(report, args.plot)}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"fastpar bench: unknown benchmark {name!r}; choose one of {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(BENCHMARKS[name])
    parser = build_parser(name, module)
    try:
        args = parser.parse_args(rest)
    except SystemExit as exc:  # --help (0) or an argparse error (2): return instead of exiting
        return int(exc.code or 0)
    args.benchmark = name
    leader = os.environ.get("RANK", "0") == "0"
    try:
        args.explicit = _explicit_flags(parser, rest)
        _validate(name, module, args, args.explicit)
        report = module.run(args)
    except BenchUsageError as exc:
        print(f"fastpar bench {name}: error: {exc}", file=sys.stderr)
        return 2
    except WrongResultError as exc:
        if leader:
            print(f"fastpar bench {name}: WRONG RESULTS (no speed reported): {exc}", file=sys.stderr)
        return 1
    if report is not None:
        emit(report, args)
    return 0
