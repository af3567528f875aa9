"""Which physical GPU is CUDA device 0, 1, ... in this process, so an NVML choice can be used as CUDA ordinals.

NVML (and ``select_devices``) number every GPU of the machine in PCI bus order. CUDA numbers only the
GPUs ``CUDA_VISIBLE_DEVICES`` lets it see, in the order that variable lists them; its integer entries
index the machine's GPUs in ``CUDA_DEVICE_ORDER`` order: ``PCI_BUS_ID`` (nvidia-smi's order) or
``FASTEST_FIRST``, CUDA's default, an undocumented speed heuristic that equals PCI order on a machine
of one GPU model. Entries may also be GPU UUIDs (or unique prefixes of them) and MIG device UUIDs.

This module maps by UUID and PCI bus id, reading the variables the way CUDA (and torch's NVML-based
device count) does: the list ends at the first invalid entry, a repeated entry hides every GPU.
Where the mapping can't be known from NVML -- GPUs of different models numbered FASTEST_FIRST, or MIG
devices -- it says so instead of guessing.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping

from .model import GPU, Topology
from .nvml import normalize_bus_id


def parse_visible_devices(value: str | None) -> tuple[str, list]:
    """``CUDA_VISIBLE_DEVICES`` as CUDA reads it: ("all", []) when unset, else ("index", [ints]),
    ("uuid", ["GPU-..."]) or ("mig", ["MIG-..."]); an empty list means no GPU is visible."""
    if value is None:
        return "all", []
    for prefix, kind in (("GPU-", "uuid"), ("MIG-", "mig")):
        if value.startswith(prefix):
            names: list[str] = []
            for entry in value.split(","):
                if entry in names:
                    return kind, []  # a repeated device hides them all
                if not entry.startswith(prefix):
                    break  # the list ends at the first entry of another form
                names.append(entry)
            return kind, names
    indices: list[int] = []
    for entry in value.split(","):
        digits = _leading_int(entry.strip())  # CUDA parses like strtoul: "1gpu" is 1
        if digits is None or digits < 0:
            break
        if digits in indices:
            return "index", []
        indices.append(digits)
    return "index", indices


def _leading_int(text: str) -> int | None:
    end = 1 if text[:1] in ("+", "-") else 0
    while end < len(text) and text[end].isdigit():
        end += 1
    return int(text[:end]) if text[:end].lstrip("+-") else None


def _pci_order(gpus: list[GPU]) -> list[GPU]:
    return sorted(gpus, key=lambda g: (normalize_bus_id(g.pci_bus_id) if g.pci_bus_id else "", g.index))


def _enumeration_order(gpus: list[GPU], environ: Mapping[str, str]) -> list[GPU] | None:
    """Every GPU in the order CUDA numbers the machine's GPUs, or None when NVML can't tell it."""
    if environ.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST") == "PCI_BUS_ID" or len({g.name for g in gpus}) <= 1:
        return _pci_order(gpus)
    return None  # FASTEST_FIRST over different models: CUDA's speed ranking is not published


def _by_uuid(gpus: list[GPU], names: list[str]) -> list[GPU]:
    visible: list[GPU] = []
    for name in names:
        matches = [g for g in gpus if g.uuid.startswith(name)]
        if len(matches) != 1:  # unknown or ambiguous prefix: the list ends here
            break
        if matches[0] in visible:
            return []
        visible.append(matches[0])
    return visible


def visible_gpus(gpus: list[GPU], environ: Mapping[str, str] | None = None) -> list[GPU] | None:
    """The GPUs CUDA shows this process, position i being CUDA device i; None when NVML can't tell
    (see the module docstring). ``environ`` defaults to ``os.environ``."""
    environ = os.environ if environ is None else environ
    kind, entries = parse_visible_devices(environ.get("CUDA_VISIBLE_DEVICES"))
    if kind == "uuid":
        return _by_uuid(gpus, entries)  # listed order: CUDA_DEVICE_ORDER does not matter
    if kind == "mig":
        return None  # MIG slices are not GPUs of the topology: there is nothing to select between
    order = _enumeration_order(gpus, environ)
    if order is None:
        return None
    if kind == "all":
        return order
    visible = []
    for i in entries:
        if i >= len(order):
            break  # an index past the last GPU ends the list, as in CUDA
        visible.append(order[i])
    return visible


def select_cuda_devices(
    k: int, topology: Topology | None = None, environ: Mapping[str, str] | None = None, **select_options
) -> list[int]:
    """The best-connected k GPUs this process can see (``select_devices``), as CUDA ordinals of this process.

    When the mapping can't be known (GPUs of different models under CUDA_DEVICE_ORDER=FASTEST_FIRST, MIG
    devices, no NVML), returns CUDA devices 0..k-1 with a warning that says how to get the selection.
    """
    from .select import select_devices

    if topology is None:
        from .discover import discover

        topology = discover()
    visible = visible_gpus(topology.gpus, environ) if topology.gpus else None
    if visible is None:
        why = (
            topology.gpu_status
            or "CUDA_VISIBLE_DEVICES names MIG devices, or GPUs of different models are numbered "
            "CUDA_DEVICE_ORDER=FASTEST_FIRST (CUDA's default), whose order NVML can't tell"
        )
        warnings.warn(
            f"fastpar: using CUDA devices 0..{k - 1} without topology-aware selection: {why}. For the "
            "best-connected GPUs export CUDA_DEVICE_ORDER=PCI_BUS_ID or list GPU UUIDs in CUDA_VISIBLE_DEVICES",
            RuntimeWarning,
            stacklevel=2,
        )
        return list(range(k))
    ordinal = {g.index: i for i, g in enumerate(visible)}
    return [ordinal[i] for i in select_devices(k, topology, among=list(ordinal), **select_options)]
