"""One PNG with every trial's validation curve (or training loss, when a trial validates nothing), so a
sweep's trials are compared at a glance. Drawn with matplotlib's Agg backend and replaced atomically
(through a fresh temporary file, mode 0600 like every job file)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._optional import require
from .private_files import write_private


def curve_key(histories: Sequence[Sequence[dict[str, Any]]], metric: str | None) -> str | None:
    """What to draw: the ranking metric's validation series, else val_loss, else loss (the first any trial has)."""
    wanted = [metric] if metric and metric.startswith("val_") else []
    wanted += ["val_loss", "val_accuracy", metric or "", "loss", "value"]
    for key in wanted:
        if key and any(r.get(key) is not None for history in histories for r in history):
            return key
    return None


def plot_trials(
    labels: Sequence[str],
    histories: Sequence[Sequence[dict[str, Any]]],
    path: Path,
    metric: str | None = None,
    best: int | None = None,
) -> Path | None:
    """Draw each trial's series against its iteration into ``path``; None when no trial published any."""
    key = curve_key(histories, metric)
    if key is None:
        return None
    matplotlib = require("matplotlib", extra="plot", purpose="the sweep's curve plot")
    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure  # a bare Figure: no pyplot global state

    fig = Figure(figsize=(9, 5), layout="constrained")
    ax = fig.subplots()
    for index, (label, history) in enumerate(zip(labels, histories, strict=True)):
        points = [(r.get("iteration", i), r[key]) for i, r in enumerate(history) if r.get(key) is not None]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o", ms=3, lw=2.4 if index == best else 1.2, label=label)
    ax.set_xlabel("iteration")
    ax.set_ylabel(key)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=7)
    title = f"{key} of every trial" + (f" (best: {labels[best]})" if best is not None else "")
    ax.set_title(title, fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    write_private(path, buffer.getvalue())  # a fresh temporary name, never a link someone planted
    return path
