"""What a benchmark returns and how it is shown: a fixed-column table with a footer, JSON, a PNG plot.

Every benchmark builds one :class:`BenchReport`; the CLI prints it, writes ``--json`` and ``--plot``,
and ``fastpar bench all`` (report.py) collects them into a Markdown summary. The JSON schema (version 1):

    {"schema": "fastpar.bench/1", "benchmark": str, "title": str, "command": str, "created": ISO time,
     "fastpar": version, "machine": {cpu_model, cpu_count, gpus, torch, nccl, ...},
     "header": {str: str}, "columns": [{"key", "title", "unit"}], "rows": [{key: value}],
     "summary": {..., "goals": [{name, value, threshold, direction, unit, met, flagged, flag}],
                 "goals_met": bool | null}, "footer": [str], "warnings": [str], "notes": [str],
     "config": {flag: value}}

Every summary has ``goals`` (the declared goals checked in this run, ``fastpar.bench.goals``) and
``goals_met`` (all of them met; null when none was checked). Numbers are plain JSON numbers
(seconds-derived values in the column's unit); inf/nan become null.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._optional import require
from .goals import Verdict
from .goals import summary as goals_summary

SCHEMA = "fastpar.bench/1"


@dataclass(frozen=True)
class Column:
    """One table column: ``key`` into the row dicts, printed ``title``, width and number format."""

    key: str
    title: str
    width: int
    fmt: str = ""  # format spec for numbers, e.g. ".2f"; strings are printed as they are
    unit: str = ""


@dataclass
class PlotSpec:
    """``kind="line"``: ``y`` against ``x`` (log-log), one line per ``series`` value; ``kind="bar"``:
    one bar per row labelled by ``x`` (plus ``series`` when given) with height ``y``."""

    kind: str
    x: str
    y: str
    series: str | None = None
    ylabel: str = ""


@dataclass
class BenchReport:
    benchmark: str
    title: str
    columns: list[Column]
    rows: list[dict[str, Any]] = field(default_factory=list)
    header: dict[str, str] = field(default_factory=dict)
    footer: list[str] = field(default_factory=list)
    goals: list[Verdict] = field(default_factory=list)  # printed after the footer, listed in the summary
    warnings: list[str] = field(default_factory=list)  # e.g. a machine busier than its cores
    notes: list[str] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    plot: PlotSpec | None = None
    command: str = ""  # the command line that produced it
    created: str = ""  # ISO time
    machine: dict[str, Any] = field(default_factory=dict)  # fastpar.bench.machine.machine_facts()

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "benchmark": self.benchmark,
            "title": self.title,
            "command": self.command,
            "created": self.created,
            "fastpar": self.machine.get("fastpar", ""),
            "machine": _json_value(self.machine),
            "header": dict(self.header),
            "columns": [{"key": c.key, "title": c.title, "unit": c.unit} for c in self.columns],
            "rows": [{c.key: _json_value(row.get(c.key)) for c in self.columns} | _extra(row) for row in self.rows],
            "summary": {k: _json_value(v) for k, v in (self.summary | goals_summary(self.goals)).items()},
            "footer": list(self.footer),
            "warnings": list(self.warnings),
            "notes": list(self.notes),
            "config": {k: _json_value(v) for k, v in self.config.items()},
        }


def _json_value(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no inf/nan
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    return str(value)


def _extra(row: dict[str, Any]) -> dict[str, Any]:
    """Row entries that are not columns but belong in the JSON (keys starting with ``_`` stay private)."""
    return {k: _json_value(v) for k, v in row.items() if not k.startswith("_")}


def format_cell(value: Any, column: Column) -> str:
    if value is None:
        text = "-"
    elif isinstance(value, float):
        text = "inf" if math.isinf(value) else ("nan" if math.isnan(value) else format(value, column.fmt))
    else:
        text = str(value)
    return text.rjust(column.width)


def render_table(report: BenchReport) -> str:
    """The printed form: ``# header`` lines, the column titles, one line per row, then ``# footer`` lines, the
    goal verdicts, warnings and notes."""
    lines = [f"# fastpar bench {report.benchmark}: {report.title}"]
    lines += [f"# {key}: {value}" for key, value in report.header.items()]
    lines.append("#")
    lines.append(" ".join(c.title.rjust(c.width) for c in report.columns))
    lines += [" ".join(format_cell(row.get(c.key), c) for c in report.columns) for row in report.rows]
    lines += [f"# {line}" for line in report.footer]
    lines += [f"# {verdict.line()}" for verdict in report.goals]
    lines += [f"# warning: {warning}" for warning in report.warnings]
    lines += [f"# note: {note}" for note in report.notes]
    return "\n".join(lines)


def write_json(report: BenchReport, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report.to_json(), indent=2, allow_nan=False) + "\n")  # strict JSON: no NaN/Infinity
    return path


def write_plot(report: BenchReport, path: str | Path) -> Path:
    """Draw the report's :class:`PlotSpec` into a PNG with matplotlib (headless backend)."""
    if report.plot is None:
        raise ValueError(f"benchmark {report.benchmark!r} has nothing to plot")
    matplotlib = require("matplotlib", purpose="--plot")
    matplotlib.use("Agg")  # no display needed
    plt = require("matplotlib.pyplot", extra="bench", purpose="--plot")
    spec = report.plot
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    try:
        rows = [r for r in report.rows if isinstance(r.get(spec.y), (int, float))]
        if spec.kind == "line":
            for name in dict.fromkeys(r.get(spec.series) for r in rows) if spec.series else [None]:
                points = [(r[spec.x], r[spec.y]) for r in rows if spec.series is None or r.get(spec.series) == name]
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=str(name or spec.y))
            ax.set_xscale("log", base=2)
            ax.set_xlabel(spec.x)
            ax.legend()
        else:
            labels = [f"{r.get(spec.series)} {r[spec.x]}" if spec.series else str(r[spec.x]) for r in rows]
            ax.barh(range(len(rows)), [r[spec.y] for r in rows])
            ax.set_yticks(range(len(rows)), labels, fontsize=7)
            ax.invert_yaxis()
        ax.set_title(f"fastpar bench {report.benchmark}", fontsize=10)
        (ax.set_ylabel if spec.kind == "line" else ax.set_xlabel)(spec.ylabel or spec.y)
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
    return path
