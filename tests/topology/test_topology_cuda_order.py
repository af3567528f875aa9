"""NVML indices -> CUDA ordinals: CUDA_VISIBLE_DEVICES (indices, UUIDs, MIG) and CUDA_DEVICE_ORDER, on a fake NVML.

The fake machine has 4 GPUs in PCI order; only GPU0 and GPU3 are NVLinked, so the best pair is NVML {0, 3}
and the test can follow that pair through every renumbering CUDA applies.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from fastpar.topology import Topology, select_devices
from fastpar.topology.cuda_order import parse_visible_devices, select_cuda_devices, visible_gpus
from fastpar.topology.nvml import read_nvml
from fastpar.train import environment

UUIDS = ["GPU-aaaa1111-0000", "GPU-bbbb2222-0000", "GPU-cccc3333-0000", "GPU-dddd4444-0000"]
BUS = ["00000000:18:00.0", "00000000:3B:00.0", "00000000:86:00.0", "00000000:AF:00.0"]


class FakeNvml:
    """pynvml-shaped: 4 GPUs (names configurable), NVLink only between GPU0 and GPU3, everything else SYS."""

    NVML_NVLINK_MAX_LINKS = 4

    def __init__(self, names=("NVIDIA A100-SXM4-80GB",) * 4, bus=BUS):
        self.names, self.bus = list(names), list(bus)

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return 4

    def nvmlSystemGetDriverVersion(self):
        return "570.133.20"

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return self.names[h]

    def nvmlDeviceGetUUID(self, h):
        return UUIDS[h]

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=self.bus[h])

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=80 * 2**30, used=0)

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return []

    def nvmlDeviceGetGraphicsRunningProcesses(self, h):
        return []

    def nvmlDeviceGetCpuAffinity(self, h, words):
        return [0b1111]

    def nvmlDeviceGetNumaNodeId(self, h):
        return 0

    def nvmlDeviceGetNvLinkState(self, h, link):
        if h not in (0, 3):
            raise RuntimeError("NVMLError_NotSupported")
        return 1

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        return SimpleNamespace(busId=self.bus[3 - h])

    def nvmlDeviceGetNvLinkVersion(self, h, link):
        return 3

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return 50

    def nvmlDeviceGetP2PStatus(self, a, b, index):
        return 0


def topology(**fake) -> Topology:
    gpus, links, _ = read_nvml(FakeNvml(**fake))
    return Topology(gpus=gpus, links=links, source="fake nvml")


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, ("all", [])),
        ("", ("index", [])),  # set but empty: no GPU
        ("3,1,0", ("index", [3, 1, 0])),
        ("0,2,-1,1", ("index", [0, 2])),  # the list ends at the first invalid entry
        ("1gpu,2", ("index", [1, 2])),  # read like strtoul
        ("0,1,0", ("index", [])),  # a repeated entry hides every GPU
        ("GPU-dddd,GPU-aaaa", ("uuid", ["GPU-dddd", "GPU-aaaa"])),
        ("GPU-dddd,1", ("uuid", ["GPU-dddd"])),
        ("GPU-dddd,GPU-dddd", ("uuid", [])),
        ("MIG-1f2e3d4c-aaaa", ("mig", ["MIG-1f2e3d4c-aaaa"])),
        ("MIG-GPU-aaaa1111-0000/1/0", ("mig", ["MIG-GPU-aaaa1111-0000/1/0"])),
    ],
)
def test_cuda_visible_devices_is_read_as_cuda_reads_it(value, expected):
    assert parse_visible_devices(value) == expected


def test_nvml_selection_is_the_nvlinked_pair():
    assert select_devices(2, topology()) == [0, 3]


@pytest.mark.parametrize(
    "environ, ordinals",
    [
        ({}, [0, 3]),  # CUDA sees every GPU in PCI order: ordinals are NVML indices
        ({"CUDA_VISIBLE_DEVICES": "3,1,0"}, [2, 0]),  # cuda:0 is GPU3, cuda:2 is GPU0
        ({"CUDA_VISIBLE_DEVICES": "3,1,0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, [2, 0]),
        ({"CUDA_VISIBLE_DEVICES": "GPU-dddd,GPU-bbbb,GPU-aaaa1111"}, [2, 0]),  # UUID prefixes
        ({"CUDA_VISIBLE_DEVICES": "1,2"}, [0, 1]),  # the NVLinked pair is hidden: the best of what is visible
        ({"CUDA_VISIBLE_DEVICES": "0,3,7,1"}, [0, 1]),  # index 7 does not exist: GPU1 is not visible either
    ],
)
def test_selection_is_returned_as_this_processes_cuda_ordinals(environ, ordinals):
    topo = topology()
    assert select_cuda_devices(2, topo, environ) == ordinals
    visible = visible_gpus(topo.gpus, environ)
    assert {visible[i].index for i in ordinals} <= {0, 1, 2, 3}  # every ordinal names a visible GPU


def test_mixed_models_follow_cuda_device_order():
    names = ("NVIDIA H100 80GB HBM3", "NVIDIA A10", "NVIDIA A10", "NVIDIA H100 80GB HBM3")
    bus = [BUS[3], BUS[1], BUS[2], BUS[0]]  # NVML index order is not bus order here: GPU3 has the lowest bus id
    topo = topology(names=names, bus=bus)
    environ = {"CUDA_VISIBLE_DEVICES": "0,1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert [g.index for g in visible_gpus(topo.gpus, environ)] == [3, 1]
    # FASTEST_FIRST (the default) over different models: CUDA's order is unknowable from NVML
    assert visible_gpus(topo.gpus, {"CUDA_VISIBLE_DEVICES": "0,1"}) is None
    assert visible_gpus(topo.gpus, {}) is None
    with pytest.warns(RuntimeWarning, match="CUDA_DEVICE_ORDER=PCI_BUS_ID"):
        assert select_cuda_devices(2, topo, {}) == [0, 1]
    # UUIDs name GPUs whatever the order: cuda:0 is GPU3, cuda:1 is GPU2, cuda:2 is GPU0
    assert select_cuda_devices(2, topo, {"CUDA_VISIBLE_DEVICES": "GPU-dddd,GPU-cccc,GPU-aaaa"}) == [2, 0]


def test_mig_devices_are_used_in_cuda_order_with_a_warning():
    with pytest.warns(RuntimeWarning, match="MIG"):
        assert select_cuda_devices(1, topology(), {"CUDA_VISIBLE_DEVICES": "MIG-1f2e3d4c-aaaa"}) == [0]


def test_busy_and_hidden_gpus_are_both_left_out():
    topo = topology()
    topo.gpu(1).processes = 2
    environ = {"CUDA_VISIBLE_DEVICES": "2,1,3"}  # GPU0 hidden, GPU1 busy: GPU2 and GPU3 remain
    assert select_cuda_devices(2, topo, environ) == [0, 2]
    with pytest.raises(ValueError, match="only 2 of 3 are available"):
        select_cuda_devices(3, topo, environ)


def test_trainer_plan_uses_cuda_ordinals(monkeypatch):
    """execution_environment='multi-gpu' with devices < visible GPUs: the plan holds CUDA ordinals."""
    monkeypatch.setattr(environment, "gpu_count", lambda: 3)
    monkeypatch.setattr(sys.modules["fastpar.topology.discover"], "discover", lambda: topology())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1,0")
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    for name in environment.TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    plan = environment.resolve("multi-gpu", devices=2)
    assert plan.device_ids == (2, 0) and plan.nprocs == 2 and plan.backend == "nccl"
