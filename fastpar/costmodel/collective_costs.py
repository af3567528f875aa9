"""What one collective costs on a fabric: latency (alpha) + bytes / bandwidth (beta), ring and tree.

Formulas (``n`` bytes, ``p`` ranks, ``nodes`` = ceil(p / gpus_per_node); ``n`` is the larger buffer,
as nccl-tests counts it: the whole all-reduce buffer, the whole input of a reduce-scatter, the whole
output of an all-gather):

  ring all-reduce      T = base + (2(p-1) - 2(nodes-1)) a_intra + 2(nodes-1) a_inter + 2(p-1)/p * n / B
  ring reduce-scatter  T = base + ((p-1) - (nodes-1)) a_intra + (nodes-1) a_inter + (p-1)/p * n / B
  ring all-gather      same as reduce-scatter
  tree all-reduce      T = base + 2((g-1) a_intra + log2(nodes) a_inter) + 2 n / (0.9 B)   (g = GPUs per node)

- The ring terms are the bandwidth-optimal ring of Patarasuk & Yuan (2009) and Thakur, Rabenseifner &
  Gropp, "Optimization of Collective Communication Operations in MPICH" (IJHPCA 2005, sec. 4): 2(p-1)
  steps of n/p bytes each; reduce-scatter and all-gather are each half of it.
- B is the *bus bandwidth* of nccl-tests (doc/PERFORMANCE.md: busbw = algbw * 2(p-1)/p for all-reduce,
  (p-1)/p for reduce-scatter/all-gather), so a measured busbw plugs in directly. Across nodes a ring's
  bus bandwidth is bounded by the slowest link class it crosses: B = min(B_intra, B_inter), where
  B_inter is a node's total NIC bandwidth (each ring leaves every node once; rings are spread over the
  NICs, so per node 2(p-1)/p * n bytes leave through all NICs together).
- The latency split into intra- and inter-node steps, the tree's 2((g-1) a_intra + log2(nodes) a_inter)
  latency, its algorithm bandwidth B/2 with busbw discounted by 0.9, and taking the faster algorithm
  per message follow NCCL's own tuning model (src/graph/tuning.cc, ``ncclTopoTuneModel`` and
  ``ncclTopoGetAlgoTime``, Simple protocol). The tree is NCCL's double binary tree, the two-tree scheme
  of Sanders, Speck & Traeff, "Two-tree algorithms for full bandwidth broadcast, reduction and scan"
  (Parallel Computing 2009): full bandwidth at log2(nodes) latency.

Every function takes ``nbytes`` as a number or a numpy array (the bucket optimiser prices many
candidate buckets at once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

OPS = ("allreduce", "reducescatter", "allgather")
TREE_BUS_EFFICIENCY = 0.9  # NCCL tuning.cc: busBw = min(busBw * .9, maxTreeBw) for the tree


@dataclass(frozen=True)
class Link:
    """One class of link: the bus bandwidth a collective sustains over it and the latency of one step."""

    bus_gbs: float  # GB/s (10^9 bytes/s), nccl-tests' busbw
    latency_us: float  # per ring step / tree hop

    def __post_init__(self) -> None:
        if not self.bus_gbs > 0:
            raise ValueError(f"link bandwidth must be positive GB/s, got {self.bus_gbs}")
        if self.latency_us < 0:
            raise ValueError(f"link latency must be >= 0 us, got {self.latency_us}")


@dataclass(frozen=True)
class Fabric:
    """GPUs (or ranks) in nodes of ``gpus_per_node``, ``intra`` links inside a node, ``inter`` between nodes."""

    name: str
    gpus_per_node: int
    intra: Link
    inter: Link | None = None  # None: one node only; more ranks than gpus_per_node is then an error
    base_latency_us: float = 0.0  # fixed cost per collective call (NCCL baseLat, ring/Simple: 8.4 us)
    tree: bool = True  # may all-reduce use the tree (NCCL: yes; gloo: ring only)
    sources: tuple[str, ...] = field(default=(), compare=False)  # where the numbers come from, in words

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be at least 1, got {self.gpus_per_node}")

    def nodes(self, ranks: int) -> int:
        if ranks < 1:
            raise ValueError(f"need at least one rank, got {ranks}")
        nodes = math.ceil(ranks / self.gpus_per_node)
        if nodes > 1 and self.inter is None:
            raise ValueError(
                f"fabric {self.name!r} is one node of {self.gpus_per_node} GPUs; {ranks} ranks need an "
                "inter-node network (give its bandwidth, e.g. --inter-gbps 400)"
            )
        return nodes

    def bus_gbs(self, ranks: int) -> float:
        """The ring's bus bandwidth at ``ranks``: the slowest link class it crosses."""
        if self.nodes(ranks) == 1:
            return self.intra.bus_gbs
        return min(self.intra.bus_gbs, self.inter.bus_gbs)  # type: ignore[union-attr]


def _steps(op: str, ranks: int, nodes: int) -> tuple[int, int]:
    """(ring steps in all, of which cross a node boundary) -- NCCL's nsteps and nInterSteps."""
    if op == "allreduce":
        return 2 * (ranks - 1), 2 * (nodes - 1)
    if op in ("reducescatter", "allgather"):
        return ranks - 1, nodes - 1
    raise ValueError(f"unknown collective {op!r}; one of {', '.join(OPS)}")


def _bytes_factor(op: str, ranks: int) -> float:
    """The share of ``n`` each rank sends in a ring: 2(p-1)/p for all-reduce, (p-1)/p otherwise."""
    return (2.0 if op == "allreduce" else 1.0) * (ranks - 1) / ranks


def ring_seconds(op: str, nbytes, ranks: int, fabric: Fabric):
    """Seconds of a ring ``op`` of ``nbytes`` over ``ranks`` ranks (0 for one rank: nothing moves)."""
    nbytes = np.asarray(nbytes, dtype=np.float64)
    nodes = fabric.nodes(ranks)
    steps, inter_steps = _steps(op, ranks, nodes)
    if ranks == 1:
        return np.zeros_like(nbytes) if nbytes.ndim else 0.0
    inter_lat = fabric.inter.latency_us if fabric.inter is not None else 0.0
    latency_us = fabric.base_latency_us + (steps - inter_steps) * fabric.intra.latency_us + inter_steps * inter_lat
    seconds = latency_us * 1e-6 + _bytes_factor(op, ranks) * nbytes / (fabric.bus_gbs(ranks) * 1e9)
    return seconds if seconds.ndim else float(seconds)


def tree_seconds(nbytes, ranks: int, fabric: Fabric):
    """Seconds of a (double binary) tree all-reduce of ``nbytes``: chain inside a node, tree across nodes."""
    nbytes = np.asarray(nbytes, dtype=np.float64)
    nodes = fabric.nodes(ranks)
    if ranks == 1:
        return np.zeros_like(nbytes) if nbytes.ndim else 0.0
    per_node = min(ranks, fabric.gpus_per_node)
    inter_lat = fabric.inter.latency_us if fabric.inter is not None else 0.0
    latency_us = fabric.base_latency_us + 2 * ((per_node - 1) * fabric.intra.latency_us + math.log2(nodes) * inter_lat)
    seconds = latency_us * 1e-6 + 2.0 * nbytes / (TREE_BUS_EFFICIENCY * fabric.bus_gbs(ranks) * 1e9)
    return seconds if seconds.ndim else float(seconds)


def collective_seconds(op: str, nbytes, ranks: int, fabric: Fabric):
    """Seconds of ``op``, taking for all-reduce the faster of ring and tree per message (as NCCL's tuner does)."""
    ring = ring_seconds(op, nbytes, ranks, fabric)
    if op != "allreduce" or not fabric.tree or ranks <= 2:
        return ring
    tree = tree_seconds(nbytes, ranks, fabric)
    return np.minimum(ring, tree) if np.ndim(ring) else min(ring, tree)


def algorithm_for(nbytes: float, ranks: int, fabric: Fabric) -> str:
    """ "ring" or "tree": which all-reduce :func:`collective_seconds` prices ``nbytes`` with."""
    if not fabric.tree or ranks <= 2:
        return "ring"
    return "tree" if tree_seconds(nbytes, ranks, fabric) < ring_seconds("allreduce", nbytes, ranks, fabric) else "ring"


def fit_alpha_beta(op: str, nbytes, seconds, ranks: int) -> tuple[float, float]:
    """Least-squares ``(alpha seconds per ring step, beta seconds per byte of bus traffic)`` of measured
    times against the ring formula at ``ranks``, weighted by 1/time so small and large messages count alike.
    Both are clamped at >= 0 (a noisy fit must not predict negative costs)."""
    x = np.asarray(nbytes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if x.shape != t.shape or x.size < 2:
        raise ValueError("fit_alpha_beta needs at least two (bytes, seconds) pairs of the same length")
    steps, _ = _steps(op, ranks, 1)
    if ranks < 2:
        raise ValueError("alpha/beta need at least two ranks (one rank moves nothing)")
    design = np.stack([np.full_like(x, steps), _bytes_factor(op, ranks) * x], axis=1) / t[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if beta <= 0:  # latency-bound sweep: keep the slope of the two largest sizes
        order = np.argsort(x)
        dx = (x[order[-1]] - x[order[-2]]) * _bytes_factor(op, ranks)
        beta = max((t[order[-1]] - t[order[-2]]) / dx, 1e-15) if dx > 0 else 1e-15
        alpha = max(float(np.min(t - beta * _bytes_factor(op, ranks) * x)) / steps, 0.0)
    return max(float(alpha), 0.0), float(beta)
