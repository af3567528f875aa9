"""Read GPUs and their links through NVML (nvidia-ml-py's ``pynvml``), never through CUDA.

NVML does not create a CUDA context, so a parent process can call this and still fork CUDA workers.
``read_nvml(nvml)`` takes the module as an argument: tests pass a small fake with recorded values.
"""

from __future__ import annotations

import os
from typing import Any

from .model import GPU, Link

# nvmlDeviceGetTopologyCommonAncestor level -> nvidia-smi class. INTERNAL (two GPUs on one board, e.g.
# K80) and SINGLE (one PCIe switch) both print as PIX in nvidia-smi.
_LEVEL_TO_CLASS = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
_P2P_STATUS = {0: "OK", 1: "CNS", 2: "GNS", 3: "TNS", 4: "DR", 5: "NS", 6: "U"}


_INIT_HINTS = {
    "NVMLError_LibraryNotFound": "libnvidia-ml.so, the NVIDIA driver's management library, is not installed",
    "NVMLError_DriverNotLoaded": "the NVIDIA kernel driver is not loaded",
    "NVMLError_NoPermission": "no permission to open the NVIDIA devices",
}


class NvmlUnavailable(RuntimeError):
    """NVML could not be used: no library, no driver, or no GPU. The message says which."""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def normalize_bus_id(bus_id: str) -> str:
    """NVML's "00000000:18:00.0" -> sysfs's "0000:18:00.0" (lower case, 4-digit domain)."""
    text = _text(bus_id).strip().lower()
    parts = text.split(":")
    if len(parts) == 3:
        return f"{int(parts[0], 16):04x}:{parts[1]}:{parts[2]}"
    if len(parts) == 2:
        return f"0000:{text}"
    return text


def _cpu_affinity(nvml: Any, handle: Any, ncpus: int) -> list[int]:
    words = max(1, (ncpus + 63) // 64)
    mask = nvml.nvmlDeviceGetCpuAffinity(handle, words)
    return [w * 64 + bit for w, value in enumerate(mask) for bit in range(64) if (int(value) >> bit) & 1]


def _process_count(nvml: Any, handle: Any) -> int | None:
    count, known = 0, False
    for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        try:
            count += len(getattr(nvml, getter)(handle))
            known = True
        except Exception:  # not supported on this GPU/driver: leave it unknown
            continue
    return count if known else None


def _nvlinks(nvml: Any, handle: Any) -> list[tuple[str, int | None]]:
    """Active links of one GPU as (remote PCI bus id, NVLink version)."""
    active = []
    for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
        try:
            if not nvml.nvmlDeviceGetNvLinkState(handle, link):
                continue
        except Exception:  # link does not exist / NVLink not supported: stop probing this GPU
            break
        remote = normalize_bus_id(_text(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId))
        try:
            version = int(nvml.nvmlDeviceGetNvLinkVersion(handle, link))
        except Exception:
            version = None
        active.append((remote, version))
    return active


def read_nvml(nvml: Any) -> tuple[list[GPU], list[Link], str]:
    """(gpus, links, driver version) from an NVML module. Raises NvmlUnavailable with the reason."""
    try:
        nvml.nvmlInit()
    except Exception as exc:
        hint = _INIT_HINTS.get(type(exc).__name__, "NVML could not initialise")
        raise NvmlUnavailable(f"{hint} ({type(exc).__name__}: {exc})") from exc
    try:
        count = int(nvml.nvmlDeviceGetCount())
        if count == 0:
            raise NvmlUnavailable("the NVIDIA driver is loaded but reports 0 GPUs")
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        ncpus = os.cpu_count() or 1
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        gpus = []
        for i, handle in enumerate(handles):
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            gpu = GPU(
                index=i,
                name=_text(nvml.nvmlDeviceGetName(handle)),
                uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                pci_bus_id=_text(nvml.nvmlDeviceGetPciInfo(handle).busId),
                memory_total_mib=int(memory.total) // 2**20,
                memory_used_mib=int(memory.used) // 2**20,
                processes=_process_count(nvml, handle),
                cpu_affinity=_cpu_affinity(nvml, handle, ncpus),
            )
            try:
                node = int(nvml.nvmlDeviceGetNumaNodeId(handle))
                gpu.numa_affinity = [node] if node >= 0 else []
            except Exception:  # older driver: discover() fills it from /sys
                pass
            gpus.append(gpu)
        links = _links(nvml, handles, gpus)
        return gpus, links, driver
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def _links(nvml: Any, handles: list[Any], gpus: list[GPU]) -> list[Link]:
    by_bus = {normalize_bus_id(g.pci_bus_id): g.index for g in gpus}
    per_gpu = [_nvlinks(nvml, h) for h in handles]
    # Links that end on something other than a GPU end on an NVSwitch: every pair of GPUs with
    # switch links talks at min(switch links) — what nvidia-smi prints as NV18 on an H100 board.
    switch_links = [sum(1 for remote, _ in links if remote not in by_bus) for links in per_gpu]
    p2p_read = getattr(nvml, "NVML_P2P_CAPS_INDEX_READ", 0)
    p2p_read = p2p_read[0] if isinstance(p2p_read, tuple) else p2p_read  # pynvml defines it as "0,"
    links = []
    for a in range(len(handles)):
        for b in range(a + 1, len(handles)):
            direct = [v for remote, v in per_gpu[a] if by_bus.get(remote) == b]
            count = len(direct) or min(switch_links[a], switch_links[b])
            versions = direct or [v for remote, v in per_gpu[a] if remote not in by_bus]
            level = int(nvml.nvmlDeviceGetTopologyCommonAncestor(handles[a], handles[b]))
            try:
                p2p = _P2P_STATUS.get(int(nvml.nvmlDeviceGetP2PStatus(handles[a], handles[b], p2p_read)), "U")
            except Exception:
                p2p = None
            links.append(
                Link(
                    a=a,
                    b=b,
                    pcie=_LEVEL_TO_CLASS.get(level, "SYS"),
                    nvlinks=count,
                    nvlink_version=max((v for v in versions if v is not None), default=None) if count else None,
                    p2p=p2p,
                )
            )
    return links
