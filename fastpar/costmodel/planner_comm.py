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
from .collective_costs import Fabric, Link, collective_seconds
from .fabrics import PRESETS, preset
from .perf_profile import Profile
from .step_simulator import SyncCosts

__all__ = ["comm_model"]

DEFAULT_GPU_FABRIC = "h100-nvswitch-ib400"
# CPU ranks on one host when no profile is at hand: gloo's ring as fitted to this project's calibrated profile
# (2 ranks, 2-core VM); calibrate yours for better numbers
CPU_LOOPBACK = Fabric(
    name="cpu ranks on one host (assumed; calibrate with 'fastpar bench calibrate')",
    gpus_per_node=1 << 30,
    intra=Link(1.48, 233.0),  # alpha-beta fit of its all-reduce: 1.48 GB/s bus bandwidth, 0.23 ms per step
    tree=False,
    sources=("fit to bench/results/profile-cpu-2rank-mlp.json (gloo, 2 ranks, 2-core VM)",),
)


# CPU ranks' backend -> the profile measured on it on this project's machine (in a checkout's bench/results)
SHIPPED_PROFILES = {"gloo": "profile-cpu-2rank-mlp.json", "fastpar": "profile-cpu-2rank-mlp-fastpar.json"}
CPU_BACKENDS = tuple(SHIPPED_PROFILES)


def _shipped_profile(backend: str) -> Path | None:
    results = Path(__file__).resolve().parents[2] / "bench" / "results"
    for name in (SHIPPED_PROFILES[backend], SHIPPED_PROFILES["gloo"]):  # gloo's: the costlier wire, if no other
        if (results / name).exists():
            return results / name
    return None


def comm_model(*, profile: Any = None, fabric: Any = None, on_gpu: bool = False, backend: str | None = None):
    """``(comm, SyncCosts, description)``. Default: on CPU ranks the profile measured on this project's
    machine with ``backend`` ("gloo", the default, or "fastpar": its shared-memory collectives cost a fraction
    of gloo's loopback TCP) from a checkout's ``bench/results`` (without one :data:`CPU_LOOPBACK`); on GPUs the
    ``h100-nvswitch-ib400`` preset."""
    backend = backend or "gloo"
    if backend not in SHIPPED_PROFILES:
        raise UserError(f"CPU ranks' backend must be one of {', '.join(CPU_BACKENDS)}, got {backend!r}")
    if profile is None and fabric is None:
        shipped = None if on_gpu else _shipped_profile(backend)
        if shipped is not None:
            profile = shipped
        else:
            fabric = DEFAULT_GPU_FABRIC if on_gpu else None
        if profile is None and fabric is None:  # an installed package without the checkout's bench/results
            fabric = CPU_LOOPBACK
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
            fsdp_unit_s=profile.overheads.get("fsdp_unit_s", 0.0),
            fsdp_regather_s=profile.overheads.get("fsdp_regather_s", 0.0),
            pipeline_slot_s=profile.overheads.get("pipeline_slot_s", 0.0),
            pipeline_message_bytes=profile.overheads.get("pipeline_message_bytes", 0.0),
            zero_bucket_s=profile.overheads.get("zero_bucket_s", 0.0),
            zero_bucket_bytes=profile.overheads.get("zero_bucket_bytes", 0.0),
            fsdp_unit_bytes=profile.overheads.get("fsdp_unit_bytes", 0.0),
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
