"""CPUs, NUMA nodes, network interfaces and RDMA devices from /sys and /proc.

Every reader takes ``root`` (default "/"), so tests point them at a fake tree in a temp dir.
Missing files mean "unknown", never an exception: containers often hide parts of /sys.
"""

from __future__ import annotations

import os
import re
import socket
import struct

from .model import NIC, NumaNode, parse_cpu_list

_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_PCI_ROOT = re.compile(r"^pci[0-9a-f]{4}:[0-9a-f]{2}$")
# Interfaces NCCL must never use even when they are up: loopback, container and VM plumbing.
_VIRTUAL_PREFIXES = ("lo", "docker", "veth", "virbr", "br-", "cni", "flannel", "cali", "vxlan", "tun", "tap", "ifb")


def _read(root: str, *parts: str) -> str | None:
    try:
        with open(os.path.join(root, *parts)) as f:
            return f.read().strip()
    except OSError:
        return None


def _numa(value: str | None) -> int | None:
    return int(value) if value is not None and value.lstrip("-").isdigit() and int(value) >= 0 else None


def read_cpus(root: str = "/") -> tuple[list[int], int | None, int | None]:
    """(online CPU ids, physical cores, sockets); cores/sockets None when topology files are hidden."""
    online = parse_cpu_list(_read(root, "sys/devices/system/cpu/online") or "")
    cores, sockets = set(), set()
    for cpu in online:
        package = _read(root, f"sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id")
        core = _read(root, f"sys/devices/system/cpu/cpu{cpu}/topology/core_id")
        if package is None or core is None:
            return online, None, None
        cores.add((package, core))
        sockets.add(package)
    return online, (len(cores) or None), (len(sockets) or None)


def read_numa_nodes(root: str = "/") -> list[NumaNode]:
    base = os.path.join(root, "sys/devices/system/node")
    names = sorted((n for n in _listdir(base) if re.fullmatch(r"node\d+", n)), key=lambda n: int(n[4:]))
    return [NumaNode(id=int(n[4:]), cpus=parse_cpu_list(_read(base, n, "cpulist") or "")) for n in names]


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def read_default_route(root: str = "/") -> str:
    """Interface of the default IPv4 route (lowest metric) from /proc/net/route; "" if none."""
    text = _read(root, "proc/net/route") or ""
    best: tuple[int, str] | None = None
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 8 or fields[1] != "00000000" or fields[7] != "00000000":
            continue
        if not int(fields[3], 16) & 0x1:  # RTF_UP
            continue
        metric = int(fields[6])
        if best is None or metric < best[0]:
            best = (metric, fields[0])
    return best[1] if best else ""


def _ipv4_interfaces(root: str) -> set[str]:
    """Interfaces with an IPv4 address: any route through them, or (on the live system) an address."""
    names = {line.split()[0] for line in (_read(root, "proc/net/route") or "").splitlines()[1:] if line.split()}
    if os.path.realpath(root) == "/":
        for name in _listdir("/sys/class/net"):
            if _has_ipv4_address(name):
                names.add(name)
    return names


def _has_ipv4_address(name: str) -> bool:
    try:
        import fcntl

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
        return True
    except (OSError, ImportError):
        return False


def pci_device_path(root: str, bus_id: str) -> str:
    """Resolved /sys/devices/... path of a PCI device ("0000:18:00.0"), or "" when absent."""
    link = os.path.join(root, "sys/bus/pci/devices", bus_id)
    return os.path.realpath(link) if os.path.exists(link) else ""


def pci_numa_node(root: str, bus_id: str) -> int | None:
    return _numa(_read(root, "sys/bus/pci/devices", bus_id, "numa_node"))


def _bus_id_of(path: str) -> str:
    """The PCI device that owns a sysfs path: the last BDF component (virtio2 -> its PCI parent)."""
    bdfs = [part for part in path.split(os.sep) if _BDF.match(part)]
    return bdfs[-1] if bdfs else ""


def pci_path_class(path_a: str, path_b: str, numa_a: int | None, numa_b: int | None) -> str:
    """nvidia-smi's PCIe class between two devices from their /sys/devices paths.

    Different host bridges: NODE on the same NUMA node, else SYS. Same host bridge: PHB when only the
    host bridge is shared, PIX when one switch joins them, PXB when more bridges lie between.
    """
    parts_a, parts_b = path_a.split(os.sep), path_b.split(os.sep)
    root_a = next((p for p in parts_a if _PCI_ROOT.match(p)), None)
    root_b = next((p for p in parts_b if _PCI_ROOT.match(p)), None)
    if root_a is None or root_b is None or root_a != root_b:
        return "NODE" if numa_a is not None and numa_a == numa_b else "SYS"
    chain_a = [p for p in parts_a if _BDF.match(p)][:-1]  # bridges above the device
    chain_b = [p for p in parts_b if _BDF.match(p)][:-1]
    common = 0
    while common < min(len(chain_a), len(chain_b)) and chain_a[common] == chain_b[common]:
        common += 1
    if common == 0:
        return "PHB"
    hops = (len(chain_a) - common) + (len(chain_b) - common)
    return "PIX" if hops <= 2 else "PXB"


def read_net_interfaces(root: str = "/") -> list[NIC]:
    """Kernel network interfaces from /sys/class/net with state, speed, address families and locality."""
    base = os.path.join(root, "sys/class/net")
    ipv4 = _ipv4_interfaces(root)
    ipv6 = {line.split()[-1] for line in (_read(root, "proc/net/if_inet6") or "").splitlines() if line.split()}
    nics = []
    for name in _listdir(base):
        real = os.path.realpath(os.path.join(base, name))
        speed = _read(base, name, "speed")
        nic = NIC(
            name=name,
            kind="net",
            state=_read(base, name, "operstate") or "",
            speed_mbps=int(speed) if speed and speed.isdigit() and int(speed) > 0 else None,
            families=[f for f, members in (("ipv4", ipv4), ("ipv6", ipv6)) if name in members],
            virtual="/devices/virtual/" in real or name.startswith(_VIRTUAL_PREFIXES),
        )
        device = os.path.join(base, name, "device")
        if os.path.exists(device):
            nic.pci_bus_id = _bus_id_of(os.path.realpath(device))
            nic.numa_node = _numa(_read(base, name, "device/numa_node"))
        nics.append(nic)
    return nics


def read_rdma_devices(root: str = "/") -> list[NIC]:
    """RDMA HCAs from /sys/class/infiniband: port state, rate, NUMA node, PCI id, their net interfaces."""
    base = os.path.join(root, "sys/class/infiniband")
    nics = []
    for name in _listdir(base):
        ports = _listdir(os.path.join(base, name, "ports"))
        states = [(_read(base, name, "ports", p, "state") or "").split(":")[-1].strip() for p in ports]
        rates = [_read(base, name, "ports", p, "rate") or "" for p in ports]
        gbps = [int(m.group(1)) for r in rates if (m := re.match(r"(\d+)", r))]
        device = os.path.realpath(os.path.join(base, name, "device"))
        nics.append(
            NIC(
                name=name,
                kind="rdma",
                state="ACTIVE" if "ACTIVE" in states else (states[0] if states else ""),
                speed_mbps=max(gbps) * 1000 if gbps else None,
                pci_bus_id=_bus_id_of(device),
                numa_node=_numa(_read(base, name, "device/numa_node")),
                netdevs=_listdir(os.path.join(base, name, "device/net")),
            )
        )
    return nics
