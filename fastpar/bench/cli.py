"""``fastpar bench <name> [flags]``: one flag vocabulary for every benchmark.

Each benchmark module offers ``DESCRIPTION``, ``USES`` (which shared flags apply: ``sizes``, ``nproc``,
``dtype``), ``DEFAULTS`` (its own defaults for the shared flags), ``add_arguments(parser)`` and
``run(ctx: BenchContext) -> BenchReport | None``; optionally ``DTYPE_CHOICES`` (the dtypes it takes) and
``describe(name)`` (a line per benchmark name, when one module serves several).

Benchmarks are found by name in a name -> module table: :data:`BENCHMARKS` holds the ones in this
package; a layer above (``fastpar.cli``) passes a larger table for benchmarks that live above ``bench``
(the sweep benchmark is in ``fastpar.jobs``), so this package never imports upward.

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
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

from .._optional import available
from ..launcher import launched_by_torchrun
from ..user_errors import UserError, describe, redact_url
from .context import BenchContext
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
from .machine import load_average, load_lines
from .table import BenchReport, render_table, write_json, write_plot

# name -> module: the benchmarks of this package (fastpar.cli adds those that live above it)
BENCHMARKS = {
    "allreduce": "fastpar.bench.benchmarks.collectives",
    "reducescatter": "fastpar.bench.benchmarks.collectives",
    "allgather": "fastpar.bench.benchmarks.collectives",
    "broadcast": "fastpar.bench.benchmarks.collectives",
    "alltoall": "fastpar.bench.benchmarks.collectives",
    "fusion": "fastpar.bench.benchmarks.fusion",
    "pack": "fastpar.bench.benchmarks.pack",
    "ddp": "fastpar.bench.benchmarks.ddp_step",
    "zero": "fastpar.bench.benchmarks.zero",
    "shard": "fastpar.bench.benchmarks.shard",
    "data": "fastpar.bench.benchmarks.data",
    "nodes": "fastpar.bench.benchmarks.nodes",
    "calibrate": "fastpar.bench.costmodel_cmds.calibrate",
    "simulate": "fastpar.bench.costmodel_cmds.simulate",
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
_OUTPUT_FLAGS = ("nproc", "json", "plot")


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag raises :class:`BenchUsageError` (one line) instead of printing usage and exiting."""

    def error(self, message: str):  # type: ignore[override]
        raise BenchUsageError(f"{message} (see 'fastpar bench {self.prog.split()[-1]} --help')")


def _description(name: str, module: ModuleType) -> str:
    describe = getattr(module, "describe", None)
    return describe(name) if describe else module.DESCRIPTION


def _usage(benchmarks: Mapping[str, str]) -> str:
    lines = ["usage: fastpar bench <benchmark> [flags]", "", "benchmarks:"]
    for name, module_name in benchmarks.items():
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
    add(
        "-b",
        "--minbytes",
        dest="min_bytes",
        metavar="SIZE",
        applies=sweep,
        help=f"smallest size in bytes, K/M/G suffixes allowed (default {defaults['min_bytes']})",
    )
    add(
        "-e",
        "--maxbytes",
        dest="max_bytes",
        metavar="SIZE",
        applies=sweep,
        help=f"largest size in bytes (default {defaults['max_bytes']})",
    )
    add(
        "-f",
        "--stepfactor",
        dest="factor",
        metavar="F",
        type=int,
        applies=sweep,
        help=f"multiply the size by F each step (default {defaults['factor']})",
    )
    add("-n", "--iters", metavar="N", type=int, help=f"timed calls per round (default {defaults['iters']})")
    add(
        "-w",
        "--warmup",
        metavar="N",
        type=int,
        help=f"untimed warm-up calls per variant (default {defaults['warmup']})",
    )
    add(
        "--rounds",
        metavar="N",
        type=int,
        help=f"interleaved rounds; the time reported is their median (default {defaults['rounds']})",
    )
    choices = getattr(module, "DTYPE_CHOICES", None)
    dtypes = f": {', '.join(dtype_name(d) for d in choices)}" if choices else ""
    add("--dtype", applies="dtype" in uses, help=f"element type{dtypes} (default {defaults['dtype']})")
    add(
        "--nproc",
        metavar="N",
        type=int,
        applies="nproc" in uses,
        help="local ranks to spawn (default: one per GPU, else 2); under torchrun the launched ranks run",
    )
    add(
        "--backend",
        applies="nproc" in uses,
        help="auto (NCCL on GPUs, else gloo), gloo, nccl or fastpar (shared memory, timed next to gloo) (default auto)",
    )
    add("--threads", metavar="N", type=int, help="torch threads per process (default 1)")
    add("--json", metavar="FILE", help="also write the results as JSON")
    add("--plot", metavar="FILE", help="also draw the results into a PNG (needs matplotlib)")
    module.add_arguments(parser)
    return parser


def _context(name: str, module: ModuleType, parsed: argparse.Namespace, command: str) -> BenchContext:
    """The shared flags with defaults filled in and checked, the benchmark's own flags apart, and the flags
    given recorded; refuses what cannot work, before any rank starts."""
    shared = {**SHARED_DEFAULTS, **module.DEFAULTS}
    values = vars(parsed)
    explicit = frozenset(key for key in [*shared, *_OUTPUT_FLAGS] if values.get(key) is not None)
    own = argparse.Namespace(**{k: v for k, v in values.items() if k not in shared and k not in _OUTPUT_FLAGS})
    resolved = {key: default if values.get(key) is None else values[key] for key, default in shared.items()}
    ctx = BenchContext(
        benchmark=name,
        command=command,
        flags=own,
        explicit=explicit,
        **resolved,
        nproc=values.get("nproc"),
        json=values.get("json"),
        plot=values.get("plot"),
        load_before=load_average(),
    )
    uses = module.USES
    if "sizes" in uses:
        ctx.sizes = size_sweep(parse_bytes(ctx.min_bytes), parse_bytes(ctx.max_bytes), ctx.factor)
    elif explicit & _SIZE_FLAGS:
        raise BenchUsageError(
            f"{name} does not sweep sizes, so -b/-e/-f do not apply; see its --help for its own flags"
        )
    if "nproc" not in uses:
        if ctx.nproc not in (None, 1):
            raise BenchUsageError(f"{name} runs in one process; --nproc {ctx.nproc} does not apply (drop it)")
        if explicit & {"backend"}:
            raise BenchUsageError(f"{name} runs in one process; --backend does not apply")
    allowed = getattr(module, "DTYPE_CHOICES", None) if "dtype" in uses else (DTYPES["float32"],)
    parse_dtype(ctx.dtype, allowed, user=name)
    Plan(ctx.warmup, ctx.rounds, ctx.iters)
    if ctx.threads < 1:
        raise BenchUsageError(f"--threads must be at least 1, got {ctx.threads}")
    check_flags = getattr(module, "check_flags", None)  # a benchmark's own flags, refused before outputs are made
    if check_flags is not None:
        check_flags(own)
    as_dirs = getattr(module, "OUTPUTS_ARE_DIRECTORIES", False)
    for flag in ("json", "plot"):
        if getattr(ctx, flag):
            check_writable(getattr(ctx, flag), f"--{flag}", as_dirs)
    if ctx.plot and not available("matplotlib"):
        raise BenchUsageError("--plot needs matplotlib, which is not installed: pip install 'fastpar[bench]'")
    return ctx


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
        raise BenchUsageError(
            f"{flag} {path_text}: folder {folder} does not exist; create it first (mkdir -p {folder})"
        )
    try:
        if not folder.exists():
            folder.mkdir(parents=True)
            print(f"# created folder {folder} for {flag}", file=sys.stderr)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise BenchUsageError(f"{flag} {path_text}: not writable ({exc.strerror}: {exc.filename})") from None


def prepare(
    name: str, argv: list[str], benchmarks: Mapping[str, str] = BENCHMARKS
) -> tuple[ModuleType, BenchContext | None]:
    """The benchmark's module and its checked context; ``None`` when ``--help`` was printed."""
    if name not in benchmarks:
        raise BenchUsageError(f"unknown benchmark {name!r}; choose one of {', '.join(benchmarks)}")
    module = importlib.import_module(benchmarks[name])
    parser = build_parser(name, module)
    try:
        parsed = parser.parse_args(argv)
    except SystemExit:  # --help printed
        return module, None
    return module, _context(name, module, parsed, shlex.join(["fastpar", "bench", name, *argv]))


def finish(report: BenchReport, ctx: BenchContext) -> BenchReport:
    """Stamp a report with what produced it, so its JSON describes itself, and with the machine's load: a
    machine busier than its cores slows every number, which the reader must be told."""
    from .machine import machine_facts

    # a flag may be a URL with a password or token in it (--root): the JSON keeps it without them
    report.config = {k: redact_url(v) if isinstance(v, str) else v for k, v in ctx.config().items()}
    report.command = redact_url(ctx.command)
    report.created = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    report.machine = machine_facts()
    load_after = load_average()
    header, warning = load_lines(ctx.load_before, load_after)
    report.header["load average"] = header
    report.machine["load_before"], report.machine["load_after"] = ctx.load_before, load_after
    if warning:
        report.warnings.append(warning)
    return report


def emit(report: BenchReport, ctx: BenchContext) -> None:
    """Print the table and write the ``--json`` / ``--plot`` files the user asked for."""
    finish(report, ctx)
    print(render_table(report), flush=True)
    if ctx.json:
        print(f"# wrote {write_json(report, ctx.json)}")
    if ctx.plot:
        print(f"# wrote {write_plot(report, ctx.plot)}")


def _is_leader() -> bool:
    return os.environ.get("RANK", "0") == "0"


def main(argv: list[str] | None = None, benchmarks: Mapping[str, str] = BENCHMARKS) -> int:
    """``fastpar bench``; ``benchmarks`` is the name -> module table to run from (default: this package's)."""
    from ..launcher import RankError

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage(benchmarks))
        return 0
    name, leader = argv[0], _is_leader()

    def fail(kind: str, exc: object, status: int) -> int:
        if leader:
            print(f"fastpar bench {name}: {kind}: {redact_url(str(exc))}", file=sys.stderr)
        return status

    try:
        module, ctx = prepare(name, argv[1:], benchmarks)
        if ctx is None:
            return 0
        if launched_by_torchrun() and "nproc" not in module.USES and not leader:
            return 0  # a one-process benchmark under torchrun runs on rank 0 alone
        report = module.run(ctx)
        if report is not None:
            emit(report, ctx)
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
