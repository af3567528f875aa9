"""A calibrated performance profile: what ``fastpar bench calibrate`` measured, as one JSON file.

Schema ``fastpar.profile/1``::

    {"schema": "fastpar.profile/1", "backend": "gloo", "device": "cpu", "world_size": 2, "threads": 1,
     "collectives": {"allreduce": {"nbytes": [...], "seconds": [...]}, "reducescatter": ..., "allgather": ...},
     "moves_gbs": {"torch_pack": GB/s, "torch_unpack": ..., "fastpar_pack": ..., "fastpar_unpack": ...},
     "contention": {"compute_slowdown": k_c, "wire_slowdown": k_w},
     "overheads": {"fsdp_unit_s": s, "fsdp_regather_s": s, "fsdp_unit_bytes": B,
                   "pipeline_slot_s": s, "pipeline_message_bytes": B, "zero_bucket_s": s, "zero_bucket_bytes": B},
     "timeline": {"forward_s", "backward_s", "optimizer_s", "grads": [{"index", "nbytes", "dtype", "ready_s"}]},
     "model": {...}, "measured": [{"variant", "bucket_cap_mb", "world_size", "step_s", "source"}], "meta": {...}}

Collective times are the slowest rank's medians; ``moves_gbs`` are gradient bytes moved per second by
each way of getting gradients into and out of buckets; ``timeline`` is the slowest rank's compute;
``overheads["fsdp_unit_s"]``: what one FSDP2 unit of ``fsdp_unit_bytes`` (a few KB) kept gathered after forward
adds to a step beyond DDP's: its hooks, copies and both collectives' latency under load; ``fsdp_regather_s``:
what resharding it after forward adds on top (its second gather); ``pipeline_slot_s``: what one slot of a 1F1B
pipeline (a microbatch through a stage, with its two messages of ``pipeline_message_bytes``) adds beyond its
compute; ``zero_bucket_s``: what one ZeRO-1 bucket of ``zero_bucket_bytes`` adds to DDP's step (its two
exchanges). Absent in profiles written before them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .collective_costs import Fabric, Link, collective_seconds, fit_alpha_beta
from .step_simulator import GradArrival, StepTimeline, SyncCosts

SCHEMA = "fastpar.profile/1"
# reducer -> (moves_gbs key packing on arrival or None, key unpacking after the collective or None)
REDUCERS: dict[str, tuple[str | None, str | None]] = {
    "torch": ("torch_pack", "torch_unpack"),  # torch DDP: grad copied (and scaled) into the bucket, copied back
    "torch_views": ("torch_pack", None),  # gradient_as_bucket_view=True: scaled in place, nothing copied back
    "fastpar_packed": ("fastpar_pack", "fastpar_unpack"),  # fastpar.ops.pack / unpack, one call per bucket
    "fastpar_views": (None, "fastpar_unpack"),  # gradients are bucket views; one averaging pass after
}


@dataclass
class CollectiveTable:
    """Measured seconds of one collective per message size (bytes as nccl-tests counts them)."""

    nbytes: list[int]
    seconds: list[float]

    def __post_init__(self) -> None:
        if len(self.nbytes) != len(self.seconds) or not self.nbytes:
            raise ValueError("a collective table needs one time per size, at least one size")
        order = np.argsort(self.nbytes)
        self.nbytes = [int(self.nbytes[i]) for i in order]
        self.seconds = [float(self.seconds[i]) for i in order]

    def seconds_at(self, nbytes):
        """Piecewise-linear in bytes through the measured points; the smallest time below them (latency),
        the last measured slope beyond them."""
        x, t = np.asarray(self.nbytes, dtype=np.float64), np.asarray(self.seconds, dtype=np.float64)
        n = np.asarray(nbytes, dtype=np.float64)
        inside = np.interp(n, x, t)
        if len(x) >= 2:
            slope = (t[-1] - t[-2]) / (x[-1] - x[-2])
            slope = slope if slope > 0 else t[-1] / x[-1]  # noise made the last step flat: time per byte so far
            inside = np.where(n > x[-1], t[-1] + (n - x[-1]) * slope, inside)
        return inside if inside.ndim else float(inside)


@dataclass
class Profile:
    backend: str
    device: str
    world_size: int
    collectives: dict[str, CollectiveTable]
    moves_gbs: dict[str, float] = field(default_factory=dict)
    contention: dict[str, float] = field(default_factory=lambda: {"compute_slowdown": 0.0, "wire_slowdown": 0.0})
    timeline: StepTimeline | None = None
    overheads: dict[str, float] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    measured: list[dict[str, Any]] = field(default_factory=list)
    threads: int = 1
    meta: dict[str, Any] = field(default_factory=dict)

    # -- costs the simulator and the bucket optimiser use -------------------------------------------------

    def fit(self, op: str = "allreduce") -> tuple[float, float]:
        """``(alpha, beta)`` of the ring formula fitted to the measured ``op`` (see collective_costs)."""
        table = self.collectives[op]
        return fit_alpha_beta(op, table.nbytes, table.seconds, self.world_size)

    def fitted_fabric(self, op: str = "allreduce") -> Fabric:
        """The measured network as a flat ring fabric (one 'node' of any size, ring only)."""
        alpha, beta = self.fit(op)
        return Fabric(
            name=f"{self.backend} as measured ({self.world_size} ranks, alpha-beta fit)",
            gpus_per_node=1 << 30,
            intra=Link(1.0 / beta / 1e9, alpha * 1e6),
            tree=False,
            sources=(f"fit to fastpar bench calibrate on {self.world_size} {self.backend} ranks",),
        )

    def comm(self, world_size: int | None = None, op: str = "allreduce") -> Callable:
        """``comm(nbytes) -> seconds`` of ``op`` at ``world_size``: the measured table at the profile's own
        world size, else the ring formula with the fitted alpha/beta."""
        if op not in self.collectives:
            raise ValueError(f"the profile has no {op} measurements; it has {', '.join(self.collectives)}")
        if world_size is None or world_size == self.world_size:
            return self.collectives[op].seconds_at
        if world_size == 1:
            return lambda nbytes: np.zeros_like(np.asarray(nbytes, dtype=np.float64)) if np.ndim(nbytes) else 0.0
        fabric = self.fitted_fabric(op)
        return lambda nbytes: collective_seconds(op, nbytes, world_size, fabric)

    def sync_costs(
        self, reducer: str = "torch", *, comm_bytes_per_byte: float = 1.0, contention: bool = True
    ) -> SyncCosts:
        """Per-byte pack/unpack costs of ``reducer`` (one of :data:`REDUCERS`) and this profile's contention."""
        if reducer not in REDUCERS:
            raise ValueError(f"unknown reducer {reducer!r}; choose one of {', '.join(REDUCERS)}")
        pack_key, unpack_key = REDUCERS[reducer]
        per_byte = {}
        for key in filter(None, (pack_key, unpack_key)):
            gbs = self.moves_gbs.get(key)
            if not gbs:
                raise ValueError(f"the profile has no {key!r} bandwidth (needed for reducer {reducer!r})")
            per_byte[key] = 1.0 / (gbs * 1e9)
        return SyncCosts(
            pack_s_per_byte=per_byte.get(pack_key, 0.0) if pack_key else 0.0,
            unpack_s_per_byte=per_byte.get(unpack_key, 0.0) if unpack_key else 0.0,
            comm_bytes_per_byte=comm_bytes_per_byte,
            compute_slowdown=self.contention.get("compute_slowdown", 0.0) if contention else 0.0,
            wire_slowdown=self.contention.get("wire_slowdown", 0.0) if contention else 0.0,
        )

    # -- JSON ------------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        data = {
            "schema": SCHEMA,
            "backend": self.backend,
            "device": self.device,
            "world_size": self.world_size,
            "threads": self.threads,
            "collectives": {op: asdict(t) for op, t in self.collectives.items()},
            "moves_gbs": dict(self.moves_gbs),
            "contention": dict(self.contention),
            "overheads": dict(self.overheads),
            "timeline": None,
            "model": dict(self.model),
            "measured": list(self.measured),
            "meta": dict(self.meta),
        }
        if self.timeline is not None:
            data["timeline"] = {
                "forward_s": self.timeline.forward_s,
                "backward_s": self.timeline.backward_s,
                "optimizer_s": self.timeline.optimizer_s,
                "grads": [asdict(g) for g in self.timeline.grads],
            }
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Profile:
        if data.get("schema") != SCHEMA:
            raise ValueError(
                f"not a fastpar profile (schema {data.get('schema')!r}, expected {SCHEMA!r}); "
                "write one with 'fastpar bench calibrate --profile FILE'"
            )
        timeline = None
        if data.get("timeline"):
            t = data["timeline"]
            grads = [
                GradArrival(int(g["index"]), int(g["nbytes"]), str(g["dtype"]), float(g["ready_s"])) for g in t["grads"]
            ]
            timeline = StepTimeline(grads, float(t["backward_s"]), float(t["forward_s"]), float(t["optimizer_s"]))
        return cls(
            backend=data["backend"],
            device=data["device"],
            world_size=int(data["world_size"]),
            collectives={op: CollectiveTable(**t) for op, t in data["collectives"].items()},
            moves_gbs={k: float(v) for k, v in data.get("moves_gbs", {}).items()},
            contention={k: float(v) for k, v in data.get("contention", {}).items()},
            overheads={k: float(v) for k, v in data.get("overheads", {}).items()},
            timeline=timeline,
            model=dict(data.get("model", {})),
            measured=list(data.get("measured", [])),
            threads=int(data.get("threads", 1)),
            meta=dict(data.get("meta", {})),
        )

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1, allow_nan=False) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON ({exc}); expected a profile from 'fastpar bench calibrate'") from None
        return cls.from_json(data)
