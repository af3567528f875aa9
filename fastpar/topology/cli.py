"""``fastpar topo``: show the GPU/NVLink/PCIe/NUMA/NIC topology, pick GPUs, print launch settings."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from ..user_errors import UserError
from .discover import discover
from .env import build_env
from .model import LEGEND, Topology, format_cpu_list
from .nvidia_smi import parse_topo_matrix
from .select import DEFAULT_BUSY_MEMORY_MIB, Selection, busy_reason, select_devices


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fastpar topo",
        description="GPU/NVLink/PCIe/NUMA/NIC topology of this machine (via NVML and /sys, never CUDA) or of a "
        "saved `nvidia-smi topo -m` output; best-k GPU selection; NCCL launch settings.",
    )
    p.add_argument(
        "--from", dest="from_file", metavar="FILE", help="read saved `nvidia-smi topo -m` output ('-' = stdin)"
    )
    p.add_argument("--matrix", action="store_true", help="print only the link matrix with its legend")
    p.add_argument(
        "--json", action="store_true", help="print the topology (and selection; with --env, the settings) as JSON"
    )
    p.add_argument("--select", type=int, metavar="K", help="choose the best K GPUs and explain the choice")
    p.add_argument(
        "--env", action="store_true", help="print eval-able export lines (uses --select K, else all free GPUs)"
    )
    p.add_argument("--include-busy", action="store_true", help="let --select/--env use GPUs that are busy")
    p.add_argument(
        "--busy-mib", type=int, default=DEFAULT_BUSY_MEMORY_MIB, help="memory used above which a GPU is busy"
    )
    return p


def matrix_lines(topology: Topology) -> list[str]:
    """The GPU/NIC matrix in nvidia-smi's vocabulary, plus CPU and NUMA affinity columns."""
    gpus = [g.index for g in topology.gpus]
    nics = [n for n in topology.nics if n.gpu_paths and not n.virtual]
    names = [f"GPU{g}" for g in gpus] + [n.name for n in nics]
    width = max(6, *(len(n) + 2 for n in names))
    rows = ["".ljust(width) + "".join(n.ljust(width) for n in names) + "CPU Affinity".ljust(16) + "NUMA Affinity"]
    for g in gpus:
        cells = ["X" if g == h else topology.link(g, h).label for h in gpus]
        cells += [n.gpu_paths.get(g, "?") for n in nics]
        gpu = topology.gpu(g)
        numa = format_cpu_list(gpu.numa_affinity) or "N/A"
        cpus = format_cpu_list(gpu.cpu_affinity) or "N/A"
        rows.append(f"GPU{g}".ljust(width) + "".join(c.ljust(width) for c in cells) + cpus.ljust(16) + numa)
    return rows + ["", LEGEND]


def _summary(topology: Topology, this_machine: bool) -> list[str]:
    out = [f"fastpar topo: {'this machine' if this_machine else 'saved output'} (source: {topology.source})", ""]
    if topology.gpus:
        out.append(f"GPUs ({len(topology.gpus)}):")
        if any(g.name for g in topology.gpus):
            out.append(
                f"  {'idx':<4}{'name':<26}{'PCI bus id':<18}{'memory used/total':<20}{'procs':<7}{'NUMA':<6}CPU affinity"
            )
        else:  # saved nvidia-smi output: only affinities are known
            out.append(f"  {'idx':<4}{'NUMA':<6}CPU affinity")
        for g in topology.gpus:
            numa = format_cpu_list(g.numa_affinity) or "?"
            cpus = format_cpu_list(g.cpu_affinity) or "?"
            if not any(x.name for x in topology.gpus):
                out.append(f"  {g.index:<4}{numa:<6}{cpus}")
                continue
            mem = f"{g.memory_used_mib}/{g.memory_total_mib} MiB" if g.memory_total_mib is not None else "?"
            procs = "?" if g.processes is None else str(g.processes)
            out.append(f"  {g.index:<4}{g.name[:25]:<26}{g.pci_bus_id or '?':<18}{mem:<20}{procs:<7}{numa:<6}{cpus}")
        out += ["", "Links:"] + ["  " + line for line in matrix_lines(topology)]
        p2p = sorted({ln.p2p for ln in topology.links if ln.p2p})
        if p2p:
            out.append(f"  P2P read status between GPU pairs: {', '.join(p2p)} (OK = direct peer access)")
    else:
        out.append(f"GPUs: none. {topology.gpu_status or 'no GPU rows'}")
    out.append("")
    if this_machine:
        sockets = f", {topology.sockets} socket(s)" if topology.sockets else ""
        cores = f", {topology.cores} physical cores" if topology.cores else ""
        out.append(f"CPUs: {len(topology.cpus)} online ({format_cpu_list(topology.cpus)}){cores}{sockets}")
    elif topology.cpus:
        out.append(f"CPUs named in GPU affinities: {format_cpu_list(topology.cpus)}")
    label = "NUMA nodes" if this_machine else "NUMA nodes (from GPU affinities)"
    out.append(f"{label}: {len(topology.numa_nodes) or 'unknown'}")
    for node in topology.numa_nodes:
        near = [f"GPU{g.index}" for g in topology.gpus if g.numa_node == node.id]
        nics = [n.name for n in topology.nics if n.numa_node == node.id and not n.virtual]
        extra = "".join(f"  {k}: {', '.join(v)}" for k, v in (("GPUs", near), ("NICs", nics)) if v)
        out.append(f"  node{node.id}: cpus {format_cpu_list(node.cpus) or '?'}{extra}")
    out += [""] + _nic_lines(topology, this_machine)
    out += [f"note: {n}" for n in topology.notes]
    return out


def _nic_lines(topology: Topology, this_machine: bool) -> list[str]:
    rdma = topology.rdma_nics
    out = []
    if this_machine:
        net = [n for n in topology.nics if n.kind == "net"]
        out.append(
            f"Network interfaces ({len(net)}):" if net else "Network interfaces: none found under /sys/class/net"
        )
        for n in net:
            notes = (["default route"] if n.name == topology.default_route else []) + (["virtual"] if n.virtual else [])
            speed = f"{n.speed_mbps} Mb/s" if n.speed_mbps else "speed ?"
            out.append(
                f"  {n.name:<12}{n.state or '?':<9}{speed:<14}{','.join(n.families) or 'no address':<12}"
                f"pci {n.pci_bus_id or '-':<14}numa {n.numa_node if n.numa_node is not None else '?':<4}{', '.join(notes)}"
            )
    if not rdma:
        out.append(
            "RDMA devices: none"
            + (" (/sys/class/infiniband is absent or empty)" if this_machine else " in the saved output")
        )
    else:
        out.append(f"RDMA devices ({len(rdma)}):")
        for n in rdma:
            near = [f"GPU{g}:{c}" for g, c in sorted(n.gpu_paths.items()) if c in ("PIX", "PXB")]
            numa = n.numa_node if n.numa_node is not None else "?"
            speed = f"{n.speed_mbps // 1000} Gb/s " if n.speed_mbps else ""
            out.append(f"  {n.name:<12}{n.state or '':<8}{speed}numa {numa}  close GPUs: {', '.join(near) or 'none'}")
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.from_file:
            text = _read_saved_output(args.from_file)
            topology = parse_topo_matrix(text, source=f"nvidia-smi topo -m: {args.from_file}")
        else:
            topology = discover()
        selection = _selection(topology, args)
    except ValueError as exc:  # a saved output that isn't one, a selection that can't be made
        raise UserError(str(exc)) from exc
    this_machine = not args.from_file
    if args.json:
        data = json.loads(topology.to_json())
        if selection is not None:
            data["selection"] = selection.to_dict()
        if args.env:  # the same settings as --env prints, as name -> value (and the comments explaining them)
            network, note = (topology, "") if this_machine else _other_machine_network()
            data["env"], data["env_notes"] = _env_dict(
                build_env(topology, selection, environ=os.environ, network=network, network_note=note)
            )
        print(json.dumps(data, indent=2))
    elif args.env:
        network, note = (topology, "") if this_machine else _other_machine_network()
        print("\n".join(build_env(topology, selection, environ=os.environ, network=network, network_note=note)))
    elif args.matrix:
        print("\n".join(matrix_lines(topology)) if topology.gpus else f"no matrix: {topology.gpu_status}")
    else:
        print("\n".join(_summary(topology, this_machine)))
        if selection is not None:
            print("\n" + str(selection))
    return 0


def _env_dict(lines: list[str]) -> tuple[dict[str, str], list[str]]:
    """``export NAME=value`` lines as {NAME: value}; the comment lines, without their ``#``."""
    env, notes = {}, []
    for line in lines:
        if line.startswith("export "):
            name, _, value = line.removeprefix("export ").partition("=")
            env[name] = shlex.split(value)[0] if value else ""
        elif line.startswith("#"):
            notes.append(line.lstrip("# ").rstrip())
    return env, notes


def _read_saved_output(path: str) -> str:
    """The text of a saved `nvidia-smi topo -m`, whatever wrote it: UTF-8 (with or without BOM) or the UTF-16
    that Windows PowerShell's ``>`` produces. Raises ValueError for empty or binary files."""
    data = sys.stdin.buffer.read() if path == "-" else open(path, "rb").read()
    where = "stdin" if path == "-" else path
    if not data.strip():
        raise ValueError(f"{where} is empty; save the output of `nvidia-smi topo -m` into it")
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        encoding = "utf-16"
    elif b"\x00" in data[:200] and len(data) % 2 == 0:
        encoding = "utf-16-le" if data[1:2] == b"\x00" else "utf-16-be"
    else:
        encoding = "utf-8-sig"
    try:
        return data.decode(encoding)
    except UnicodeDecodeError:
        raise ValueError(
            f"{where} is not text (not UTF-8 or UTF-16); expected the saved output of `nvidia-smi topo -m`"
        ) from None


def _selection(topology: Topology, args: argparse.Namespace) -> Selection | None:
    if args.select is None and not args.env:
        return None
    if args.select is None:  # --env alone: every free GPU
        if not topology.gpus:
            return None
        free = [g for g in topology.gpus if args.include_busy or not busy_reason(g, args.busy_mib)]
        k = len(free) or len(topology.gpus)
    else:
        k = args.select
    return select_devices(k, topology, exclude_busy=not args.include_busy, explain=True, busy_memory_mib=args.busy_mib)


def _other_machine_network() -> tuple[None, str]:
    """--from describes another machine: its interfaces are unknown. Say what this machine would use."""
    from .env import socket_interface

    local = discover()
    name, _ = socket_interface(local)
    here = f"; on this machine it would be ={name}, valid only if FILE was captured here" if name else ""
    return None, f"--from describes another machine, whose interfaces the saved output does not show{here}"
