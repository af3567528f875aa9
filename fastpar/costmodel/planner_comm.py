"""What the planner prices collectives with: a calibrated profile (``fastpar bench calibrate``) or a fabric.

``comm(op, nbytes, ranks)`` in seconds for ``allreduce``, ``reducescatter``, ``allgather`` and ``p2p``
(one message of ``nbytes`` between two ranks, priced as a two-rank all-gather of twice the bytes: each rank
then sends exactly ``nbytes``). A profile's contention factors (CPU ranks: compute and gloo's threads share
cores), its copy bandwidth (``pack_s_per_byte``: a torch ``copy_``, what FSDP2's buffers cost) and fastpar
DDP's averaging pass (``unpack_s_per_byte``) come with it; a fabric has none (GPUs: copies in HBM are left out).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..user_errors import UserError
from .collective_costs import Fabric, collective_seconds
from .fabrics import PRESETS, preset
from .perf_profile import Profile
from .step_simulator import SyncCosts

__all__ = ["comm_model"]

DEFAULT_GPU_FABRIC = "h100-nvswitch-ib400"


def _shipped_profile() -> Path | None:
    path = Path(__file__).resolve().parents[2] / "bench" / "results" / "profile-cpu-2rank-mlp.json"
    return path if path.exists() else None


def comm_model(*, profile: Any = None, fabric: Any = None, on_gpu: bool = False):
    """``(comm, SyncCosts, description)``. Default: on CPU ranks the profile measured on this project's
    machine (a checkout's ``bench/results``), on GPUs the ``h100-nvswitch-ib400`` preset."""
    if profile is None and fabric is None:
        shipped = None if on_gpu else _shipped_profile()
        if shipped is not None:
            profile = shipped
        else:
            fabric = DEFAULT_GPU_FABRIC if on_gpu else None
        if profile is None and fabric is None:
            raise UserError(
                "no profile to price CPU collectives with; run 'fastpar bench calibrate' and pass --profile"
            )
    if profile is not None:
        if not isinstance(profile, Profile):
            try:
                profile = Profile.load(profile)
            except (OSError, ValueError) as exc:
                raise UserError(f"cannot use profile {profile}: {exc}") from None
        tables = {op: {} for op in ("allreduce", "reducescatter", "allgather")}

        def comm(op: str, nbytes: float, ranks: int) -> float:
            if ranks <= 1 or nbytes <= 0:
                return 0.0
            if op == "p2p":
                op, nbytes, ranks = "allgather", 2 * nbytes, 2
            fn = tables[op].get(ranks) or tables[op].setdefault(ranks, profile.comm(ranks, op))
            return float(fn(nbytes))

        copy_gbs = profile.moves_gbs.get("torch_pack")  # a torch copy_ of gradient bytes, as measured
        average_gbs = profile.moves_gbs.get("fastpar_unpack")  # fastpar DDP's averaging pass over its buckets
        costs = SyncCosts(
            pack_s_per_byte=1.0 / (copy_gbs * 1e9) if copy_gbs else 0.0,
            unpack_s_per_byte=1.0 / (average_gbs * 1e9) if average_gbs else 0.0,
            compute_slowdown=profile.contention.get("compute_slowdown", 0.0),
            wire_slowdown=profile.contention.get("wire_slowdown", 0.0),
        )
        return comm, costs, f"profile {profile.backend} x{profile.world_size} ({profile.meta.get('created', '?')[:10]})"
    if isinstance(fabric, str):
        if fabric not in PRESETS:
            raise UserError(f"unknown fabric {fabric!r}; one of {', '.join(PRESETS)}")
        fabric = preset(fabric)
    if not isinstance(fabric, Fabric):
        raise UserError(f"fabric must be a preset name or a Fabric, got {type(fabric).__name__}")

    def fabric_comm(op: str, nbytes: float, ranks: int) -> float:
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        if op == "p2p":
            op, nbytes, ranks = "allgather", 2 * nbytes, 2
        return float(collective_seconds(op, nbytes, ranks, fabric))

    return fabric_comm, SyncCosts(), f"fabric {fabric.name}"
