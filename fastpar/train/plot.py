"""The training-progress figure (after MATLAB's): loss and accuracy against iteration, train and
validation, epoch boundaries marked, learning rate below, elapsed time and throughput in the title.

Rendered with matplotlib's Agg backend (no display needed) into a PNG that is replaced atomically, so
a viewer never sees a half-written file.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._optional import require
from ..safe_files import atomic_file
from .progress import format_duration


def _series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(r["iteration"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def write_progress_plot(records: Sequence[dict[str, Any]], path: Path, *, final: bool = False) -> Path:
    """Draw ``records`` (metrics.jsonl entries) into the PNG at ``path`` and return it."""
    matplotlib = require("matplotlib", extra="plot", purpose="the training-progress plot")
    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure  # a bare Figure: no pyplot global state in the training process

    has_accuracy = any(r.get("accuracy") is not None or r.get("val_accuracy") is not None for r in records)
    rows = 3 if has_accuracy else 2
    fig = Figure(figsize=(9, 2.6 * rows + 0.6), layout="constrained")
    axes = fig.subplots(rows, 1, sharex=True, height_ratios=[3, 3, 1.4][-rows:] if rows == 3 else [3, 1.4])
    panels = [("loss", "Loss", 1.0)] + ([("accuracy", "Accuracy (%)", 100.0)] if has_accuracy else [])
    for ax, (key, label, scale) in zip(axes, panels, strict=False):
        xs, ys = _series(records, key)
        ax.plot(xs, [y * scale for y in ys], color="tab:blue", lw=1.2, label="training")
        xs, ys = _series(records, f"val_{key}")
        ax.plot(xs, [y * scale for y in ys], "o--", color="black", ms=4, lw=1, label="validation")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    xs, ys = _series(records, "lr")
    axes[-1].plot(xs, ys, color="tab:orange", lw=1.2)
    axes[-1].set_ylabel("Learning rate")
    axes[-1].set_xlabel("Iteration")
    axes[-1].grid(alpha=0.3)
    # epoch boundaries: the last iteration logged in each epoch
    for before, after in zip(records, records[1:], strict=False):
        if after["epoch"] != before["epoch"]:
            for ax in axes:
                ax.axvline(before["iteration"], color="grey", lw=0.8, ls=":")
    last = records[-1] if records else {}
    state = "done" if final else "training"
    title = f"Training progress ({state})"
    if last:
        title += (
            f" — epoch {last['epoch'] + 1}, iteration {last['iteration']}, elapsed {format_duration(last['elapsed'])}, "
            f"{last.get('samples_per_s', 0):.0f} samples/s"
        )
    fig.suptitle(title, fontsize=10)
    with atomic_file(path, mode=None) as fh:  # a new random name renamed over the PNG: never through a link
        fig.savefig(fh, format="png", dpi=100)
    return path
