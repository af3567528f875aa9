"""Declared goals and their verdicts: what a benchmark promises, checked against what it measured.

A benchmark declares each goal once, as a module-level :class:`Goal` (what is measured, against what,
the threshold and its direction), and hands :meth:`Goal.check` the measured value; the table renders
the resulting :class:`Verdict` lines and the JSON lists them under ``summary["goals"]``. No benchmark
writes ``MET`` / ``NOT MET`` itself.

A measurement beyond a physical bound (faster than the no-communication floor, above memcpy's
bandwidth, above what the wire can carry) cannot be right: it is *flagged* with the reason, its
verdict is ``IMPOSSIBLE`` and it is never met. Values are printed with as many digits as the verdict
needs: a printed number is never on the other side of the threshold from the measured one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

Direction = Literal["at_most", "at_least"]
AT_MOST: Direction = "at_most"
AT_LEAST: Direction = "at_least"

_MAX_DIGITS = 6


@dataclass(frozen=True)
class Goal:
    """A target: ``measured`` against ``reference``, ``<= threshold`` (AT_MOST) or ``>= threshold`` (AT_LEAST).

    ``unit`` is ``"x"`` for a ratio (printed ``0.92x``) or ``"%"`` for a share (printed ``85%``)."""

    measured: str
    reference: str
    threshold: float
    direction: Direction
    unit: Literal["x", "%"] = "x"

    def __post_init__(self) -> None:
        if self.direction not in (AT_MOST, AT_LEAST):
            raise ValueError(f"a goal's direction is {AT_MOST!r} or {AT_LEAST!r}, got {self.direction!r}")

    def claim(self, scope: str = "", reference: str | None = None) -> str:
        """``"mlp: fastpar_fp32 step <= 0.92x the best fp32 torch variant"``."""
        sign = "<=" if self.direction == AT_MOST else ">="
        text = f"{self.measured} {sign} {format_value(self.threshold, self.unit, digits=_digits(self.threshold, self.unit))}"
        ref = self.reference if reference is None else reference
        text = f"{text} {ref}" if ref else text
        return f"{scope}: {text}" if scope else text

    def passes(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        return value <= self.threshold if self.direction == AT_MOST else value >= self.threshold

    def check(
        self, value: float, *, scope: str = "", reference: str | None = None, detail: str = "", flag: str | None = None
    ) -> Verdict:
        """The verdict on ``value``; ``reference`` replaces the declared one in the printed claim (e.g. naming the
        variant that turned out best), ``detail`` is printed after the value, ``flag`` says which physical bound the
        measurement is beyond (then the goal is never met)."""
        return Verdict(self, value, scope, self.reference if reference is None else reference, detail, flag)


@dataclass(frozen=True)
class Verdict:
    """One goal checked against one measured value."""

    goal: Goal
    value: float
    scope: str = ""
    reference: str = ""
    detail: str = ""
    flag: str | None = None  # the physical bound the measurement is beyond

    @property
    def name(self) -> str:
        return self.goal.claim(self.scope, self.reference)

    @property
    def flagged(self) -> bool:
        return self.flag is not None

    @property
    def met(self) -> bool:
        return not self.flagged and self.goal.passes(self.value)

    @property
    def state(self) -> str:
        if self.flagged:
            return "IMPOSSIBLE"
        return "MET" if self.met else "NOT MET"

    def line(self) -> str:
        """``goal: <claim>: <value>[ (<detail>)] -> MET | NOT MET | IMPOSSIBLE (<why>)``."""
        measured = measured_text(self.value, self.goal)
        if self.detail:
            measured = f"{measured} ({self.detail})"
        verdict = f"IMPOSSIBLE ({self.flag})" if self.flagged else self.state
        return f"goal: {self.name}: {measured} -> {verdict}"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "value": self.value if math.isfinite(self.value) else None,
            "threshold": self.goal.threshold,
            "direction": self.goal.direction,
            "unit": self.goal.unit,
            "met": self.met,
            "flagged": self.flagged,
            "flag": self.flag,
        }


def summary(verdicts: list[Verdict]) -> dict[str, Any]:
    """The JSON summary's goal keys, the same in every benchmark: ``goals`` (one entry per verdict) and
    ``goals_met`` (every goal met; None when the run checked no goal)."""
    return {
        "goals": [v.to_json() for v in verdicts],
        "goals_met": all(v.met for v in verdicts) if verdicts else None,
    }


def format_value(value: float, unit: str, digits: int) -> str:
    if not math.isfinite(value):
        return str(value)
    if unit == "%":
        return f"{value * 100:.{digits}f}%"
    return f"{value:.{digits}f}x"


def _digits(value: float, unit: str) -> int:
    """The fewest digits (at least the unit's usual ones: 0 for %, 2 for x) that print ``value`` exactly enough
    for a threshold: 85% stays 85%, 87.5% is 87.5%."""
    base = 0 if unit == "%" else 2
    scaled = value * 100 if unit == "%" else value
    for digits in range(base, _MAX_DIGITS + 1):
        if math.isclose(round(scaled, digits), scaled, rel_tol=0, abs_tol=1e-12):
            return digits
    return _MAX_DIGITS


def measured_text(value: float, goal: Goal) -> str:
    """``value`` with the digits the verdict needs: at least one more than the threshold's, and more until the
    printed number is on the same side of the threshold as the measured one (84.99% never prints as 85.0%)."""
    if not math.isfinite(value):
        return format_value(value, goal.unit, 0)
    scale = 100.0 if goal.unit == "%" else 1.0
    fewest = max(1 if goal.unit == "%" else 2, _digits(goal.threshold, goal.unit))
    threshold = round(goal.threshold * scale, _MAX_DIGITS + 2)
    digits = fewest
    for digits in range(fewest, _MAX_DIGITS + 1):  # noqa: B007 - the digits found are used below
        printed = round(value * scale, digits)
        same_side = (printed <= threshold) if goal.direction == AT_MOST else (printed >= threshold)
        if same_side == goal.passes(value):
            break
    return format_value(value, goal.unit, digits)


def beyond_floor(label: str, seconds: float, floor_seconds: float, floor: str) -> str | None:
    """The flag of a time below its floor (a run cannot be faster than its own floor), else None."""
    if seconds < floor_seconds:
        return f"{label} {seconds / floor_seconds:.3f}x {floor}: faster than the floor"
    return None


def above_bound(label: str, value: float, bound: float, what: str) -> str | None:
    """The flag of a bandwidth or rate above what the machine can move (``value / bound`` > 1), else None."""
    if value > bound:
        return f"{label} at {value / bound:.1%} of {what}: above what the machine can move"
    return None
