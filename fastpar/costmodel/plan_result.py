"""What a plan is: per-strategy estimates (:class:`StrategyEstimate`) and the :class:`Plan` that holds them, its
choice and its printed table; and reading memory sizes (``80GB``, ``512MiB``) the way the command line takes them.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from ..user_errors import UserError
from .strategy_memory import MemoryBreakdown

__all__ = ["Plan", "StrategyEstimate", "fmt_bytes", "parse_bytes"]

_MB = 1 << 20
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "k": 1 << 10, "m": _MB, "g": 1 << 30})


def parse_bytes(text: str | int) -> int:
    """``"80GB"`` (10^9), ``"80GiB"`` / ``"80G"`` (2^30), ``"512MiB"``, or a plain number of bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise UserError(f"cannot read {text!r} as a memory size; write e.g. 80GB, 80GiB, 512MiB or a number of bytes")
    return int(float(match.group(1)) * _UNITS[unit])


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", _MB), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


@dataclass
class StrategyEstimate:
    strategy: str
    options: dict[str, Any]
    memory: MemoryBreakdown
    step_s: float
    fits: bool

    @property
    def label(self) -> str:
        ckpt = " ckpt" if self.options.get("activation_checkpointing") else ""  # checkpointed blocks
        if self.strategy == "fsdp":
            mode = "reshard" if self.options.get("reshard_after_forward", True) else "keep"
            group = f" x{self.options['blocks_per_unit']}" if self.options.get("blocks_per_unit", 1) > 1 else ""
            return f"fsdp {mode}{group}{ckpt}"
        if self.strategy == "pipeline":
            o = self.options
            if o.get("virtual_stages", 1) > 1:  # interleaved: S ranks x V stages each
                return f"pipeline {o['stages']}x{o['virtual_stages']} il m{o['microbatches']}"
            return f"pipeline {o['stages']}x{o['schedule']} m{o['microbatches']}"
        return self.strategy + ckpt


@dataclass
class Plan:
    """What :func:`plan` found. ``choice``: the fastest strategy that fits (None when none does; ``advice`` then
    says what would, ``suggestions`` the same as ``{"devices": n, "batch_size": b, "param_dtype": "bf16"}``);
    ``choice_options``: its options (``{"reshard_after_forward": ...}`` for fsdp, with ``"blocks_per_unit"`` where
    the plan groups consecutive blocks into one unit,
    ``{"stages", "schedule", "microbatches", "split"}`` for pipeline (``split``: the layer indices where
    stages 1.. begin), ``{}`` otherwise)."""

    model: str
    devices: int
    device_memory: int
    usable_memory: int
    batch_size: int
    seq_len: int | None
    param_dtype: str
    optimizer: str
    estimates: list[StrategyEstimate]
    choice: str | None
    choice_options: dict[str, Any]
    advice: str
    measurement: str
    comm: str
    suggestions: dict[str, Any] = field(default_factory=dict)  # when nothing fits: one change that would, each
    notes: list[str] = field(default_factory=list)
    # the measurements it stands on (a ProbeResult): ``plan(probe_result=...)`` prices another backend on them
    probe: Any = field(default=None, repr=False, compare=False)

    def best(self, strategy: str) -> StrategyEstimate | None:
        """The fastest fitting estimate of ``strategy`` (else its smallest)."""
        rows = [e for e in self.estimates if e.strategy == strategy]
        if not rows:
            return None
        fitting = [e for e in rows if e.fits]
        return min(fitting, key=lambda e: e.step_s) if fitting else min(rows, key=lambda e: e.memory.total)

    def table(self) -> str:
        head = (
            f"{'strategy':<22}{'params':>12}{'grads':>12}{'optim':>12}{'activations':>13}{'buffers':>12}"
            f"{'total':>12}  {'fits':<5}{'step ms':>9}"
        )
        lines = [
            f"model: {self.model}",
            f"{self.devices} devices x {fmt_bytes(self.device_memory)} (usable {fmt_bytes(self.usable_memory)}), "
            f"batch {self.batch_size}/device"
            + (f", seq {self.seq_len}" if self.seq_len else "")
            + f", {self.param_dtype}, {self.optimizer}",
            head,
            "-" * len(head),
        ]
        for e in self.estimates:
            m = e.memory
            lines.append(
                f"{e.label:<22}{fmt_bytes(m.parameters):>12}{fmt_bytes(m.gradients):>12}"
                f"{fmt_bytes(m.optimizer_state):>12}{fmt_bytes(m.activations):>13}{fmt_bytes(m.buffers):>12}"
                f"{fmt_bytes(m.total):>12}  {'yes' if e.fits else 'NO':<5}{e.step_s * 1e3:>9.1f}"
            )
        lines.append("-" * len(head))
        if self.choice:
            lines.append(f"pick: {self.choice} {self.choice_options or ''}".rstrip())
        else:
            lines.append(f"nothing fits: {self.advice}")
        lines.append(f"activations and compute: {self.measurement}; communication: {self.comm}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("probe")  # measurements, not the plan
        for row, e in zip(data["estimates"], self.estimates, strict=True):
            row["label"] = e.label
            row["memory"]["total"] = e.memory.total
            row["memory"]["model_state"] = e.memory.model_state
        return data
