"""The collective cost formulas and fabrics, against hand-computed numbers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fastpar.costmodel.collective_costs import (
    Fabric,
    Link,
    algorithm_for,
    collective_seconds,
    fit_alpha_beta,
    ring_seconds,
    tree_seconds,
)
from fastpar.costmodel.fabrics import (
    LINK_EFFICIENCY,
    PRESETS,
    fabric_from_topology,
    load_topology,
    preset,
    with_overrides,
)

# 8 GPUs per node: 100 GB/s, 2 us per step inside; 25 GB/s, 10 us per step between nodes; 5 us per call
FABRIC = Fabric("test", 8, Link(100.0, 2.0), Link(25.0, 10.0), base_latency_us=5.0)
MB = 1e6


def test_ring_allreduce_inside_one_node():
    # 8 ranks: 2*7 = 14 steps of 2 us + 5 us, and 2*7/8 of 1 MB at 100 GB/s = 17.5 us
    assert ring_seconds("allreduce", MB, 8, FABRIC) == pytest.approx((5 + 14 * 2 + 17.5) * 1e-6)


def test_ring_allreduce_across_nodes_uses_the_slower_link():
    # 16 ranks on 2 nodes: 30 steps, 2 of them between nodes; 2*15/16 MB at min(100, 25) GB/s = 75 us
    assert ring_seconds("allreduce", MB, 16, FABRIC) == pytest.approx((5 + 28 * 2 + 2 * 10 + 75) * 1e-6)


def test_ring_reduce_scatter_and_all_gather_are_half_an_all_reduce():
    # 16 ranks: 15 steps, 1 between nodes; 15/16 MB at 25 GB/s = 37.5 us
    expected = (5 + 14 * 2 + 10 + 37.5) * 1e-6
    assert ring_seconds("reducescatter", MB, 16, FABRIC) == pytest.approx(expected)
    assert ring_seconds("allgather", MB, 16, FABRIC) == pytest.approx(expected)


def test_tree_allreduce_and_the_faster_algorithm_wins():
    # chain of 8 inside each node, log2(2 nodes) = 1 tree hop: 5 + 2*(7*2 + 1*10) = 53 us; 2 MB / (0.9 * 25 GB/s)
    tree = (53 + 2 * MB / (0.9 * 25e9) * 1e6) * 1e-6
    assert tree_seconds(MB, 16, FABRIC) == pytest.approx(tree)
    ring = ring_seconds("allreduce", MB, 16, FABRIC)
    assert tree < ring
    assert collective_seconds("allreduce", MB, 16, FABRIC) == pytest.approx(tree)
    assert algorithm_for(MB, 16, FABRIC) == "tree"
    # a small message on one node: the ring's 14 short steps beat the tree's 2*7 steps + its bandwidth discount
    assert algorithm_for(1000, 8, FABRIC) == "ring"
    # reduce-scatter has no tree
    assert collective_seconds("reducescatter", MB, 16, FABRIC) == ring_seconds("reducescatter", MB, 16, FABRIC)


def test_one_rank_moves_nothing_and_arrays_match_scalars():
    assert collective_seconds("allreduce", MB, 1, FABRIC) == 0.0
    sizes = np.array([1e3, 1e5, 1e7])
    vector = collective_seconds("allreduce", sizes, 64, FABRIC)
    assert np.allclose(vector, [collective_seconds("allreduce", s, 64, FABRIC) for s in sizes])


def test_more_ranks_than_one_node_needs_a_network():
    single = Fabric("one box", 8, Link(100.0, 2.0))
    with pytest.raises(ValueError, match="inter-node network"):
        ring_seconds("allreduce", MB, 9, single)
    with pytest.raises(ValueError, match="unknown collective"):
        ring_seconds("broadcast", MB, 8, FABRIC)


def test_fit_recovers_alpha_and_beta():
    alpha, beta = 30e-6, 1 / 2e9  # 30 us per step, 2 GB/s
    sizes = np.array([4e3, 64e3, 1e6, 16e6])
    seconds = 2 * 2 * alpha + 2 * 2 / 3 * sizes * beta  # 3 ranks: 4 steps, 4/3 of the bytes
    got_alpha, got_beta = fit_alpha_beta("allreduce", sizes, seconds, 3)
    assert got_alpha == pytest.approx(alpha, rel=1e-6)
    assert got_beta == pytest.approx(beta, rel=1e-6)


NVSWITCH_SMI = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV18\tNV18\tNV18\tPXB\tSYS\t0-55\t0
GPU1\tNV18\t X \tNV18\tNV18\tPXB\tSYS\t0-55\t0
GPU2\tNV18\tNV18\t X \tNV18\tSYS\tPXB\t56-111\t1
GPU3\tNV18\tNV18\tNV18\t X \tSYS\tPXB\t56-111\t1

Legend:
  X    = Self
  NV#  = Connection traversing a bonded set of # NVLinks

NIC Legend:
  NIC0: mlx5_0
  NIC1: mlx5_1
"""


def test_fabric_from_saved_nvidia_smi_and_from_topo_json(tmp_path):
    smi = tmp_path / "topo.txt"
    smi.write_text(NVSWITCH_SMI)
    topology = load_topology(str(smi))
    fabric = fabric_from_topology(topology, inter_gbps=800)
    assert fabric.gpus_per_node == 4
    assert fabric.intra.bus_gbs == pytest.approx(18 * 25 * LINK_EFFICIENCY)  # NV18 x 25 GB/s
    assert fabric.inter.bus_gbs == pytest.approx(800 / 8 * LINK_EFFICIENCY)
    assert fabric_from_topology(topology).inter is None  # nvidia-smi does not print NIC speeds

    for nic in topology.nics:
        nic.speed_mbps, nic.state = 400_000, "ACTIVE"
    data = json.loads(topology.to_json())
    data["selection"] = {"devices": [0, 1]}  # what `fastpar topo --select 2 --json` adds
    path = tmp_path / "topo.json"
    path.write_text(json.dumps(data))
    from_json = fabric_from_topology(load_topology(str(path)))
    assert from_json.inter.bus_gbs == pytest.approx(2 * 400 / 8 * LINK_EFFICIENCY)  # two 400 Gb/s NICs


def test_presets_and_overrides():
    for name, (description, fabric) in PRESETS.items():
        assert description and fabric.name == name and fabric.inter is not None
        assert ring_seconds("allreduce", 25 * MB, 1024, fabric) > ring_seconds("allreduce", 25 * MB, 8, fabric) > 0
    h100 = preset("h100-nvswitch-ib400")
    assert h100.intra.bus_gbs == pytest.approx(450 * LINK_EFFICIENCY)
    assert h100.inter.bus_gbs == pytest.approx(400 * LINK_EFFICIENCY)
    measured = with_overrides(h100, intra_gbs=380.0, inter_gbps=1600.0, gpus_per_node=4)
    assert measured.intra.bus_gbs == 380.0 and measured.gpus_per_node == 4
    assert measured.inter.bus_gbs == pytest.approx(200 * LINK_EFFICIENCY)
    with pytest.raises(ValueError, match="unknown fabric preset"):
        preset("dgx-9000")
