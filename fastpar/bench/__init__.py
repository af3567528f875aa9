"""``fastpar bench``: microbenchmarks that measure fastpar against its peers and the machine's floor.

Run ``fastpar bench --help`` for the list. Layout:

- the shared parts, here: ``cli`` (one flag vocabulary, the benchmark table, exit codes), ``context`` (the typed
  :class:`BenchContext` a benchmark runs with), ``harness`` (sizes, dtypes, interleaved timing, checks),
  ``launch`` (ranks: spawned or torchrun), ``goals`` (declared :class:`Goal` objects and their verdicts),
  ``table`` (the printed table, JSON and plot), ``machine`` (the machine and its load), ``report`` (``all``),
  ``peers`` (multi-rank calls for pytest-benchmark);
- ``benchmarks/``: one module per benchmark and the modules they share;
- ``costmodel_cmds/``: ``calibrate`` and ``simulate``, the commands of the cost model.

The sweep benchmark belongs to the job system (``fastpar.jobs.bench_sweep``): ``fastpar.cli`` adds it to the
table, so nothing here imports a layer above.
"""

from __future__ import annotations

from .cli import BENCHMARKS, main
from .context import BenchContext
from .goals import Goal, Verdict
from .harness import BenchUsageError, WrongResultError
from .table import BenchReport

__all__ = [
    "BENCHMARKS",
    "BenchContext",
    "BenchReport",
    "BenchUsageError",
    "Goal",
    "Verdict",
    "WrongResultError",
    "main",
]
