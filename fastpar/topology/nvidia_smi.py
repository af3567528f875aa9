"""Parse ``nvidia-smi topo -m`` output as real machines print it.

Handles: tab- or space-aligned columns (and headers that mix both, or lost their tabs: "GPU0GPU1"),
``X``/``NV#``/``PIX``/``PXB``/``PHB``/``NODE``/``SYS`` and the pre-2017 ``SOC``, NIC columns named
``NIC#`` (renamed by a trailing "NIC Legend:") or named ``mlx5_#`` directly, ``CPU Affinity`` as ranges or
lists, ``NUMA Affinity``/``GPU NUMA ID`` present, absent or ``N/A``, ANSI escapes (also with the ESC byte
lost in a copy), a byte-order mark, CRLF, indentation, markdown quotes (``> ``) and tables (``| a | b |``), and
an optional legend. Only the first matrix counts: text pasted after its legend (``nvidia-smi topo -p2p``'s
matrix, say) is ignored. Anything else gets a ValueError naming the line and what was wrong with it.
"""

from __future__ import annotations

import re

from .model import GPU, NIC, Link, NumaNode, Topology, parse_cpu_list

# CSI escapes (colour, underline, erase); "[4m"/"[0m" remnants whose ESC byte a copy/paste dropped.
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\[[0-9;]*m")
_QUOTE = re.compile(r"^\s*(?:>\s?)+")  # markdown/email quote markers
# `nvidia-smi topo -p2p` status words: a P2P matrix given instead of `topo -m` deserves its own hint.
_P2P_WORDS = {"OK", "CNS", "GNS", "TNS", "NS", "DR", "U"}
# Multi-word trailing columns first, then GPU names (so "GPU0GPU1" splits), then any other name.
_HEADER_TOKEN = re.compile(r"CPU Affinity|NUMA Affinity|GPU NUMA ID|GPU\d+|\S+")
_TRAILING = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")
_GPU_NAME = re.compile(r"GPU(\d+)$")
_NV = re.compile(r"NV(\d+)$")
_LEGEND_ENTRY = re.compile(r"\s*(NIC\d+):\s*(\S+)\s*$")
_PCIE = {"PIX": "PIX", "PXB": "PXB", "PHB": "PHB", "NODE": "NODE", "SYS": "SYS", "SOC": "SYS"}


def _cell(token: str, lineno: int, row: str, column: str) -> tuple[str, int]:
    """One matrix cell -> (pcie class, nvlink count). "X" -> ("X", 0)."""
    if token == "X":
        return "X", 0
    if token in _PCIE:
        return _PCIE[token], 0
    match = _NV.match(token)
    if match:
        return "SYS", int(match.group(1))  # PCIe class behind an NVLink pair is not printed
    hint = (
        " (this looks like `nvidia-smi topo -p2p` output; save `nvidia-smi topo -m` instead)"
        if token in _P2P_WORDS
        else ""
    )
    raise ValueError(
        f"line {lineno}: cell {row}/{column} is {token!r}; expected X, NV#, PIX, PXB, PHB, NODE, SYS or SOC{hint}"
    )


def _clean(line: str) -> str:
    """One line as nvidia-smi printed it: no escapes, BOM, quote markers or markdown table pipes."""
    line = _QUOTE.sub("", _ANSI.sub("", line).replace("\ufeff", ""))
    return line.replace("|", " ") if line.lstrip().startswith("|") else line


def _is_header(line: str) -> bool:
    """The header names GPU0 as a column; a row starts with GPU0 followed by a cell (X, NV#, ...)."""
    tokens = _HEADER_TOKEN.findall(line)
    if "GPU0" not in tokens:
        return False
    return tokens[0] != "GPU0" or len(tokens) == 1 or bool(_GPU_NAME.match(tokens[1])) or tokens[1] in _TRAILING


def _find_header(lines: list[str]) -> int:
    for i, line in enumerate(lines):
        if _is_header(line):
            return i
    raise ValueError("no header line naming GPU0 found; is this `nvidia-smi topo -m` output?")


def _parse_optional_int(token: str, lineno: int, what: str) -> list[int]:
    try:
        return parse_cpu_list(token)
    except ValueError:
        raise ValueError(f"line {lineno}: {what} is {token!r}; expected a number, a range like 6-7, or N/A") from None


def parse_topo_matrix(text: str, *, source: str = "nvidia-smi topo -m") -> Topology:
    """Build a Topology from ``nvidia-smi topo -m`` text. Raises ValueError naming the bad line."""
    lines = [_clean(line) for line in text.splitlines()]
    header_at = _find_header(lines)
    header = _HEADER_TOKEN.findall(lines[header_at])
    trailing = [t for t in header if t in _TRAILING]
    devices = [t for t in header if t not in _TRAILING]
    if header[: len(devices)] != devices:
        raise ValueError(f"line {header_at + 1}: device columns must come before {', '.join(trailing)}")
    if len(set(devices)) != len(devices):
        raise ValueError(f"line {header_at + 1}: a device column name repeats: {devices}")
    gpu_cols = [d for d in devices if _GPU_NAME.match(d)]
    if not gpu_cols:
        raise ValueError(f"line {header_at + 1}: header names no GPU columns")

    rows: dict[str, tuple[int, list[str]]] = {}
    legend: dict[str, str] = {}
    section = "matrix"  # -> "after" at the legend or at a second matrix header -> "nic legend"
    for i in range(header_at + 1, len(lines)):
        lineno, line = i + 1, lines[i]
        stripped = " ".join(line.split())
        if not stripped:
            continue
        if stripped.startswith("NIC Legend"):
            section = "nic legend"
            continue
        if section == "nic legend":
            entry = _LEGEND_ENTRY.match(line)
            if entry:
                legend[entry.group(1)] = entry.group(2)
            elif not stripped.startswith("NIC"):
                section = "after"  # the legend ended; whatever follows is not ours
            continue
        if stripped.startswith("Legend") or _is_header(line):
            section = "after"
        if section != "matrix":
            continue
        tokens = stripped.split()
        if tokens[0] in devices:
            if tokens[0] in rows:
                raise ValueError(f"line {lineno}: row {tokens[0]} appears twice")
            rows[tokens[0]] = (lineno, tokens[1:])

    gpus: list[GPU] = []
    cells: dict[tuple[str, str], tuple[str, int]] = {}
    for name in gpu_cols:
        if name not in rows:
            raise ValueError(
                f"truncated: header (line {header_at + 1}) lists {len(gpu_cols)} GPUs but there is no row for "
                f"{name} (text ends at line {len(lines)})"
            )
        lineno, values = rows[name]
        if len(values) < len(devices):
            raise ValueError(
                f"line {lineno}: row {name} has {len(values)} cells; the header declares {len(devices)} device "
                f"columns{' plus ' + ', '.join(trailing) if trailing else ''} (truncated line?)"
            )
        for column, token in zip(devices, values[: len(devices)], strict=True):
            cells[(name, column)] = _cell(token, lineno, name, column)
            if (cells[(name, column)][0] == "X") != (column == name):
                raise ValueError(f"line {lineno}: cell {name}/{column} is {token!r}; X belongs on the diagonal only")
        extra = values[len(devices) :]
        if len(extra) < len(trailing):
            raise ValueError(
                f"line {lineno}: row {name} is missing {', '.join(trailing[len(extra) :])} (truncated line?)"
            )
        if len(extra) > len(trailing):
            raise ValueError(f"line {lineno}: row {name} has {len(extra) - len(trailing)} more cells than the header")
        info = dict(zip(trailing, extra, strict=True))
        gpu = GPU(index=int(_GPU_NAME.match(name).group(1)))
        try:
            gpu.cpu_affinity = parse_cpu_list(info.get("CPU Affinity", ""))
        except ValueError as exc:
            raise ValueError(f"line {lineno}: CPU Affinity of {name}: {exc}") from None
        gpu.numa_affinity = _parse_optional_int(info.get("NUMA Affinity", ""), lineno, f"NUMA Affinity of {name}")
        gpu_numa = _parse_optional_int(info.get("GPU NUMA ID", ""), lineno, f"GPU NUMA ID of {name}")
        gpu.gpu_numa_id = gpu_numa[0] if len(gpu_numa) == 1 else None
        gpus.append(gpu)

    links = []
    for x, name_a in enumerate(gpu_cols):
        for name_b in gpu_cols[x + 1 :]:
            pcie, nv = cells[(name_a, name_b)]
            a, b = int(name_a[3:]), int(name_b[3:])
            links.append(Link(a=min(a, b), b=max(a, b), pcie=pcie, nvlinks=nv))

    nics = []
    for column in devices:
        if column in gpu_cols:
            continue
        nic = NIC(name=legend.get(column, column), kind="rdma")
        nic.gpu_paths = {int(g[3:]): cells[(g, column)][0] for g in gpu_cols}
        nics.append(nic)

    topology = Topology(gpus=gpus, links=links, nics=nics, source=source)
    _infer_numa(topology)
    if any(not _NIC_NAMED.match(n.name) for n in nics):
        topology.notes.append("NIC columns are numbered without a NIC Legend; their device names are unknown")
    return topology


_NIC_NAMED = re.compile(r"(?!NIC\d+$)\S+$")


def _infer_numa(topology: Topology) -> None:
    """NUMA layout of the captured machine, from the GPUs' affinities; NIC NUMA from same-socket GPUs."""
    nodes: dict[int, set[int]] = {}
    for gpu in topology.gpus:
        if gpu.numa_node is not None:
            nodes.setdefault(gpu.numa_node, set()).update(gpu.cpu_affinity)
    topology.numa_nodes = [NumaNode(id=n, cpus=sorted(c)) for n, c in sorted(nodes.items())]
    topology.cpus = sorted({c for gpu in topology.gpus for c in gpu.cpu_affinity})
    for nic in topology.nics:
        near = {topology.gpu(g).numa_node for g, cls in nic.gpu_paths.items() if cls in ("PIX", "PXB", "PHB", "NODE")}
        near.discard(None)
        nic.numa_node = near.pop() if len(near) == 1 else None
