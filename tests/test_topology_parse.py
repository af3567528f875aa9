"""Parsing real `nvidia-smi topo -m` outputs (tests/fixtures/topo, sources in its README)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastpar.topology import Topology
from fastpar.topology.model import format_cpu_list, parse_cpu_list

FIXTURES = Path(__file__).parent / "fixtures" / "topo"


def load(name: str) -> Topology:
    return Topology.from_nvidia_smi((FIXTURES / name).read_text(), source=name)


ALL = sorted(p.name for p in FIXTURES.glob("*.txt"))


def test_every_fixture_is_listed_in_readme():
    readme = (FIXTURES / "README.md").read_text()
    assert ALL and all(f"`{name}`" in readme for name in ALL)


def test_hgx_h100_nvswitch_with_nic_legend():
    t = load("hgx_h100_nvswitch_nic_legend.txt")
    assert [g.index for g in t.gpus] == list(range(8))
    assert len(t.links) == 28 and {ln.label for ln in t.links} == {"NV18"}
    assert [n.name for n in t.nics] == [f"mlx5_{i}" for i in range(8)]  # renamed from NIC0..7 by the legend
    assert t.nics[0].gpu_paths == {0: "PIX", 1: "NODE", 2: "NODE", 3: "NODE", 4: "SYS", 5: "SYS", 6: "SYS", 7: "SYS"}
    assert t.gpu(0).cpu_affinity == list(range(0, 48)) + list(range(96, 144))
    assert [g.numa_node for g in t.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(g.gpu_numa_id is None for g in t.gpus)  # "N/A"
    assert [n.numa_node for n in t.nics] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [n.id for n in t.numa_nodes] == [0, 1] and t.numa_nodes[1].cpus[0] == 48


def test_pcie_pix_pairs_pxb_quads():
    t = load("pcie_pix_pairs_pxb_quads.txt")
    assert len(t.gpus) == 8 and not t.nics
    assert t.link(0, 1).label == "PIX" and t.link(6, 7).label == "PXB" and t.link(4, 5).label == "PIX"
    assert t.link(1, 2).label == "PXB" and t.link(3, 4).label == "SYS"
    assert all(g.numa_affinity == [] for g in t.gpus)  # NUMA Affinity "N/A"
    assert t.gpu(7).cpu_affinity == list(range(96))


def test_nvlink_pairs_with_mlx5_columns():
    t = load("traverse_v100_nvlink_pairs_mlx5.txt")
    assert len(t.gpus) == 4
    assert t.link(0, 1).nvlinks == 3 and t.link(2, 3).label == "NV3"
    assert t.link(0, 2).label == "SYS" and t.link(1, 3).nvlinks == 0
    assert [n.name for n in t.nics] == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
    assert t.nics[2].gpu_paths == {0: "SYS", 1: "SYS", 2: "NODE", 3: "NODE"}
    assert [g.numa_node for g in t.gpus] == [0, 0, 8, 8]
    assert [n.numa_node for n in t.nics] == [0, 0, 8, 8]


def test_dgx1_old_legend_soc_and_lost_header_tabs():
    t = load("dgx1_p100_old_legend_soc.txt")
    assert len(t.gpus) == 8
    assert t.link(0, 5).pcie == "SYS" and t.link(0, 5).nvlinks == 0  # SOC is the old name of SYS
    assert t.link(0, 4).label == "NV1" and t.link(1, 5).label == "NV1" and t.link(0, 6).label == "SYS"
    assert sum(1 for ln in t.links if ln.nvlinks) == 16  # hybrid cube-mesh: 4 links per GPU
    assert [n.name for n in t.nics] == ["mlx5_0", "mlx5_2", "mlx5_1", "mlx5_3"]  # column order as printed
    assert t.nics[1].gpu_paths[4] == "PIX" and t.nics[0].gpu_paths[4] == "SYS"
    assert t.gpu(3).cpu_affinity == [1] and t.gpu(3).numa_affinity == []


def test_polaris_header_mixing_tabs_and_single_spaces():
    t = load("polaris_a100_nv4_mlx5.txt")
    assert {ln.label for ln in t.links} == {"NV4"} and len(t.links) == 6
    assert [g.numa_node for g in t.gpus] == [3, 2, 1, 0]
    assert t.gpu(0).cpu_affinity == list(range(24, 32)) + list(range(56, 64))
    assert t.nics[0].gpu_paths == {0: "SYS", 1: "SYS", 2: "SYS", 3: "PHB"}
    assert [n.numa_node for n in t.nics] == [0, 2]


def test_nic_columns_without_legend_keep_their_numbers():
    t = load("rtx4090_8x_nic_no_legend.txt")
    assert [n.name for n in t.nics] == ["NIC0", "NIC1"]
    assert t.nics[0].gpu_paths[6] == "PHB" and t.nics[0].numa_node == 1
    assert any("NIC Legend" in note for note in t.notes)
    assert {ln.label for ln in t.links} == {"SYS"}


def test_two_gpus_phb_with_gpu_numa_id_column():
    t = load("rtx5090_2x_phb.txt")
    assert len(t.gpus) == 2 and t.link(0, 1).label == "PHB" and t.gpu(1).numa_node == 0


@pytest.mark.parametrize("name", ALL)
def test_json_round_trip_is_exact(name):
    t = load(name)
    assert Topology.from_json(t.to_json()) == t
    assert Topology.from_json(t.to_json(indent=None)).to_json() == t.to_json()


def test_ansi_underlined_header_is_accepted():
    text = (FIXTURES / "rtx5090_2x_phb.txt").read_text().replace("\tGPU0", "\t\x1b[4mGPU0", 1)
    assert len(Topology.from_nvidia_smi(text).gpus) == 2


def test_cpu_lists():
    assert parse_cpu_list("0-55,112-167")[:2] == [0, 1] and len(parse_cpu_list("0-55,112-167")) == 112
    assert parse_cpu_list("0,2,4") == [0, 2, 4] and parse_cpu_list("N/A") == []
    assert format_cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    with pytest.raises(ValueError, match="runs backwards"):
        parse_cpu_list("5-3")


def _lines(name: str) -> list[str]:
    return (FIXTURES / name).read_text().splitlines()


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda ls: ls[:4], r"truncated: header \(line 1\) lists 4 GPUs but there is no row for GPU3"),
        (lambda ls: ls[:3] + [ls[3][:20]] + ls[4:], r"line 4: row GPU2 has \d+ cells; the header declares 8"),
        (lambda ls: ls[:2] + [ls[2].replace("NV3", "NVX")] + ls[3:], r"line 3: cell GPU1/GPU0 is 'NVX'"),
        (lambda ls: ls[:2] + [ls[2].replace(" X ", "SYS")] + ls[3:], r"line 3: cell GPU1/GPU1 is 'SYS'; X belongs"),
        (lambda ls: ls[:1] + [ls[1].replace("\t0-63\t0", "\t0-63")] + ls[2:], r"line 2: row GPU0 is missing NUMA"),
        (lambda ls: ls[:1] + [ls[1].replace("0-63", "0-x")] + ls[2:], r"line 2: CPU Affinity of GPU0: not a CPU list"),
        (lambda ls: ls[:3] + [ls[1]] + ls[3:], r"line 4: row GPU0 appears twice"),
        (lambda ls: ["garbage", "more garbage"], r"no header line naming GPU0"),
    ],
)
def test_bad_or_truncated_text_names_the_line(mutate, message):
    text = "\n".join(mutate(_lines("traverse_v100_nvlink_pairs_mlx5.txt")))
    with pytest.raises(ValueError, match=message):
        Topology.from_nvidia_smi(text)
