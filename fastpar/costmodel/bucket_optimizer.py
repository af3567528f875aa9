"""Bucket boundaries chosen from a measured arrival timeline: the layout with the least predicted exposed
communication (``bucket_cap_mb="auto"``).

The optimiser splits the gradients, in arrival order, into contiguous buckets. For the model of
``step_simulator`` without contention, dynamic programming over the arrival order is exact:

  launch(j)  = ready_j + pack * S_j                       (S_j: gradient bytes of the first j arrivals)
  F(j)       = min over i < j of  max(launch(j), F(i)) + comm(bytes i+1..j)     (wire free after bucket i+1..j)
  sync end   = max(backward end + unpack * S_m,  max over buckets k of F_k + unpack * (S_m - S_start(k)))

A smaller F(i) never makes a later bucket finish later (max and + are monotone), so keeping the
smallest F per prefix is optimal for the wire; the unpack terms are handled by bisection on the sync
end T: "is there a split with every bucket's F_k + unpack * (S_m - S_start(k)) <= T?" is again a
smallest-F dynamic programme over prefixes, with the infeasible candidates removed.
:func:`plan_buckets` then compares that split with torch-style fixed caps under the full simulator
(contention included) and keeps the fastest, so "auto" is never predicted slower than a fixed cap.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np
import torch
import torch.distributed as dist

from .step_simulator import GradArrival, StepPrediction, StepTimeline, SyncCosts, simulate_step

MB = 1024 * 1024
TORCH_FIRST_BUCKET_BYTES = MB  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
CANDIDATE_CAPS_MB = (1, 2, 4, 8, 16, 25, 50, 100)

__all__ = [
    "BucketPlan",
    "broadcast_decision",
    "choose_buckets",
    "decide_buckets",
    "optimal_buckets",
    "plan_buckets",
    "size_capped_buckets",
    "torch_layout",
]


def size_capped_buckets(
    grads: Sequence[GradArrival], caps_bytes: Sequence[int], *, fit: bool = False
) -> list[list[int]]:
    """torch DDP's assignment (``dist._compute_bucket_assignment_by_size`` with tensor indices): take the
    gradients in the given order, one open bucket per dtype; a bucket closes once it holds
    ``caps_bytes[k]`` bytes or more (k = buckets of that dtype closed so far, the last cap repeating).
    ``fit=True`` is Horovod's Tensor Fusion instead: a gradient that would take its bucket past the cap
    starts the next bucket, so only a gradient larger than the cap makes a bucket larger than it."""
    if not caps_bytes or min(caps_bytes) <= 0:
        raise ValueError(f"bucket caps must be positive bytes, got {list(caps_bytes)}")
    closed: list[list[int]] = []
    open_buckets: dict[str, tuple[list[int], int, int]] = {}
    for g in grads:
        members, size, n_closed = open_buckets.get(g.dtype, ([], 0, 0))
        if fit and members and size + g.nbytes > caps_bytes[min(n_closed, len(caps_bytes) - 1)]:
            closed.append(members)
            members, size, n_closed = [], 0, n_closed + 1
        members.append(g.index)
        size += g.nbytes
        if size >= caps_bytes[min(n_closed, len(caps_bytes) - 1)]:
            closed.append(members)
            open_buckets[g.dtype] = ([], 0, n_closed + 1)
        else:
            open_buckets[g.dtype] = (members, size, n_closed)
    return closed + [members for members, _, _ in open_buckets.values() if members]


def torch_layout(timeline: StepTimeline, bucket_cap_mb: float, first_bucket_bytes: int = TORCH_FIRST_BUCKET_BYTES):
    """The buckets torch DDP uses after its first step (rebuilt in arrival order: a ``first_bucket_bytes``
    first bucket, then ``bucket_cap_mb``)."""
    cap = int(bucket_cap_mb * MB)
    caps = [min(first_bucket_bytes, cap), cap]
    try:  # torch's own function, on shape-only (meta) tensors: its order of the leftover buckets included
        tensors = [
            torch.empty(g.nbytes // _itemsize(g.dtype), dtype=getattr(torch, g.dtype), device="meta")
            for g in timeline.grads
        ]
        order = [g.index for g in timeline.grads]
        buckets, _ = dist._compute_bucket_assignment_by_size(tensors, caps, [False] * len(tensors), order)
        return [list(b) for b in buckets]
    except (AttributeError, RuntimeError, TypeError):  # no torch.distributed or an unknown dtype name
        return size_capped_buckets(timeline.grads, caps)


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def optimal_buckets(
    timeline: StepTimeline, comm: Callable, costs: SyncCosts | None = None, *, rel_tol: float = 1e-7
) -> list[list[int]]:
    """The split of the arrival order with the earliest predicted sync end (contention-free model).
    ``comm`` must accept a numpy array of byte counts. Gradients of different dtypes go to separate buckets:
    each dtype's arrivals are split on their own, and the buckets are ordered by their last arrival."""
    costs = costs or SyncCosts()
    groups: dict[str, list[GradArrival]] = {}
    for g in timeline.grads:
        groups.setdefault(g.dtype, []).append(g)
    segments: list[list[GradArrival]] = []
    for grads in groups.values():
        bounds = _optimal_bounds(grads, timeline.backward_s, comm, costs, rel_tol)
        segments += [grads[i:j] for i, j in pairwise(bounds)]
    position = {g.index: pos for pos, g in enumerate(timeline.grads)}
    segments.sort(key=lambda seg: position[seg[-1].index])
    return [[g.index for g in seg] for seg in segments]


def _optimal_bounds(grads: list[GradArrival], backward_s: float, comm: Callable, costs: SyncCosts, rel_tol: float):
    """Bucket boundaries [0, ..., m] (positions in ``grads``) of the optimal contiguous split."""
    m = len(grads)
    sizes = np.array([g.nbytes for g in grads], dtype=np.float64)
    total = np.concatenate([[0.0], np.cumsum(sizes)])  # total[j] = bytes of the first j arrivals
    launch = np.array([g.ready_s for g in grads]) + costs.pack_s_per_byte * total[1:]
    backward_end = backward_s + costs.pack_s_per_byte * total[m]
    tail = costs.unpack_s_per_byte * (total[m] - total[:m])  # unpack from a bucket starting at i to the end
    floor = backward_end + costs.unpack_s_per_byte * total[m]
    cached: dict[int, np.ndarray] = {}

    def wire(j: int) -> np.ndarray:
        """Seconds on the wire of every bucket i+1..j (i < j); kept for up to ~3000 gradients (m^2/2 floats)."""
        if j not in cached:
            seconds = np.asarray(comm(costs.comm_bytes_per_byte * (total[j] - total[:j])), dtype=np.float64)
            if m > 3000:
                return seconds
            cached[j] = seconds
        return cached[j]

    def smallest_finish(limit: float) -> tuple[float, np.ndarray]:
        best, parent = np.full(m + 1, np.inf), np.full(m + 1, -1)
        best[0] = 0.0
        for j in range(1, m + 1):
            finish = np.maximum(launch[j - 1], best[:j]) + wire(j)
            finish = np.where(finish + tail[:j] <= limit, finish, np.inf)
            i = int(np.argmin(finish))
            if np.isfinite(finish[i]):
                best[j], parent[j] = finish[i], i
        return float(best[m]), parent

    def bounds_of(parent: np.ndarray) -> list[int]:
        out, j = [m], m
        while j > 0:
            j = int(parent[j])
            out.append(j)
        return out[::-1]

    def sync_end(bounds: list[int]) -> float:
        free, end = 0.0, floor
        for i, j in pairwise(bounds):
            free = max(launch[j - 1], free) + float(wire(j)[i])
            end = max(end, free + tail[i])
        return end

    wire_end, parent = smallest_finish(np.inf)
    bounds = bounds_of(parent)
    high = sync_end(bounds)
    # no split ends sooner than backward plus all unpacking, or than the earliest wire end plus the last unpack
    low = max(floor, wire_end + costs.unpack_s_per_byte * sizes[-1])
    for _ in range(80):  # bisection on the achievable sync end
        if high - low <= rel_tol * max(high, 1e-12):
            break
        mid = 0.5 * (low + high)
        finish, parent = smallest_finish(mid)
        if not np.isfinite(finish):
            low = mid
        else:
            bounds = bounds_of(parent)
            high = sync_end(bounds)
    return bounds


@dataclass
class BucketPlan:
    buckets: list[list[int]]  # parameter indices, in launch order
    prediction: StepPrediction
    chosen: str  # "optimal split" or "cap 25 MB" (the candidate that won)
    candidates: dict[str, float] = field(default_factory=dict)  # candidate -> predicted step seconds
    layouts: dict[str, list[list[int]]] = field(default_factory=dict)  # candidate -> its buckets


def plan_buckets(
    timeline: StepTimeline,
    comm: Callable,
    costs: SyncCosts | None = None,
    caps_mb: Sequence[float] = CANDIDATE_CAPS_MB,
    extra: dict[str, list[list[int]]] | None = None,
) -> BucketPlan:
    """The optimal split, torch-style layouts at ``caps_mb`` and the ``extra`` layouts (name -> buckets), each
    simulated in full; the fastest wins (the first listed on a tie)."""
    costs = costs or SyncCosts()
    layouts = dict(extra or {})
    layouts.setdefault("optimal split", optimal_buckets(timeline, comm, costs))
    for cap in caps_mb:
        layouts.setdefault(f"cap {cap:g} MB", torch_layout(timeline, cap))
    predicted = {name: simulate_step(timeline, buckets, comm, costs) for name, buckets in layouts.items()}
    chosen = min(predicted, key=lambda name: predicted[name].step_s)
    return BucketPlan(
        buckets=layouts[chosen],
        prediction=predicted[chosen],
        chosen=chosen,
        candidates={name: p.step_s for name, p in predicted.items()},
        layouts=layouts,
    )


def choose_buckets(
    grads: Sequence[GradArrival],
    profile,
    *,
    world_size: int | None = None,
    backward_s: float | None = None,
    reducer: str = "torch",
    comm_bytes_per_byte: float = 1.0,
) -> BucketPlan:
    """The reducer's entry point: ``grads`` = (index, bytes, dtype, ready seconds since backward start) in
    arrival order, ``profile`` a :class:`~fastpar.costmodel.perf_profile.Profile` -> the bucket plan for
    ``world_size`` ranks (default: the profile's). ``backward_s`` defaults to the last arrival."""
    if not grads:
        raise ValueError("choose_buckets needs at least one gradient")
    grads = sorted(grads, key=lambda g: g.ready_s)
    timeline = StepTimeline(list(grads), backward_s if backward_s is not None else grads[-1].ready_s)
    costs = profile.sync_costs(reducer, comm_bytes_per_byte=comm_bytes_per_byte)
    return plan_buckets(timeline, profile.comm(world_size), costs)


def decide_buckets(grads: Sequence[GradArrival], profile, group=None, *, src: int = 0, **options) -> list[list[int]]:
    """:func:`choose_buckets` on rank ``src`` of ``group`` from the slowest rank's ready time of each
    parameter, broadcast so that every rank gets the same buckets. Call it on every rank of the group."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    device = group_device(group)
    counts = torch.tensor([len(grads), -len(grads)], dtype=torch.int64, device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=group)
    if int(counts[0]) != -int(counts[1]):
        raise ValueError(
            f"rank {rank} has {len(grads)} gradients but other ranks have between {-int(counts[1])} and "
            f"{int(counts[0])}: every rank must time the same parameters before buckets can be decided"
        )
    by_index = sorted(grads, key=lambda g: g.index)
    ready = torch.tensor([g.ready_s for g in by_index], dtype=torch.float64, device=device)
    dist.all_reduce(ready, op=dist.ReduceOp.MAX, group=group)  # a bucket waits for the slowest rank
    slowest = [GradArrival(g.index, g.nbytes, g.dtype, t) for g, t in zip(by_index, ready.tolist(), strict=True)]
    decision = choose_buckets(slowest, profile, world_size=world, **options).buckets if rank == src else None
    return broadcast_decision(decision, group, src)


def group_device(group=None) -> torch.device:
    """The device a collective on ``group`` needs its tensors on: this rank's GPU for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_decision(value, group=None, src: int = 0):
    """``value`` from rank ``src`` of ``group`` (any picklable object; ignored elsewhere) on every rank."""
    box = [value]
    global_src = src if group is None else dist.get_global_rank(group, src)
    dist.broadcast_object_list(box, src=global_src, group=group, device=group_device(group))
    return box[0]
