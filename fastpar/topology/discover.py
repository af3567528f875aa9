"""``discover()``: this machine's topology from NVML and /sys, without touching CUDA."""

from __future__ import annotations

from typing import Any

from . import sysfs
from .model import Topology
from .nvml import NvmlUnavailable, normalize_bus_id, read_nvml


def _load_nvml() -> Any:
    from fastpar._optional import require

    try:
        return require("pynvml", purpose="GPU discovery")
    except ImportError as exc:
        raise NvmlUnavailable(str(exc)) from exc


def discover(*, root: str = "/", nvml: Any = None) -> Topology:
    """GPUs (via NVML), CPUs, NUMA nodes, network interfaces and RDMA devices of this machine.

    Without NVML, a driver or GPUs it still returns CPUs, NUMA and NICs, with ``gpu_status`` saying
    why there are no GPUs. ``root`` and ``nvml`` exist for tests (a fake /sys tree, a fake pynvml).
    """
    cpus, cores, sockets = sysfs.read_cpus(root)
    numa_nodes = sysfs.read_numa_nodes(root)
    topology = Topology(
        cpus=cpus,
        cores=cores,
        sockets=sockets,
        numa_nodes=numa_nodes,
        nics=sysfs.read_rdma_devices(root) + sysfs.read_net_interfaces(root),
        default_route=sysfs.read_default_route(root),
        source="nvml + sysfs",
    )
    if not numa_nodes:
        topology.notes.append("no NUMA information under /sys/devices/system/node")
    try:
        topology.gpus, topology.links, driver = read_nvml(nvml if nvml is not None else _load_nvml())
        topology.notes.append(f"NVIDIA driver {driver}")
    except NvmlUnavailable as exc:
        topology.gpu_status = f"no NVIDIA GPU/driver found: {exc}"
        topology.source = "sysfs"
        return topology
    _add_pci_locality(topology, root)
    return topology


def _add_pci_locality(topology: Topology, root: str) -> None:
    """Fill GPU NUMA nodes NVML did not give, and each NIC's PCIe class to every GPU."""
    single_node = len(topology.numa_nodes) <= 1
    gpu_paths = {}
    for gpu in topology.gpus:
        bus = normalize_bus_id(gpu.pci_bus_id)
        if not gpu.numa_affinity:
            node = sysfs.pci_numa_node(root, bus)
            gpu.numa_affinity = [node] if node is not None else ([0] if single_node and topology.numa_nodes else [])
        gpu_paths[gpu.index] = sysfs.pci_device_path(root, bus)
    for nic in topology.nics:
        if not nic.pci_bus_id or nic.virtual:
            continue
        nic_path = sysfs.pci_device_path(root, nic.pci_bus_id)
        nic_numa = nic.numa_node if nic.numa_node is not None else (0 if single_node else None)
        for gpu in topology.gpus:
            if nic_path and gpu_paths[gpu.index]:
                nic.gpu_paths[gpu.index] = sysfs.pci_path_class(gpu_paths[gpu.index], nic_path, gpu.numa_node, nic_numa)
