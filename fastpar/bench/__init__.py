"""``fastpar bench``: microbenchmarks that measure fastpar against its peers and the machine's floor.

Run ``fastpar bench --help`` for the list; every benchmark shares one harness (``harness``), one
table/JSON/plot format (``table``) and one launcher (``launch``).
"""

from __future__ import annotations

from .cli import BENCHMARKS, main
from .harness import BenchUsageError, WrongResultError
from .table import BenchReport

__all__ = ["BENCHMARKS", "BenchReport", "BenchUsageError", "WrongResultError", "main"]
