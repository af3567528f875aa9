"""select_devices on real-format topologies, plus a brute-force cross-check of the pruned search."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from fastpar.topology import GPU, Link, Topology, link_gbps, parse_nvidia_smi, select_devices
from fastpar.topology.select import NVLINK_GBPS, PCIE_GBPS, _Scorer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "topo"


def load(name: str) -> Topology:
    return parse_nvidia_smi((FIXTURES / name).read_text())


def test_nvlink_pairs_machine_picks_a_bridged_pair():
    t = load("traverse_v100_nvlink_pairs_mlx5.txt")
    assert select_devices(2, t) == [0, 1]
    sel = select_devices(2, t, explain=True)
    assert sel.slowest_link.startswith("GPU0-GPU1 NV3") and sel.numa_nodes == [0]
    assert sel.runner_up == [2, 3] and "lower GPU indices" in sel.why_not_runner_up
    # With GPU0 busy the only remaining bridged pair is 2,3 — never the unbridged 1,2 / 1,3.
    t.gpu(0).processes = 2
    assert select_devices(2, t) == [2, 3]


def test_two_socket_box_keeps_four_gpus_on_one_socket():
    t = load("rtx4090_8x_nic_no_legend.txt")  # every pair is SYS: only NUMA locality separates sets
    sel = select_devices(4, t, explain=True)
    assert sel.devices == [0, 1, 2, 3] and sel.numa_nodes == [0]
    # Make socket 0 busy: the choice moves to socket 1 as a whole instead of mixing sockets.
    for i in (0, 1):
        t.gpu(i).memory_used_mib = 20000
    assert select_devices(4, t) == [4, 5, 6, 7]


def test_pcie_quads_prefer_pix_pairs_and_one_switch_complex():
    t = load("pcie_pix_pairs_pxb_quads.txt")
    assert select_devices(2, t) == [0, 1]
    sel = select_devices(4, t, explain=True)
    assert sel.devices == [0, 1, 2, 3] and sel.slowest_gbps == PCIE_GBPS["PXB"]
    t.gpu(1).processes = 1
    sel = select_devices(4, t, explain=True)
    assert sel.devices == [4, 5, 6, 7] and " SYS (4 GB/s) vs " in sel.why_not_runner_up  # not 0,2,3 + one across


def test_nvswitch_any_k_works_and_is_deterministic():
    t = load("hgx_h100_nvswitch_nic_legend.txt")
    for k in range(1, 9):
        first = select_devices(k, t)
        assert len(first) == k and first == select_devices(k, t) == list(range(k))
    sel = select_devices(3, t, explain=True)
    assert sel.slowest_gbps == 18 * 25.0 and sel.numa_nodes == [0]
    assert "mlx5_0 (PIX)" in sel.nic


def test_nic_locality_breaks_ties():
    t = load("polaris_a100_nv4_mlx5.txt")  # all NV4, one GPU per NUMA node; NICs PHB to GPU3 and GPU1
    sel = select_devices(2, t, explain=True)
    assert sel.devices == [1, 3] and "RDMA NIC only via SYS" in sel.why_not_runner_up


def test_dgx1_cube_mesh_quad_is_fully_nvlinked():
    t = load("dgx1_p100_old_legend_soc.txt")
    sel = select_devices(4, t, explain=True)
    assert all(t.link(a, b).nvlinks for a, b in itertools.combinations(sel.devices, 2))


def test_errors_name_the_count_and_the_busy_gpus():
    t = load("traverse_v100_nvlink_pairs_mlx5.txt")
    t.gpu(1).processes = 3
    t.gpu(2).memory_used_mib = 5000
    with pytest.raises(ValueError, match=r"k must be at least 1"):
        select_devices(0, t)
    with pytest.raises(ValueError, match=r"only 2 of 4 are available .*GPU1: 3 processes; GPU2: 5000 MiB used"):
        select_devices(3, t)
    assert select_devices(3, t, exclude_busy=False) == [0, 1, 2]
    assert select_devices(3, t, exclude_busy=False, busy_memory_mib=10**6) == [0, 1, 2]
    with pytest.raises(ValueError, match="has none"):
        select_devices(1, Topology(gpu_status="no NVIDIA GPU/driver found: test"))


def test_link_model_ranks_nvlink_above_every_pcie_class():
    assert link_gbps(Link(0, 1, nvlinks=1, nvlink_version=1)) == NVLINK_GBPS[1] > max(PCIE_GBPS.values())
    assert link_gbps(Link(0, 1, nvlinks=18)) == 18 * 25.0
    values = [link_gbps(Link(0, 1, pcie=c)) for c in ("PIX", "PXB", "PHB", "NODE", "SYS")]
    assert values == sorted(values, reverse=True) and len(set(values)) == 5


def _random_topology(n: int, seed: int) -> Topology:
    rng = random.Random(seed)
    gpus = [GPU(index=i, numa_affinity=[rng.randint(0, 1)]) for i in range(n)]
    links = []
    for a, b in itertools.combinations(range(n), 2):
        if rng.random() < 0.3:
            links.append(Link(a, b, nvlinks=rng.randint(1, 4)))
        else:
            links.append(Link(a, b, pcie=rng.choice(["PIX", "PXB", "PHB", "NODE", "SYS"])))
    return Topology(gpus=gpus, links=links)


@pytest.mark.parametrize("seed", range(6))
def test_pruned_search_matches_brute_force(seed):
    t = _random_topology(8, seed)
    scorer = _Scorer(t, list(range(8)))
    for k in (2, 3, 4, 5):
        best = None
        for combo in itertools.combinations(range(8), k):  # lexicographic: first maximum wins ties
            pairs = [scorer.pair(a, b) for a, b in itertools.combinations(combo, 2)]
            score = scorer.score(combo, min(pairs), sum(pairs))
            if best is None or score > best[0]:
                best = (score, list(combo))
        assert select_devices(k, t) == best[1]


def test_sixteen_choose_eight_is_exhaustive_and_quick():
    t = Topology(
        gpus=[GPU(index=i) for i in range(16)],
        links=[Link(a, b, nvlinks=6) for a, b in itertools.combinations(range(16), 2)],
    )
    sel = select_devices(8, t, explain=True)
    assert sel.devices == list(range(8)) and sel.sets_scored == 12870  # all tie: nothing can be pruned


def test_unknown_numa_node_is_placed_by_cpu_affinity():
    # GPU0's NUMA Affinity is N/A but its CPUs are the other socket's: {0,1} spans two sockets, {1,2} one.
    text = (
        "\tGPU0\tGPU1\tGPU2\tCPU Affinity\tNUMA Affinity\n"
        "GPU0\t X \tSYS\tSYS\t8-15\tN/A\n"
        "GPU1\tSYS\t X \tSYS\t0-7\t0\n"
        "GPU2\tSYS\tSYS\t X \t0-7\t0\n"
    )
    t = parse_nvidia_smi(text)
    assert select_devices(2, t) == [1, 2]
    # Same CPUs as a known node: counts as that node, so the lowest indices win the tie.
    assert select_devices(2, parse_nvidia_smi(text.replace("8-15", "0-7"))) == [0, 1]
    explained = select_devices(2, parse_nvidia_smi(text.replace("0-7\t0\n", "0-7\tN/A\n", 1)), explain=True)
    assert explained.numa_unknown == [1] and "unknown for GPU1" in str(explained)
