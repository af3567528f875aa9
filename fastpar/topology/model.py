"""The topology data model: GPUs, the links between them, NICs and NUMA nodes.

Everything here is plain data (dataclasses of ints, strings and lists), so a Topology can be written
to JSON and read back unchanged, whether it came from NVML, from /sys or from saved `nvidia-smi topo -m`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

# PCIe path classes in nvidia-smi's vocabulary, nearest first. "SOC" is the pre-2017 name of "SYS".
PCIE_CLASSES = ("PIX", "PXB", "PHB", "NODE", "SYS")

LEGEND = """Legend:
  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks"""


def format_cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (the kernel's cpulist format)."""
    parts: list[str] = []
    ordered = sorted(set(cpus))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def parse_cpu_list(text: str) -> list[int]:
    """ "0-55,112-167" or "0,2,4" -> sorted CPU ids. Empty/"N/A" -> []. Raises ValueError on junk."""
    text = text.strip()
    if not text or text.upper() == "N/A":
        return []
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        low, sep, high = part.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ValueError(f"not a CPU list: {text!r} (expected ranges like 0-55,112-167 or 0,2,4)")
        start, end = int(low), int(high) if sep else int(low)
        if end < start:
            raise ValueError(f"not a CPU list: {text!r} (range {part} runs backwards)")
        cpus.update(range(start, end + 1))
    return sorted(cpus)


@dataclass
class GPU:
    index: int
    name: str = ""
    uuid: str = ""
    pci_bus_id: str = ""  # "00000000:18:00.0" as NVML prints it; "" when unknown (nvidia-smi topo)
    memory_total_mib: int | None = None
    memory_used_mib: int | None = None
    processes: int | None = None  # running compute + graphics processes; None = unknown
    cpu_affinity: list[int] = field(default_factory=list)
    numa_affinity: list[int] = field(default_factory=list)  # NUMA node(s) nearest the GPU
    gpu_numa_id: int | None = None  # the GPU's own memory NUMA node (Grace-Hopper style), rarely set

    @property
    def numa_node(self) -> int | None:
        """The single NUMA node this GPU hangs off, or None when unknown or ambiguous."""
        return self.numa_affinity[0] if len(self.numa_affinity) == 1 else None


@dataclass
class Link:
    """How GPU ``a`` reaches GPU ``b`` (a < b): NVLink (``nvlinks`` > 0) or else a PCIe path class."""

    a: int
    b: int
    pcie: str = "SYS"  # one of PCIE_CLASSES
    nvlinks: int = 0
    nvlink_version: int | None = None  # NVLink generation (1..5) when NVML told us
    p2p: str | None = None  # NVML P2P read status: "OK", "NS", "CNS", ...; None = unknown

    @property
    def label(self) -> str:
        return f"NV{self.nvlinks}" if self.nvlinks else self.pcie


@dataclass
class NIC:
    """A network device: an RDMA HCA (``kind="rdma"``) or a kernel network interface (``kind="net"``)."""

    name: str
    kind: str = "net"
    state: str = ""  # "up"/"down"/... for net, "ACTIVE"/"DOWN" for rdma; "" = unknown
    speed_mbps: int | None = None
    families: list[str] = field(default_factory=list)  # ["ipv4", "ipv6"] for net interfaces
    pci_bus_id: str = ""
    numa_node: int | None = None
    virtual: bool = False  # loopback, docker0, veth*, bridges: never a NCCL interface
    netdevs: list[str] = field(default_factory=list)  # for rdma: its Ethernet/IPoIB interfaces
    gpu_paths: dict[int, str] = field(default_factory=dict)  # GPU index -> PCIe class to that GPU


@dataclass
class NumaNode:
    id: int
    cpus: list[int] = field(default_factory=list)


@dataclass
class Topology:
    gpus: list[GPU] = field(default_factory=list)
    links: list[Link] = field(default_factory=list)
    nics: list[NIC] = field(default_factory=list)
    numa_nodes: list[NumaNode] = field(default_factory=list)
    cpus: list[int] = field(default_factory=list)  # online logical CPUs; [] when unknown
    cores: int | None = None  # physical cores
    sockets: int | None = None
    default_route: str = ""  # interface carrying the default IPv4 route
    source: str = ""  # "nvml", "nvidia-smi topo -m: FILE", "sysfs"
    gpu_status: str = ""  # why there are no GPUs, in words ("no NVIDIA GPU/driver found: ...")
    notes: list[str] = field(default_factory=list)

    def link(self, a: int, b: int) -> Link:
        """The link between GPUs ``a`` and ``b`` (order does not matter)."""
        lo, hi = min(a, b), max(a, b)
        for link in self.links:
            if link.a == lo and link.b == hi:
                return link
        raise KeyError(f"no link recorded between GPU{a} and GPU{b}")

    def gpu(self, index: int) -> GPU:
        for gpu in self.gpus:
            if gpu.index == index:
                return gpu
        raise KeyError(f"no GPU{index}; this topology has GPUs {[g.index for g in self.gpus]}")

    @property
    def has_nvlink(self) -> bool:
        return any(link.nvlinks for link in self.links)

    @property
    def rdma_nics(self) -> list[NIC]:
        return [nic for nic in self.nics if nic.kind == "rdma"]

    # JSON: NIC.gpu_paths has int keys, which JSON turns into strings; convert them back on load.
    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(asdict(self), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Topology:
        data = json.loads(text)
        nics = []
        for raw in data.pop("nics", []):
            raw["gpu_paths"] = {int(k): v for k, v in raw.get("gpu_paths", {}).items()}
            nics.append(NIC(**raw))
        return cls(
            gpus=[GPU(**g) for g in data.pop("gpus", [])],
            links=[Link(**link) for link in data.pop("links", [])],
            nics=nics,
            numa_nodes=[NumaNode(**n) for n in data.pop("numa_nodes", [])],
            **data,
        )
