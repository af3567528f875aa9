"""``fastpar bench <name> [flags]``: one flag vocabulary for every benchmark.

Each benchmark module offers ``DESCRIPTION``, ``USES`` (which shared flags apply: ``sizes``, ``nproc``,
``dtype``), ``DEFAULTS`` (its own defaults for the shared flags), ``add_arguments(parser)`` and
``run(args) -> BenchReport | None``; optionally ``DTYPE_CHOICES`` (the dtypes it takes) and
``describe(name)`` (a line per benchmark name, when one module serves several).

Exit status: 0 ok, 1 wrong results or a failed run (no speed is printed), 2 bad flags. Every error is
one line on stderr that says what is wrong and what to do; under torchrun only rank 0 prints.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import shlex
import sys
import tempfile
from pathlib import Path
from types import ModuleType

from .._optional import available
from ..launcher import launched_by_torchrun
from ..user_errors import UserError, describe
from .harness import (
    DTYPES,
    BenchUsageError,
    Plan,
    WrongResultError,
    dtype_name,
    parse_bytes,
    parse_dtype,
    size_sweep,
)
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
    "zero": "fastpar.bench.zero",
    "data": "fastpar.bench.data",
    "sweep": "fastpar.bench.sweep",
    "calibrate": "fastpar.bench.calibrate",
    "simulate": "fastpar.bench.simulate",
    "all": "fastpar.bench.report",
}
# Defaults of the shared flags; a benchmark's DEFAULTS override them. The flags themselves default to
# None so that the ones given on the command line are known (to refuse those that do not apply).
SHARED_DEFAULTS = {
    "min_bytes": "1K",
    "max_bytes": "16M",
    "factor": 2,
    "iters": 5,
    "warmup": 1,
    "rounds": 3,
    "dtype": "float32",
    "backend": "auto",
    "threads": 1,
}
_SIZE_FLAGS = {"min_bytes", "max_bytes", "factor"}


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag raises :class:`BenchUsageError` (one line) instead of printing usage and exiting."""

    def error(self, message: str):  # type: ignore[override]
        raise BenchUsageError(f"{message} (see 'fastpar bench {self.prog.split()[-1]} --help')")


def _description(name: str, module: ModuleType) -> str:
    describe = getattr(module, "describe", None)
    return describe(name) if describe else module.DESCRIPTION


def _usage() -> str:
    lines = ["usage: fastpar bench <benchmark> [flags]", "", "benchmarks:"]
    for name, module_name in BENCHMARKS.items():
        lines.append(f"  {name:<14} {_description(name, importlib.import_module(module_name))}")
    lines += [
        "",
        "shared flags: -b/-e/-f sizes, -n iterations, -w warm-up, --rounds, --dtype, --nproc N (or torchrun),",
        "--json FILE, --plot FILE (PNG). Run 'fastpar bench <benchmark> --help' for what applies and defaults.",
    ]
    return "\n".join(lines)


def build_parser(name: str, module: ModuleType) -> argparse.ArgumentParser:
    """The shared flags (those that do not apply are hidden from --help), then the benchmark's own."""
    uses, defaults = module.USES, {**SHARED_DEFAULTS, **module.DEFAULTS}
    parser = _Parser(prog=f"fastpar bench {name}", description=_description(name, module), allow_abbrev=False)
    shared = parser.add_argument_group("shared flags")

    def add(*flags: str, applies: bool = True, **kwargs) -> None:
        if not applies:
            kwargs["help"] = argparse.SUPPRESS  # still parsed, so using it gives a clear error
        shared.add_argument(*flags, default=None, **kwargs)

    sweep = "sizes" in uses
    # fmt: off
    add("-b", "--minbytes", dest="min_bytes", metavar="SIZE", applies=sweep,
        help=f"smallest size in bytes, K/M/G suffixes allowed (default {defaults['min_bytes']})")
    add("-e", "--maxbytes", dest="max_bytes", metavar="SIZE", applies=sweep,
        help=f"largest size in bytes (default {defaults['max_bytes']})")
    add("-f", "--stepfactor", dest="factor", metavar="F", type=int, applies=sweep,
        help=f"multiply the size by F each step (default {defaults['factor']})")
    add("-n", "--iters", metavar="N", type=int, help=f"timed calls per round (default {defaults['iters']})")
    add("-w", "--warmup", metavar="N", type=int, help=f"untimed warm-up calls per variant (default {defaults['warmup']})")
    add("--rounds", metavar="N", type=int,
        help=f"interleaved rounds; the time reported is their median (default {defaults['rounds']})")
    choices = getattr(module, "DTYPE_CHOICES", None)
    dtypes = f": {', '.join(dtype_name(d) for d in choices)}" if choices else ""
    add("--dtype", applies="dtype" in uses, help=f"element type{dtypes} (default {defaults['dtype']})")
    add("--nproc", metavar="N", type=int, applies="nproc" in uses,
        help="local ranks to spawn (default: one per GPU, else 2); under torchrun the launched ranks run")
    add("--backend", applies="nproc" in uses,
        help="auto (NCCL on GPUs, else gloo), gloo, nccl or fastpar (shared memory, timed next to gloo) (default auto)")
    add("--threads", metavar="N", type=int, help="torch threads per process (default 1)")
    add("--json", metavar="FILE", help="also write the results as JSON")
    add("--plot", metavar="FILE", help="also draw the results into a PNG (needs matplotlib)")
    # fmt: on
    module.add_arguments(parser)
    return parser


def _validate(name: str, module: ModuleType, args: argparse.Namespace) -> None:
    """Fill in defaults, record the flags given in ``args.explicit`` and refuse what cannot work, before
    any rank starts."""
    shared = {**SHARED_DEFAULTS, **module.DEFAULTS}
    args.explicit = {key for key in [*shared, "nproc", "json", "plot"] if getattr(args, key, None) is not None}
    for key, value in shared.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    uses = module.USES
    if "sizes" in uses:
        args.sizes = size_sweep(parse_bytes(args.min_bytes), parse_bytes(args.max_bytes), args.factor)
    elif args.explicit & _SIZE_FLAGS:
        raise BenchUsageError(
            f"{name} does not sweep sizes, so -b/-e/-f do not apply; see its --help for its own flags"
        )
    if "nproc" not in uses:
        if args.nproc not in (None, 1):
            raise BenchUsageError(f"{name} runs in one process; --nproc {args.nproc} does not apply (drop it)")
        if args.explicit & {"backend"}:
            raise BenchUsageError(f"{name} runs in one process; --backend does not apply")
    allowed = getattr(module, "DTYPE_CHOICES", None) if "dtype" in uses else (DTYPES["float32"],)
    parse_dtype(args.dtype, allowed, user=name)
    Plan(args.warmup, args.rounds, args.iters)
    if args.threads < 1:
        raise BenchUsageError(f"--threads must be at least 1, got {args.threads}")
    as_dirs = getattr(module, "OUTPUTS_ARE_DIRECTORIES", False)
    for flag in ("json", "plot"):
        if getattr(args, flag):
            check_writable(getattr(args, flag), f"--{flag}", as_dirs)
    if args.plot and not available("matplotlib"):
        raise BenchUsageError("--plot needs matplotlib, which is not installed: pip install 'fastpar[bench]'")


def check_writable(path_text: str, flag: str, directory: bool) -> None:
    """Refuse an output path that cannot be written before spending minutes on the run. A file goes into a
    folder that exists (a typo in a folder name is not silently created); an output directory is created,
    and that is said."""
    path = Path(path_text)
    if directory and path.exists() and not path.is_dir():
        raise BenchUsageError(f"{flag} {path_text}: exists and is not a directory; name a directory")
    if not directory and path.is_dir():
        raise BenchUsageError(f"{flag} {path_text}: is a directory; name a file")
    folder = path if directory else path.parent
    if not directory and not folder.is_dir():
        raise BenchUsageError(f"{flag} {path_text}: folder {folder} does not exist; create it first (mkdir -p {folder})")
    try:
        if not folder.exists():
            folder.mkdir(parents=True)
            print(f"# created folder {folder} for {flag}", file=sys.stderr)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise BenchUsageError(f"{flag} {path_text}: not writable ({exc.strerror}: {exc.filename})") from None


def prepare(name: str, argv: list[str]) -> tuple[ModuleType, argparse.Namespace | None]:
    """The benchmark's module and its checked arguments; ``None`` arguments when ``--help`` was printed."""
    if name not in BENCHMARKS:
        raise BenchUsageError(f"unknown benchmark {name!r}; choose one of {', '.join(BENCHMARKS)}")
    module = importlib.import_module(BENCHMARKS[name])
    parser = build_parser(name, module)
    try:
        args = parser.parse_args(argv)
    except SystemExit:  # --help printed
        return module, None
    args.benchmark = name
    args.command = shlex.join(["fastpar", "bench", name, *argv])
    _validate(name, module, args)
    return module, args


def finish(report: BenchReport, args: argparse.Namespace) -> BenchReport:
    """Stamp a report with what produced it, so its JSON describes itself."""
    from .machine import machine_facts

    hidden = ("json", "plot", "explicit", "command")
    report.config = {k: v for k, v in vars(args).items() if k not in hidden}
    report.command = args.command
    report.created = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    report.machine = machine_facts()
    return report


def emit(report: BenchReport, args: argparse.Namespace) -> None:
    """Print the table and write the ``--json`` / ``--plot`` files the user asked for."""
    finish(report, args)
    print(render_table(report), flush=True)
    if args.json:
        print(f"# wrote {write_json(report, args.json)}")
    if args.plot:
        print(f"# wrote {write_plot(report, args.plot)}")


def _is_leader() -> bool:
    return os.environ.get("RANK", "0") == "0"


def main(argv: list[str] | None = None) -> int:
    from ..launcher import RankError

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, leader = argv[0], _is_leader()

    def fail(kind: str, exc: object, status: int) -> int:
        if leader:
            print(f"fastpar bench {name}: {kind}: {exc}", file=sys.stderr)
        return status

    try:
        module, args = prepare(name, argv[1:])
        if args is None:
            return 0
        if launched_by_torchrun() and "nproc" not in module.USES and not leader:
            return 0  # a one-process benchmark under torchrun runs on rank 0 alone
        report = module.run(args)
        if report is not None:
            emit(report, args)
    except BenchUsageError as exc:
        return fail("error", exc, 2)
    except WrongResultError as exc:  # from 'all': some benchmarks failed, the others' results stand
        return fail("failed" if name == "all" else "WRONG RESULTS (no speed reported)", exc, 1)
    except RankError as exc:
        return fail("a rank failed", exc, 1)
    except (UserError, OSError) as exc:  # the user's to fix (a path, a store's endpoint or credentials): status 2
        line = describe(exc)
        return fail("error", exc, 1) if line is None else fail("error", line, 2)
    except KeyboardInterrupt:
        return fail("interrupted", "stopped by the user", 130)
    return 0
