"""``fastpar topo --env``: the environment a multi-GPU / multi-node run should use, as eval-able bash.

Every setting comes with a ``# reason`` line; settings already in the environment that hurt get a
``# WARNING:`` line. Nothing here is executed: the user reads it, then ``eval "$(fastpar topo --env)"``.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping

from .model import NIC, Topology, format_cpu_list
from .select import Selection

_NEAR = ("PIX", "PXB", "PHB", "NODE")  # same socket as the GPU


def _export(name: str, value: str, reason: str) -> list[str]:
    return [f"# {reason}", f"export {name}={shlex.quote(value)}"]


def socket_interface(topology: Topology) -> tuple[str, str]:
    """(interface, reason) for NCCL_SOCKET_IFNAME: up, not loopback/docker/veth/bridge, has an address;
    the default-route interface when it qualifies. ("", reason) when none does."""
    usable = [
        n
        for n in topology.nics
        if n.kind == "net" and not n.virtual and n.state in ("up", "unknown") and n.families and n.name != "lo"
    ]
    if not usable:
        return "", "no up, non-virtual interface with an address was found"
    for nic in usable:
        if nic.name == topology.default_route:
            return nic.name, f"{nic.name} is up and carries the default route"
    best = max(usable, key=lambda n: (n.speed_mbps or 0, -usable.index(n)))
    return best.name, f"{best.name} is up and has an address (no usable interface carries the default route)"


def nearest_hcas(topology: Topology, devices: list[int]) -> tuple[list[NIC], list[str]]:
    """For each selected GPU, the RDMA NIC(s) on its closest PCIe path (if on the same socket)."""
    order = {c: i for i, c in enumerate(_NEAR)}
    chosen: list[NIC] = []
    notes = []
    usable = [n for n in topology.rdma_nics if n.state in ("", "ACTIVE")]
    for gpu in devices:
        ranked = [(order[n.gpu_paths[gpu]], n) for n in usable if n.gpu_paths.get(gpu) in order]
        if not ranked:
            notes.append(f"GPU{gpu} has no RDMA NIC on its socket")
            continue
        best = min(rank for rank, _ in ranked)
        for rank, nic in ranked:
            if rank == best and nic not in chosen:
                chosen.append(nic)
        notes.append(f"GPU{gpu}->{'/'.join(n.name for r, n in ranked if r == best)} ({_NEAR[best]})")
    return chosen, notes


def _pci_order(topology: Topology, devices: list[int]) -> list[int]:
    bus = {g.index: g.pci_bus_id.lower() for g in topology.gpus}
    return sorted(devices, key=lambda d: (bus.get(d) or "", d))


def build_env(
    topology: Topology,
    selection: Selection | None,
    *,
    environ: Mapping[str, str],
    network: Topology | None,
    network_note: str = "",
) -> list[str]:
    """Lines of bash. ``topology`` gives GPU facts; ``network`` (this machine, or None) gives interfaces.
    ``selection`` None means there are no GPUs: only the network settings are printed."""
    if selection is None:
        lines = [f"# fastpar topo --env: {topology.gpu_status or 'no GPUs'}; network settings only"]
        return lines + _network_lines(topology, [], network, network_note)
    devices = _pci_order(topology, selection.devices)
    lines = [f"# fastpar topo --env for GPUs {','.join(map(str, devices))} (source: {topology.source})"]
    lines += _export(
        "CUDA_DEVICE_ORDER", "PCI_BUS_ID", "number CUDA devices in PCI bus order, like nvidia-smi and NVML do"
    )
    lines += _export(
        "CUDA_VISIBLE_DEVICES",
        ",".join(map(str, devices)),
        f"the {len(devices)} selected GPUs in PCI bus order; slowest link {selection.slowest_link}",
    )
    lines += _binding_lines(topology, devices)
    lines += _network_lines(topology, devices, network, network_note)
    lines += _warnings(topology, devices, environ, network)
    return lines


def _binding_lines(topology: Topology, devices: list[int]) -> list[str]:
    gpus = [topology.gpu(d) for d in devices]
    if not all(g.numa_node is not None for g in gpus):
        cpus = [format_cpu_list(g.cpu_affinity) for g in gpus]
        if not all(cpus):
            return ["# per-rank CPU binding: GPU CPU/NUMA affinity unknown; nothing to suggest"]
        return _export(
            "FASTPAR_RANK_CPUS",
            ";".join(cpus),
            "CPUs nearest each local rank's GPU (';'-separated, rank order); bind with: "
            'taskset -c "$(echo "$FASTPAR_RANK_CPUS" | cut -d";" -f$((LOCAL_RANK+1)))" python train.py',
        )
    lines = ["# per-rank binding (torchrun does not read these; wrap your script, e.g.):"]
    for rank, gpu in enumerate(gpus):
        node = gpu.numa_node
        lines.append(
            f"#   local rank {rank} -> GPU{gpu.index}: numactl --cpunodebind={node} --membind={node} python train.py"
        )
    lines += _export(
        "FASTPAR_RANK_NUMA",
        ",".join(str(g.numa_node) for g in gpus),
        "NUMA node per local rank; generic wrapper: "
        'n=$(echo "$FASTPAR_RANK_NUMA" | cut -d, -f$((LOCAL_RANK+1))); numactl --cpunodebind=$n --membind=$n python train.py',
    )
    return lines


def _network_lines(topology: Topology, devices: list[int], network: Topology | None, note: str) -> list[str]:
    lines = []
    if network is None:
        lines.append(f"# NCCL_SOCKET_IFNAME: not set ({note or 'no interface information'})")
    else:
        name, reason = socket_interface(network)
        if name:
            lines += _export("NCCL_SOCKET_IFNAME", f"={name}", f"{reason}; '=' makes NCCL match it exactly")
            lines += _export(
                "GLOO_SOCKET_IFNAME", name, "the same interface for gloo (CPU collectives, torch.distributed)"
            )
        else:
            lines.append(f"# NCCL_SOCKET_IFNAME: not set ({reason}); NCCL will pick one itself")
    hcas, notes = nearest_hcas(topology, devices)
    if not devices:
        return lines
    if not topology.rdma_nics:
        lines.append("# NCCL_IB_HCA: not set (no RDMA devices known)")
    elif not hcas:
        lines.append(f"# NCCL_IB_HCA: not set ({'; '.join(notes)})")
    elif any(n.name.startswith("NIC") and n.name[3:].isdigit() for n in hcas):
        near = ", ".join(n for n in notes if "->" in n)
        lines.append(
            f"# NCCL_IB_HCA: not set: the nearest RDMA NICs ({near}) are unnamed; the saved output has no NIC Legend"
        )
    else:
        value = "=" + ",".join(n.name for n in hcas)
        lines += _export(
            "NCCL_IB_HCA", value, f"RDMA devices nearest the GPUs: {', '.join(notes)}; '=' means exact names"
        )
    return lines


def _warnings(
    topology: Topology, devices: list[int], environ: Mapping[str, str], network: Topology | None
) -> list[str]:
    out = []
    nvlinked = [ln for ln in topology.links if ln.nvlinks and ln.a in devices and ln.b in devices]
    if environ.get("NCCL_P2P_DISABLE", "0") not in ("", "0") and nvlinked:
        pair = f"GPU{nvlinked[0].a}-GPU{nvlinked[0].b} {nvlinked[0].label}"
        out.append(
            f"# WARNING: NCCL_P2P_DISABLE={environ['NCCL_P2P_DISABLE']} is set but the GPUs have NVLink ({pair}); NCCL will stage through host memory. Fix: unset NCCL_P2P_DISABLE"
        )
    near_hcas, _ = nearest_hcas(topology, devices)
    if environ.get("NCCL_IB_DISABLE", "0") not in ("", "0") and near_hcas:
        out.append(
            f"# WARNING: NCCL_IB_DISABLE={environ['NCCL_IB_DISABLE']} is set although RDMA devices sit next to the GPUs; inter-node traffic will use TCP sockets. Fix: unset NCCL_IB_DISABLE"
        )
    nic_nodes = {n.numa_node for n in topology.rdma_nics if n.numa_node is not None}
    gpu_nodes = {g.numa_node for g in topology.gpus if g.numa_node is not None}
    if len(nic_nodes) == 1 and len(gpu_nodes) > 1:
        node = nic_nodes.pop()
        far = sorted(g.index for g in topology.gpus if g.numa_node is not None and g.numa_node != node)
        out.append(
            f"# WARNING: all RDMA NICs sit on NUMA node {node}; GPUs {','.join(map(str, far))} cross the socket link for every inter-node transfer"
        )
    current = environ.get("NCCL_SOCKET_IFNAME")
    if current and not current.startswith("^") and network is not None:
        names = {n.name: n for n in network.nics if n.kind == "net"}
        wanted = current.lstrip("=").split(",")
        bad = [
            w for w in wanted if w and not any(n.startswith(w) and names[n].state in ("up", "unknown") for n in names)
        ]
        if bad:
            out.append(
                f"# WARNING: NCCL_SOCKET_IFNAME={current} names no up interface here ({', '.join(bad)}); NCCL init will fail or hang"
            )
    if environ.get("CUDA_VISIBLE_DEVICES"):
        out.append(
            f"# note: CUDA_VISIBLE_DEVICES was {environ['CUDA_VISIBLE_DEVICES']!r}; the indices above are physical (NVML) indices and replace it"
        )
    return out
