"""Fabrics to simulate on: named presets, a ``fastpar topo --json`` / saved ``nvidia-smi topo -m``, or numbers.

A fabric's bus bandwidths are link peaks times :data:`LINK_EFFICIENCY` (an assumption, stated here
once: nccl-tests rarely shows more than ~80% of a link's peak as busbw). Measure yours with
``fastpar bench allreduce`` and pass the busbw it prints (``--intra-gbs``, ``--inter-gbps``) to replace it.
Per-step latencies are NCCL's own model constants for the Simple protocol (src/graph/tuning.cc, v2.7:
``hwLat`` ring NVLink 3.4 us, PCI 5.7 us, NET 9.6 us; ``baseLat`` ring 8.4 us).
"""

from __future__ import annotations

import json
from pathlib import Path

from .collective_costs import Fabric, Link

LINK_EFFICIENCY = 0.8  # share of a link's peak that a collective's busbw reaches (assumed, see above)
LATENCY_US = {"nvlink": 3.4, "pcie": 5.7, "net": 9.6}  # NCCL tuning.cc hwLat, ring / Simple
NCCL_BASE_LATENCY_US = 8.4  # NCCL tuning.cc baseLat, ring / Simple


def _fabric(
    name: str, gpus: int, intra_peak_gbs: float, intra: str, inter_peak_gbs: float | None, sources: tuple[str, ...]
) -> Fabric:
    inter = None
    if inter_peak_gbs is not None:
        inter = Link(inter_peak_gbs * LINK_EFFICIENCY, LATENCY_US["net"])
    return Fabric(
        name=name,
        gpus_per_node=gpus,
        intra=Link(intra_peak_gbs * LINK_EFFICIENCY, LATENCY_US[intra]),
        inter=inter,
        base_latency_us=NCCL_BASE_LATENCY_US,
        sources=sources + (f"bus bandwidth = peak x {LINK_EFFICIENCY} (assumed)",),
    )


# name -> (description, fabric). Peaks are per GPU per direction (NVLink) and per node (NICs, summed).
PRESETS: dict[str, tuple[str, Fabric]] = {
    "h100-nvswitch-ib400": (
        "8x H100 SXM per node on NVSwitch (NVLink 4, 450 GB/s per GPU per direction), 8x 400 Gb/s InfiniBand per node",
        _fabric(
            "h100-nvswitch-ib400",
            8,
            450.0,
            "nvlink",
            8 * 50.0,
            (
                "NVIDIA H100 datasheet: NVLink 900 GB/s bidirectional per GPU",
                "DGX H100: 8x ConnectX-7 400 Gb/s compute NICs per node",
            ),
        ),
    ),
    "a100-nvswitch-ib200": (
        "8x A100 SXM per node on NVSwitch (NVLink 3, 300 GB/s per GPU per direction), 8x 200 Gb/s HDR InfiniBand",
        _fabric(
            "a100-nvswitch-ib200",
            8,
            300.0,
            "nvlink",
            8 * 25.0,
            (
                "NVIDIA A100 datasheet: NVLink 600 GB/s bidirectional per GPU",
                "DGX A100: 8x ConnectX-6 200 Gb/s compute NICs per node",
            ),
        ),
    ),
    "v100-nvlink-ib100": (
        "8x V100 SXM2 per node (DGX-1V, NVLink 2 hybrid cube-mesh, 150 GB/s per GPU per direction), 4x 100 Gb/s EDR",
        _fabric(
            "v100-nvlink-ib100",
            8,
            150.0,
            "nvlink",
            4 * 12.5,
            (
                "NVIDIA V100 datasheet: 6 NVLink 2 links x 25 GB/s per direction",
                "DGX-1V: 4x 100 Gb/s EDR InfiniBand per node",
            ),
        ),
    ),
    "p100-pcie-25gbe": (
        "4x Pascal GPUs per server on PCIe 3.0 x16 (15.75 GB/s), 25 Gb/s RoCE between servers (Horovod's benchmark)",
        _fabric(
            "p100-pcie-25gbe",
            4,
            15.75,
            "pcie",
            25 / 8,
            (
                "PCIe 3.0 x16: 15.75 GB/s per direction",
                "Horovod docs/benchmarks.rst: 128 servers x 4 Pascal GPUs, RoCE-capable 25 Gbit/s network",
            ),
        ),
    ),
}


def preset(name: str) -> Fabric:
    try:
        return PRESETS[name][1]
    except KeyError:
        raise ValueError(f"unknown fabric preset {name!r}; choose one of {', '.join(PRESETS)}") from None


def fabric_from_topology(topology, *, inter_gbps: float | None = None, name: str = "") -> Fabric:
    """A node like ``topology`` (a :class:`fastpar.topology.Topology`), many of them joined by its RDMA NICs.

    Inside the node a ring runs at its slowest GPU pair (``fastpar.topology.select.link_gbps``: NVLink
    count x per-link speed of its generation, else a PCIe class value): right for NVSwitch machines, low for
    partial NVLink meshes (DGX-1), whose rings NCCL routes over NVLink only -- pass ``--intra-gbs`` there.
    Between nodes: ``inter_gbps`` (Gb/s per node) or else the sum of the node's RDMA NIC speeds, when known."""
    from ..topology.select import PCIE_GBPS, link_gbps

    if not topology.gpus:
        raise ValueError(
            f"the topology ({topology.source or 'given'}) lists no GPUs; use a preset or give --gpus-per-node "
            "and --intra-gbs"
        )
    links = [ln for ln in topology.links if ln.a != ln.b]
    nvlink = bool(links) and all(ln.nvlinks for ln in links)
    intra_peak = min((link_gbps(ln) for ln in links), default=PCIE_GBPS["PIX"])  # one GPU: nothing crosses it
    if inter_gbps is None:
        speeds = [n.speed_mbps for n in topology.rdma_nics if n.speed_mbps and n.state.upper() != "DOWN"]
        inter_gbps = sum(speeds) / 1000 if speeds else None
    inter = Link(inter_gbps / 8 * LINK_EFFICIENCY, LATENCY_US["net"]) if inter_gbps else None
    return Fabric(
        name=name or f"{len(topology.gpus)} GPUs like {topology.source or 'the given topology'}",
        gpus_per_node=len(topology.gpus),
        intra=Link(intra_peak * LINK_EFFICIENCY, LATENCY_US["nvlink" if nvlink else "pcie"]),
        inter=inter,
        base_latency_us=NCCL_BASE_LATENCY_US,
        sources=(
            f"slowest GPU pair: {intra_peak:g} GB/s peak ({'NVLink' if nvlink else 'PCIe'})",
            f"network: {f'{inter_gbps:g} Gb/s per node' if inter_gbps else 'unknown (one node only)'}",
            f"bus bandwidth = peak x {LINK_EFFICIENCY} (assumed)",
        ),
    )


def load_topology(path: str):
    """A :class:`~fastpar.topology.Topology` from ``fastpar topo --json`` output or saved ``nvidia-smi topo -m``."""
    from ..topology.model import Topology
    from ..topology.nvidia_smi import parse_topo_matrix

    text = Path(path).read_text(encoding="utf-8-sig")
    if text.lstrip().startswith("{"):
        data = json.loads(text)
        data.pop("selection", None)  # `fastpar topo --select K --json` adds it
        return Topology.from_json(json.dumps(data))
    return parse_topo_matrix(text, source=f"nvidia-smi topo -m: {path}")


def with_overrides(
    fabric: Fabric, *, intra_gbs: float | None = None, inter_gbps: float | None = None, gpus_per_node: int | None = None
) -> Fabric:
    """``fabric`` with given numbers in place of modelled ones: ``intra_gbs`` is a measured intra-node busbw
    (``fastpar bench allreduce`` on one node), used as it is; ``inter_gbps`` a node's network speed in Gb/s
    (all its NICs), a peak like the presets', so it gets :data:`LINK_EFFICIENCY` too."""
    from dataclasses import replace

    notes = list(fabric.sources)
    if intra_gbs is not None:
        fabric = replace(fabric, intra=Link(intra_gbs, fabric.intra.latency_us))
        notes.append(f"intra-node busbw {intra_gbs:g} GB/s given")
    if inter_gbps is not None:
        latency = fabric.inter.latency_us if fabric.inter else LATENCY_US["net"]
        fabric = replace(fabric, inter=Link(inter_gbps / 8 * LINK_EFFICIENCY, latency))
        notes.append(f"network {inter_gbps:g} Gb/s per node given")
    if gpus_per_node is not None:
        fabric = replace(fabric, gpus_per_node=gpus_per_node)
    return replace(fabric, sources=tuple(notes))
