"""README's claims, as a reader takes them: what has run where, said up front; the measured table in one stated
direction; one time for the fast suite. (Its length and links: tests/test_docs.py; its install lines:
tests/test_install.py.)"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    start = README.index(f"## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end != -1 else len(README)]


def test_what_has_run_on_a_gpu_is_said_before_the_quick_start():
    assert -1 < README.find("GPU results") < README.index("## Quick start")


def test_measured_table_states_one_direction():
    measured = _section("Measured")
    header = measured[: measured.index("|")]
    assert "lower is better" in header, "the table must say which way its ratios go"
    rows = [line for line in measured.splitlines() if line.startswith("|") and not line.startswith("|---")]
    ratio_cells = [row.split("|")[2].strip() for row in rows[1:]]
    assert ratio_cells, "no rows in README's measured table"
    for cell in ratio_cells:
        # times relative to the peer only: no speed-ups ("faster"), no percentages of throughput
        assert re.search(r"\d×", cell) and "faster" not in cell and "%" not in cell, cell


def test_fast_suite_time_is_stated_once():
    # one measured number for the fast suite (in whole minutes), not several that disagree
    paragraphs = [p for p in README.split("\n\n") if re.search(r"fast (?:default )?suite", p)]
    minutes = {int(m) for p in paragraphs for m in re.findall(r"(\d+) min", p)}
    assert len(minutes) == 1, f"README states the fast suite's time as {sorted(minutes)} minutes"
