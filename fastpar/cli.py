"""The ``fastpar`` command. Each subcommand lives in its own module with ``main(argv) -> int``,
imported only when that subcommand runs, so one part's optional dependencies never slow another.

Every subcommand gets the same error handling (``fastpar.user_errors``): a user error -- a bad flag,
a ``UserError`` it raises, a missing optional package, a path it can't use -- is one line on stderr and
exit status 2; ``--debug`` (or ``FASTPAR_DEBUG=1``) adds the traceback. Anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback

from .user_errors import describe, one_line_argparse_errors

# name -> (module with main(argv), or "module:function", one-line help)
COMMANDS = {
    "info": ("fastpar.info", "versions of torch/CUDA/NCCL/DALI and which kernel backend is live"),
    "topo": ("fastpar.topology.cli", "GPU/NVLink/PCIe/NUMA/NIC topology, best-k GPU selection, NCCL settings"),
    "bench": ("fastpar.cli:bench_main", "microbenchmarks: collectives, fusion, pack kernels, DDP step, data loaders"),
    "plan": (
        "fastpar.costmodel.plan_cli",
        "memory planner: per-device bytes and step time of DDP, ZeRO, FSDP2, pipeline",
    ),
    "data": ("fastpar.data.tokens.cli", "prepare text into token shards for fastpar.data.token_loader"),
    "demo": ("fastpar.train.demo", "generate a small image set and train a CNN on it with the Trainer"),
    "shard-demo": (
        "fastpar.train.shard_demo",
        "train a transformer several times one process's memory budget, sharded as the planner picks",
    ),
    "lm-demo": (
        "fastpar.train.lm_demo",
        "train a small GPT on the Python standard library's sources on CPU processes; fails above a val loss",
    ),
    "jobs": ("fastpar.jobs.cli", "background and batch jobs: list, status, logs, result, cancel"),
}
# benchmarks that live above fastpar.bench (which must not import them), added to its table: name -> module
UPPER_BENCHMARKS = {"sweep": "fastpar.jobs.bench_sweep", "lm": "fastpar.train.bench_lm"}


def bench_main(argv: list[str]) -> int:
    """``fastpar bench``: the bench package's benchmarks plus the ones that live above it."""
    from .bench.cli import BENCHMARKS, main

    return main(argv, benchmarks={**BENCHMARKS, **UPPER_BENCHMARKS})


# FASTPAR_EXT's values (fastpar's kernel loader reads it; checked here without importing torch)
EXT_MODES = ("auto", "compiled", "cupy", "jit", "torch")


def _setting_problem() -> str | None:
    """A fastpar environment setting with a value nothing would act on, or None."""
    mode = os.environ.get("FASTPAR_EXT")
    if mode is not None and mode not in EXT_MODES:
        return f"FASTPAR_EXT={mode!r} is not one of {'|'.join(EXT_MODES)}; unset it or choose one"
    return None


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: fastpar <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += [
        "",
        "Run 'fastpar <command> --help' for a command's options.",
        "Errors are one line; 'fastpar --debug <command> ...' (or FASTPAR_DEBUG=1) also shows the traceback.",
    ]
    return "\n".join(lines)


# what a shell reports for a command killed by SIGPIPE (128 + 13); Python ignores the signal and gets EPIPE instead
EXIT_PIPE_CLOSED = 141


def main(argv: list[str] | None = None) -> int:
    """``fastpar ...``: the exit status. Output piped into a reader that stops early (``| head``) ends the command
    quietly instead of in a BrokenPipeError traceback."""
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # here, even on SystemExit (argparse's --help): not at the interpreter's exit
    except BrokenPipeError:
        # stdout's file descriptor now points at /dev/null, so Python's own flush at exit has nowhere to fail
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_PIPE_CLOSED


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = os.environ.get("FASTPAR_DEBUG", "") not in ("", "0")
    while argv and argv[0] == "--debug":
        debug, argv = True, argv[1:]
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from ._version import __version__

        print(f"fastpar {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if (problem := _setting_problem()) is not None:
        print(f"fastpar: error: {problem}", file=sys.stderr)
        return 2
    if name not in COMMANDS:
        choices = ", ".join(COMMANDS)
        print(
            f"fastpar: error: unknown command {name!r}; choose one of {choices} (see 'fastpar --help')", file=sys.stderr
        )
        return 2
    return _run(name, rest, debug)


def _interrupted_line(said: str) -> str:
    """ "interrupted", with what the interrupted code said about it (which may begin with the word itself)."""
    said = " ".join(said.split())
    if not said:
        return "interrupted"
    return said if said.lower().startswith(("interrupted", "sweep interrupted")) else f"interrupted ({said})"


def _run(name: str, argv: list[str], debug: bool) -> int:
    """Run one subcommand; user errors become one line and exit status 2."""
    try:
        with one_line_argparse_errors():
            module_name, _, function = COMMANDS[name][0].partition(":")
            entry = getattr(importlib.import_module(module_name), function or "main")
            return int(entry(argv) or 0)
    except KeyboardInterrupt as exc:
        print(f"fastpar {name}: {_interrupted_line(str(exc))}", file=sys.stderr)
        return 130
    except BrokenPipeError:
        raise  # the reader of stdout left: main() ends quietly
    except Exception as exc:
        line = describe(exc, argv)
        if line is None:
            raise  # not the user's to fix: the traceback is the report
        if debug:
            traceback.print_exc()
        print(f"fastpar {name}: error: {line}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
