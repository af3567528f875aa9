"""The typed context a benchmark runs with: the shared flags after defaults and checks, the benchmark's own
flags as parsed, and what the CLI knows about the run (command line, flags given, the machine's load).

Built once by ``cli.prepare``; benchmarks read it and never add to it (``slots``: a new attribute is an
error). What a benchmark derives from its flags lives in its own variables or dataclasses. The one field
set after preparing is ``backend``, when ``launch`` resolves ``auto`` to the backend that ran.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from .harness import Plan


@dataclass(slots=True)
class BenchContext:
    benchmark: str  # the name it was run as, e.g. "allreduce"
    command: str  # the command line, for the report
    flags: argparse.Namespace  # the benchmark's own flags, as parsed
    explicit: frozenset[str]  # the shared flags given on the command line
    min_bytes: str
    max_bytes: str
    factor: int
    iters: int
    warmup: int
    rounds: int
    dtype: str
    backend: str  # "auto" until launch resolves it
    threads: int
    nproc: int | None = None
    json: str | None = None
    plot: str | None = None
    sizes: list[int] = field(default_factory=list)  # the -b/-e/-f sweep, for benchmarks that sweep sizes
    load_before: float | None = None  # 1-minute load average when the run started

    @property
    def plan(self) -> Plan:
        return Plan(self.warmup, self.rounds, self.iters)

    def config(self) -> dict[str, Any]:
        """What produced a report, for its JSON: the shared flags (resolved) and the benchmark's own."""
        shared = {
            "benchmark": self.benchmark,
            "min_bytes": self.min_bytes,
            "max_bytes": self.max_bytes,
            "factor": self.factor,
            "iters": self.iters,
            "warmup": self.warmup,
            "rounds": self.rounds,
            "dtype": self.dtype,
            "backend": self.backend,
            "threads": self.threads,
            "nproc": self.nproc,
            "sizes": list(self.sizes),
        }
        return {**shared, **vars(self.flags)}
