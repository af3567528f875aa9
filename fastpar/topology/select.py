"""Pick the k GPUs with the best collective bandwidth, and say why.

Each pair's link gets a modelled bandwidth (NVLink count x per-link speed of its generation, else a PCIe
class value). A ring all-reduce runs at the speed of its slowest hop, so sets are ranked by:
1. the slowest link inside the set (higher is better),
2. how many NUMA nodes the set spans (fewer is better: host staging and CPU threads stay local),
3. NIC locality: the worst GPU's nearest RDMA NIC (PIX > PXB > PHB > NODE > SYS),
4. the total modelled bandwidth of all pairs,
5. lowest GPU indices (deterministic).
Search is exhaustive with pruning on the slowest link, fast for 16 choose 8 (12,870 sets).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .model import GPU, Link, Topology

# GB/s per link per direction: NVLink 1 (P100) 20, 2 (V100) and 3 (A100) and 4 (H100) 25, 5 (B200) 50.
NVLINK_GBPS = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 50.0}
NVLINK_GBPS_UNKNOWN = 25.0  # nvidia-smi does not print the generation
# Effective peer-to-peer GB/s by PCIe path (a relative model: what matters is PIX > PXB > PHB > NODE > SYS,
# and that any NVLink beats any PCIe path).
PCIE_GBPS = {"PIX": 12.0, "PXB": 10.0, "PHB": 8.0, "NODE": 6.0, "SYS": 4.0}
_NIC_RANK = {"PIX": 4, "PXB": 3, "PHB": 2, "NODE": 1, "SYS": 0}
DEFAULT_BUSY_MEMORY_MIB = 1024


def link_gbps(link: Link) -> float:
    if link.nvlinks:
        return link.nvlinks * NVLINK_GBPS.get(link.nvlink_version or 0, NVLINK_GBPS_UNKNOWN)
    return PCIE_GBPS.get(link.pcie, PCIE_GBPS["SYS"])


def busy_reason(gpu: GPU, busy_memory_mib: int = DEFAULT_BUSY_MEMORY_MIB) -> str:
    """Why a GPU counts as busy ("" when it is free)."""
    reasons = []
    if gpu.processes:
        reasons.append(f"{gpu.processes} process{'es' if gpu.processes > 1 else ''}")
    if gpu.memory_used_mib is not None and gpu.memory_used_mib > busy_memory_mib:
        reasons.append(f"{gpu.memory_used_mib} MiB used")
    return ", ".join(reasons)


@dataclass
class Selection:
    """The chosen set and the reasons for it; ``str()`` prints it for people."""

    devices: list[int]
    slowest_link: str  # "GPU0-GPU1 NV12 (300 GB/s)" or "none (one GPU)"
    slowest_gbps: float | None
    numa_nodes: list[int]
    nic: str
    total_gbps: float
    runner_up: list[int] | None
    why_not_runner_up: str
    busy: dict[int, str] = field(default_factory=dict)
    sets_scored: int = 0
    numa_unknown: list[int] = field(default_factory=list)  # selected GPUs whose NUMA node nvidia-smi did not know

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        gpus = ",".join(map(str, self.devices))
        numa = ",".join(map(str, self.numa_nodes)) if self.numa_nodes else "unknown"
        if self.numa_nodes and self.numa_unknown:
            numa += f" (unknown for GPU{',GPU'.join(map(str, self.numa_unknown))})"
        lines = [
            f"selected GPUs {gpus}",
            f"  slowest link: {self.slowest_link}",
            f"  NUMA node(s): {numa}",
            f"  nearest NIC:  {self.nic}",
            f"  total modelled pair bandwidth: {self.total_gbps:g} GB/s ({self.sets_scored} sets scored)",
        ]
        if self.runner_up is not None:
            lines.append(f"  next best {','.join(map(str, self.runner_up))} lost: {self.why_not_runner_up}")
        else:
            lines.append(f"  no other set: {self.why_not_runner_up}")
        if self.busy:
            lines.append("  skipped busy: " + "; ".join(f"GPU{i} ({why})" for i, why in sorted(self.busy.items())))
        return "\n".join(lines)


class _Scorer:
    def __init__(self, topology: Topology, candidates: list[int]):
        self.topology = topology
        self.bw = {(ln.a, ln.b): link_gbps(ln) for ln in topology.links}
        self.numa = {g.index: g.numa_node for g in topology.gpus}
        self.place = _places(topology)
        rdma = topology.rdma_nics
        self.nic_rank = {
            g: max((_NIC_RANK.get(n.gpu_paths.get(g, "SYS"), 0) for n in rdma), default=0) for g in candidates
        }

    def pair(self, a: int, b: int) -> float:
        return self.bw.get((min(a, b), max(a, b)), PCIE_GBPS["SYS"])

    def score(self, devices: tuple[int, ...], slowest: float, total: float) -> tuple:
        numa_count = len({self.place[d] for d in devices if self.place[d] is not None})
        nic = min(self.nic_rank[d] for d in devices)
        return (slowest, -numa_count, nic, total)


def _places(topology: Topology) -> dict[int, object]:
    """Where each GPU sits, for counting NUMA nodes: its NUMA node; when nvidia-smi printed N/A, the node of a
    GPU with the same CPU affinity, else the CPU affinity itself (GPUs with different CPU sets are on different
    sockets, so an unknown node must not count as 'the same node'). None when nothing is known."""
    by_cpus = {tuple(g.cpu_affinity): g.numa_node for g in topology.gpus if g.numa_node is not None}
    places: dict[int, object] = {}
    for g in topology.gpus:
        cpus = tuple(g.cpu_affinity)
        if g.numa_node is not None:
            places[g.index] = g.numa_node
        elif cpus in by_cpus:
            places[g.index] = by_cpus[cpus]
        else:
            places[g.index] = ("cpus", cpus) if cpus else None
    return places


def _search(scorer: _Scorer, candidates: list[int], k: int) -> tuple[list[tuple], int]:
    """Best and runner-up (score, devices) by DFS in lexicographic order; prune on the slowest link."""
    top: list[tuple] = []  # at most 2 entries, best first
    scored = 0

    def consider(devices: tuple[int, ...], slowest: float, total: float) -> None:
        nonlocal scored
        scored += 1
        entry = (scorer.score(devices, slowest, total), devices)
        # Strictly better only: among equal scores the earlier (lower-index) set stays ahead.
        if not top or entry[0] > top[0][0]:
            top.insert(0, entry)
        elif len(top) < 2 or entry[0] > top[1][0]:
            top.insert(1, entry)
        del top[2:]

    def dfs(start: int, chosen: tuple[int, ...], slowest: float, total: float) -> None:
        if len(top) == 2 and slowest < top[1][0][0]:
            return  # cannot reach the runner-up's slowest link any more
        if len(chosen) == k:
            consider(chosen, slowest, total)
            return
        for i in range(start, len(candidates) - (k - len(chosen)) + 1):
            gpu = candidates[i]
            links = [scorer.pair(gpu, c) for c in chosen]
            dfs(i + 1, chosen + (gpu,), min([slowest, *links]), total + sum(links))

    dfs(0, (), float("inf"), 0.0)
    return top, scored


def _why(best: tuple, other: tuple, topology: Topology, scorer: _Scorer) -> str:
    (b_slow, b_numa, b_nic, b_total), (o_slow, o_numa, o_nic, o_total) = best[0], other[0]
    if b_slow != o_slow:
        return (
            f"its slowest link is {_slowest(other[1], scorer, topology)[0]} vs {_slowest(best[1], scorer, topology)[0]}"
        )
    if b_numa != o_numa:
        return f"it spans {-o_numa} NUMA nodes vs {-b_numa}"
    if b_nic != o_nic:
        names = {v: k for k, v in _NIC_RANK.items()}
        return f"its farthest GPU reaches an RDMA NIC only via {names[o_nic]} vs {names[b_nic]}"
    if b_total != o_total:
        return f"less total pair bandwidth ({o_total:g} vs {b_total:g} GB/s)"
    return "tie on every criterion; the lower GPU indices win"


def _slowest(devices: tuple[int, ...], scorer: _Scorer, topology: Topology) -> tuple[str, float | None]:
    pairs = [(scorer.pair(a, b), a, b) for i, a in enumerate(devices) for b in devices[i + 1 :]]
    if not pairs:
        return "none (one GPU)", None
    gbps, a, b = min(pairs)
    return f"GPU{a}-GPU{b} {topology.link(a, b).label} ({gbps:g} GB/s)", gbps


def select_devices(
    k: int,
    topology: Topology | None = None,
    *,
    exclude_busy: bool = True,
    explain: bool = False,
    busy_memory_mib: int = DEFAULT_BUSY_MEMORY_MIB,
    among: list[int] | None = None,
) -> list[int] | Selection:
    """The k GPUs (nvidia-smi / PCI-order indices) with the best modelled collective bandwidth.

    With ``explain=True`` returns a Selection (``.devices``, reasons, ``str()`` for people).
    Busy GPUs (processes running, or more than ``busy_memory_mib`` used) are skipped unless
    ``exclude_busy=False``; ``among`` limits the choice to those indices (e.g. the GPUs CUDA_VISIBLE_DEVICES
    allows: ``cuda_order.select_cuda_devices`` does that and returns CUDA ordinals, which these are not).
    Raises ValueError when k < 1 or more GPUs are asked for than are free.
    """
    if topology is None:
        from .discover import discover

        topology = discover()
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    allowed = [g for g in topology.gpus if among is None or g.index in among]
    busy = {g.index: why for g in allowed if (why := busy_reason(g, busy_memory_mib))}
    candidates = sorted(g.index for g in allowed if not (exclude_busy and g.index in busy))
    if k > len(candidates):
        total = len(allowed)
        if total == 0:
            raise ValueError(f"asked for {k} GPU(s) but this topology has none ({topology.gpu_status or 'no GPUs'})")
        detail = "; ".join(f"GPU{i}: {why}" for i, why in sorted(busy.items())) if exclude_busy and busy else ""
        raise ValueError(
            f"asked for {k} GPUs but only {len(candidates)} of {total} are available"
            + (f" (busy: {detail}; pass exclude_busy=False / --include-busy to use them anyway)" if detail else "")
        )
    scorer = _Scorer(topology, candidates)
    top, scored = _search(scorer, candidates, k)
    best = top[0]
    devices = list(best[1])
    if not explain:
        return devices
    slowest_text, slowest_gbps = _slowest(best[1], scorer, topology)
    return Selection(
        devices=devices,
        slowest_link=slowest_text,
        slowest_gbps=slowest_gbps,
        numa_nodes=sorted({scorer.numa[d] for d in devices if scorer.numa[d] is not None}),
        nic=_nearest_nic_text(topology, devices),
        total_gbps=best[0][3],
        runner_up=list(top[1][1]) if len(top) > 1 else None,
        why_not_runner_up=_why(best, top[1], topology, scorer) if len(top) > 1 else "it is the only possible set",
        busy=busy if exclude_busy else {},
        sets_scored=scored,
        numa_unknown=[d for d in devices if scorer.numa[d] is None],
    )


def _nearest_nic_text(topology: Topology, devices: list[int]) -> str:
    rdma = topology.rdma_nics
    if not rdma:
        return "no RDMA NIC known"
    parts = []
    for gpu in devices:
        nic = max(rdma, key=lambda n: (_NIC_RANK.get(n.gpu_paths.get(gpu, "SYS"), 0), -rdma.index(n)))
        parts.append(f"GPU{gpu}->{nic.name} ({nic.gpu_paths.get(gpu, 'unknown')})")
    return ", ".join(parts)
