"""The ``fastpar`` command. Each subcommand lives in its own module with ``main(argv) -> int``,
imported only when that subcommand runs, so one part's optional dependencies never slow another."""

from __future__ import annotations

import importlib
import sys

# name -> (module with main(argv), one-line help)
COMMANDS = {
    "info": ("fastpar.info", "versions of torch/CUDA/NCCL/DALI and which kernel backend is live"),
    "topo": ("fastpar.topology.cli", "GPU/NVLink/PCIe/NUMA/NIC topology, best-k GPU selection, NCCL settings"),
    "bench": ("fastpar.bench.cli", "microbenchmarks: collectives, fusion, pack kernels, DDP step, data loaders"),
    "demo": ("fastpar.train.demo", "generate a small image set and train a CNN on it with the Trainer"),
    "jobs": ("fastpar.jobs.cli", "background and batch jobs: list, status, logs, result, cancel"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: fastpar <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run 'fastpar <command> --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from . import __version__

        print(f"fastpar {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"fastpar: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
