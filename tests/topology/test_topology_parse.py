"""Parsing real `nvidia-smi topo -m` outputs (tests/fixtures/topo, sources in its README)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastpar.topology import Topology, parse_nvidia_smi
from fastpar.topology.model import format_cpu_list, parse_cpu_list

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "topo"


def load(name: str) -> Topology:
    return parse_nvidia_smi((FIXTURES / name).read_text(), source=name)


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
    assert len(parse_nvidia_smi(text).gpus) == 2


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
        parse_nvidia_smi(text)


# --- outputs found in more public pages (README lists sources) ----------------------------------------


def test_single_gpu_has_no_links_and_selects_itself():
    t = load("tesla_p4_single_gpu.txt")
    assert [g.index for g in t.gpus] == [0] and t.links == [] and t.gpu(0).cpu_affinity == list(range(8))
    assert t.gpu(0).numa_affinity == [] and t.gpu(0).gpu_numa_id is None


def test_many_nic_columns_with_legend_and_bond_device():
    t = load("a100_8x_nv12_17nics_bond.txt")
    assert len(t.gpus) == 8 and {ln.label for ln in t.links} == {"NV12"}
    assert [n.name for n in t.nics] == [f"mlx5_{i}" for i in range(2, 18)] + ["mlx5_bond_0"]
    assert t.nics[16].gpu_paths == dict.fromkeys(range(8), "SYS") and t.nics[16].numa_node is None
    assert t.nics[4].gpu_paths[2] == "PXB" and t.nics[4].gpu_paths[0] == "SYS"


def test_consumer_box_with_phb_node_sys_and_na_numa():
    t = load("rtx_5x_phb_node_sys.txt")
    assert t.link(1, 2).label == "PHB" and t.link(1, 3).label == "NODE" and t.link(0, 4).label == "SYS"
    assert [g.numa_node for g in t.gpus] == [1, 0, 0, 0, 0]
    t = load("gtx1080ti_2x_phb_numa_na.txt")
    assert t.link(0, 1).label == "PHB" and t.gpu(1).numa_affinity == [] and t.gpu(1).cpu_affinity == list(range(12))
    t = load("rtx3090_2x_sys_numa_na_and_1.txt")
    assert t.gpu(0).numa_affinity == [] and t.gpu(1).numa_node == 1 and t.gpu(0).cpu_affinity[-1] == 23


def test_indented_report_followed_by_p2p_matrix_reads_only_the_topo_matrix():
    t = load("rtx3090_2x_indented_with_p2p_matrix.txt")
    assert len(t.gpus) == 2 and t.link(0, 1).label == "NODE" and t.gpu(1).cpu_affinity == list(range(16))


def test_p2p_matrix_alone_gets_a_hint():
    text = "\tGPU0\tGPU1\t\nGPU0\tX\tGNS\t\nGPU1\tGNS\tX\t\n"  # `nvidia-smi topo -p2p rw`, club-3090 #1229
    with pytest.raises(ValueError, match=r"line 2: cell GPU0/GPU1 is 'GNS'.*topo -p2p"):
        parse_nvidia_smi(text)


def test_slurm_view_with_unnamed_nics_and_cut_nic_rows():
    t = load("a100_2gpu_slurm_nv12_10nics.txt")
    assert t.link(0, 1).label == "NV12" and len(t.nics) == 10 and t.nics[0].gpu_paths == {0: "PXB", 1: "PXB"}
    assert [g.numa_node for g in t.gpus] == [3, 3] and t.nics[0].numa_node == 3


def _pipes(text: str) -> str:
    """A markdown table, as chat tools and blogs render the matrix."""
    out = []
    for line in text.splitlines():
        for name in ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID"):
            line = line.replace(name, name.replace(" ", "\0"))
        out.append("| " + " | ".join(t.replace("\0", " ") for t in line.split()) + " |" if line.strip() else "")
    return "\n".join(out)


PASTE_DAMAGE = {
    "crlf": lambda t: t.replace("\n", "\r\n"),
    "ansi": lambda t: "\n".join(f"\x1b[1m{ln}\x1b[0m" if "GPU" in ln else ln for ln in t.splitlines()),
    "ansi_lost_esc": lambda t: "\n".join(f"[4m{ln}[0m" if "GPU0" in ln else ln for ln in t.splitlines()),
    "indented": lambda t: "\n".join("    " + ln for ln in t.splitlines()),
    "trailing_blanks": lambda t: "\n".join(ln + "  \t " for ln in t.splitlines()),
    "quoted": lambda t: "\n".join("> " + ln for ln in t.splitlines()),
    "fenced": lambda t: "```\n" + t + "\n```\n",
    "markdown_table": _pipes,
    "bom": lambda t: "\ufeff" + t,
    "nbsp": lambda t: t.replace("\t", "\u00a0\u00a0"),
}


@pytest.mark.parametrize("damage", sorted(PASTE_DAMAGE))
@pytest.mark.parametrize("name", ALL)
def test_pasted_copies_parse_like_the_original(name, damage):
    text = (FIXTURES / name).read_text()
    want, got = parse_nvidia_smi(text), parse_nvidia_smi(PASTE_DAMAGE[damage](text))
    assert (got.gpus, got.links) == (want.gpus, want.links)
    assert [(n.name, n.gpu_paths) for n in got.nics] == [(n.name, n.gpu_paths) for n in want.nics]
