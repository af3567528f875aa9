"""Topology inspection and topology-aware GPU selection (``fastpar topo``).

``discover()`` reads this machine (NVML for GPUs, /sys for CPUs, NUMA and NICs; never CUDA);
``parse_nvidia_smi(text)`` reads saved ``nvidia-smi topo -m`` output;
``select_devices(k)`` picks the k GPUs with the best modelled collective bandwidth (NVML indices);
``select_cuda_devices(k)`` the same among the GPUs this process's CUDA sees, as CUDA ordinals.
"""

from __future__ import annotations

from .cuda_order import select_cuda_devices, visible_gpus
from .discover import discover
from .env import build_env
from .model import GPU, NIC, Link, NumaNode, Topology
from .nvidia_smi import parse_topo_matrix as parse_nvidia_smi
from .select import Selection, link_gbps, select_devices

__all__ = [
    "GPU",
    "NIC",
    "Link",
    "NumaNode",
    "Selection",
    "Topology",
    "build_env",
    "discover",
    "link_gbps",
    "parse_nvidia_smi",
    "select_cuda_devices",
    "select_devices",
    "visible_gpus",
]
