"""/sys readers on a fake tree, the NVML adapter with recorded values, discover(), --env and the CLI."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from fastpar import cli
from fastpar.topology import Topology, build_env, discover, parse_nvidia_smi, select_devices, sysfs
from fastpar.topology.nvml import NvmlUnavailable, read_nvml

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "topo"


def main(argv: list[str]) -> int:
    """``fastpar topo ARGV`` as the command runs it (its errors: one line, exit status 2)."""
    return cli.main(["topo", *argv])


GPU0_DEV = "devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0"  # behind a switch
NIC_DEV = "devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:04:00.0"  # same switch
GPU1_DEV = "devices/pci0000:80/0000:80:01.0/0000:81:00.0"  # other socket
ETH_DEV = "devices/pci0000:00/0000:00:03.0"


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def link(link_path: Path, target: Path) -> None:
    link_path.parent.mkdir(parents=True, exist_ok=True)
    target.mkdir(parents=True, exist_ok=True)
    os.symlink(target, link_path)


@pytest.fixture
def fake_root(tmp_path: Path) -> Path:
    """2 sockets x 2 cores, GPUs at 03:00.0 (node 0) and 81:00.0 (node 1), mlx5_0 beside GPU0, NICs."""
    s = tmp_path / "sys"
    write(s / "devices/system/cpu/online", "0-3")
    for cpu, (pkg, core) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        write(s / f"devices/system/cpu/cpu{cpu}/topology/physical_package_id", str(pkg))
        write(s / f"devices/system/cpu/cpu{cpu}/topology/core_id", str(core))
    write(s / "devices/system/node/node0/cpulist", "0-1")
    write(s / "devices/system/node/node1/cpulist", "2-3")
    for dev, numa in ((GPU0_DEV, 0), (GPU1_DEV, 1), (NIC_DEV, 0), (ETH_DEV, 0)):
        write(s / dev / "numa_node", str(numa))
        link(s / "bus/pci/devices" / dev.rsplit("/", 1)[-1], s / dev)
    # eth0: physical, default route; eth1: physical, faster, no default route; docker0/lo: virtual.
    for name, dev, state, speed in (
        ("eth0", ETH_DEV, "up", "25000"),
        ("eth1", ETH_DEV, "up", "100000"),
        ("docker0", "devices/virtual", "up", ""),
        ("lo", "devices/virtual", "unknown", ""),
    ):
        target = s / dev / "net" / name
        write(target / "operstate", state)
        if speed:
            write(target / "speed", speed)
        if dev != "devices/virtual":
            link(target / "device", s / dev)
        link(s / "class/net" / name, target)
    ib = s / NIC_DEV / "infiniband/mlx5_0"
    write(ib / "ports/1/state", "4: ACTIVE")
    write(ib / "ports/1/rate", "200 Gb/sec (4X HDR)")
    link(ib / "device", s / NIC_DEV)
    (s / NIC_DEV / "net/ib0").mkdir(parents=True)
    link(s / "class/infiniband/mlx5_0", ib)
    write(
        tmp_path / "proc/net/route",
        "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"
        "docker0\t000011AC\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0\n"
        "eth1\t0000000A\t00000000\t0001\t0\t0\t0\t000000FF\t0\t0\t0\n"
        "eth0\t00000000\t0102A8C0\t0003\t0\t0\t100\t00000000\t0\t0\t0\n"
        "eth0\t0002A8C0\t00000000\t0001\t0\t0\t100\t00FFFFFF\t0\t0\t0",
    )
    write(tmp_path / "proc/net/if_inet6", "fe80000000000000020000fffe000001 02 40 20 80     eth0")
    return tmp_path


def test_cpu_and_numa_readers(fake_root):
    assert sysfs.read_cpus(str(fake_root)) == ([0, 1, 2, 3], 4, 2)
    nodes = sysfs.read_numa_nodes(str(fake_root))
    assert [(n.id, n.cpus) for n in nodes] == [(0, [0, 1]), (1, [2, 3])]
    assert sysfs.read_cpus("/nonexistent") == ([], None, None) and sysfs.read_numa_nodes("/nonexistent") == []


def test_net_and_rdma_readers(fake_root):
    nics = {n.name: n for n in sysfs.read_net_interfaces(str(fake_root))}
    assert nics["eth0"].state == "up" and nics["eth0"].speed_mbps == 25000 and nics["eth0"].families == ["ipv4", "ipv6"]
    assert nics["eth0"].pci_bus_id == "0000:00:03.0" and nics["eth0"].numa_node == 0 and not nics["eth0"].virtual
    assert nics["docker0"].virtual and nics["lo"].virtual and nics["eth1"].families == ["ipv4"]
    assert sysfs.read_default_route(str(fake_root)) == "eth0"
    (rdma,) = sysfs.read_rdma_devices(str(fake_root))
    assert (rdma.name, rdma.state, rdma.speed_mbps, rdma.numa_node, rdma.netdevs) == (
        "mlx5_0",
        "ACTIVE",
        200000,
        0,
        ["ib0"],
    )
    assert rdma.pci_bus_id == "0000:04:00.0"


def test_pci_path_classes(fake_root):
    root = str(fake_root)
    gpu0, gpu1, nic = (sysfs.pci_device_path(root, b) for b in ("0000:03:00.0", "0000:81:00.0", "0000:04:00.0"))
    assert sysfs.pci_path_class(gpu0, nic, 0, 0) == "PIX"
    assert sysfs.pci_path_class(gpu1, nic, 1, 0) == "SYS"
    assert sysfs.pci_path_class(gpu1, nic, 0, 0) == "NODE"
    eth = sysfs.pci_device_path(root, "0000:00:03.0")
    assert sysfs.pci_path_class(gpu0, eth, 0, 0) == "PHB"
    deep = "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:02.0/0000:05:00.0/0000:06:00.0/0000:07:00.0"
    assert sysfs.pci_path_class(gpu0, deep, 0, 0) == "PXB"


class FakeNvml:
    """pynvml-shaped object fed with recorded values: 2 GPUs; NVLinks direct or through NVSwitches."""

    NVML_NVLINK_MAX_LINKS = 4
    NVML_P2P_CAPS_INDEX_READ = (0,)  # pynvml really defines it as a 1-tuple

    def __init__(self, *, nvswitch=False, fail_init=None):
        self.fail_init, self.nvswitch, self.shutdown = fail_init, nvswitch, False
        self.bus = ["00000000:03:00.0", "00000000:81:00.0"]

    def nvmlInit(self):
        if self.fail_init:
            raise self.fail_init

    def nvmlShutdown(self):
        self.shutdown = True

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlSystemGetDriverVersion(self):
        return b"570.133.20"

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return "NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h}"

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=self.bus[h].encode())

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=80 * 2**30, used=(0 if h == 0 else 30) * 2**30)

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [] if h == 0 else [object(), object()]

    def nvmlDeviceGetGraphicsRunningProcesses(self, h):
        raise RuntimeError("NVMLError_NotSupported")

    def nvmlDeviceGetCpuAffinity(self, h, words):
        return [0b0011 if h == 0 else 0b1100]

    def nvmlDeviceGetNumaNodeId(self, h):
        raise RuntimeError("NVMLError_NotSupported")  # old driver: discover() must use /sys instead

    def nvmlDeviceGetNvLinkState(self, h, link):
        return 1 if link < 3 else 0

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        remote = "00000000:C0:00.0" if self.nvswitch else self.bus[1 - h]
        return SimpleNamespace(busId=remote)

    def nvmlDeviceGetNvLinkVersion(self, h, link):
        return 4

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return 50  # NVML_TOPOLOGY_SYSTEM

    def nvmlDeviceGetP2PStatus(self, a, b, index):
        assert index == 0
        return 0


@pytest.mark.parametrize("nvswitch", [False, True])
def test_nvml_adapter_with_recorded_values(nvswitch):
    fake = FakeNvml(nvswitch=nvswitch)
    gpus, links, driver = read_nvml(fake)
    assert driver == "570.133.20" and fake.shutdown
    assert [(g.index, g.pci_bus_id, g.memory_used_mib, g.processes) for g in gpus] == [
        (0, "00000000:03:00.0", 0, 0),
        (1, "00000000:81:00.0", 30 * 1024, 2),
    ]
    assert gpus[0].cpu_affinity == [0, 1] and gpus[1].cpu_affinity == [2, 3]
    (ln,) = links
    assert (ln.nvlinks, ln.nvlink_version, ln.pcie, ln.p2p, ln.label) == (3, 4, "SYS", "OK", "NV3")


def test_nvml_missing_says_why():
    class NVMLError_LibraryNotFound(Exception):
        pass

    with pytest.raises(NvmlUnavailable, match="libnvidia-ml.so.*not installed"):
        read_nvml(FakeNvml(fail_init=NVMLError_LibraryNotFound("NVML Shared Library Not Found")))


def test_discover_with_nvml_and_fake_sys(fake_root):
    t = discover(root=str(fake_root), nvml=FakeNvml())
    assert [g.numa_node for g in t.gpus] == [0, 1]  # filled from /sys/bus/pci/devices/*/numa_node
    rdma = t.rdma_nics[0]
    assert rdma.gpu_paths == {0: "PIX", 1: "SYS"}
    assert t.default_route == "eth0" and t.cpus == [0, 1, 2, 3] and t.sockets == 2
    assert Topology.from_json(t.to_json()) == t
    # GPU1 is busy (2 processes, 30 GiB): a single free GPU is all there is.
    assert select_devices(1, t) == [0]
    with pytest.raises(ValueError, match="GPU1: 2 processes, 30720 MiB used"):
        select_devices(2, t)


def test_discover_without_nvml_still_reports_cpus_numa_nics(fake_root):
    t = discover(root=str(fake_root), nvml=FakeNvml(fail_init=RuntimeError("driver gone")))
    assert t.gpus == [] and t.gpu_status.startswith("no NVIDIA GPU/driver found") and "driver gone" in t.gpu_status
    assert len(t.numa_nodes) == 2 and {n.name for n in t.nics} >= {"eth0", "mlx5_0"}


def _eval_in_bash(lines: list[str], env: dict[str, str]) -> dict[str, str]:
    """Run the lines through bash's eval, as a user would, and return the resulting environment."""
    done = subprocess.run(
        ["bash", "-c", 'eval "$(cat)" && env -0'], input="\n".join(lines), capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    return dict(item.split("=", 1) for item in done.stdout.split("\0") if "=" in item)


def test_env_is_evalable_and_picks_the_default_route_interface(fake_root):
    t = discover(root=str(fake_root), nvml=FakeNvml())
    sel = select_devices(2, t, exclude_busy=False, explain=True)
    environ = {"NCCL_P2P_DISABLE": "1", "PATH": os.environ["PATH"]}
    lines = build_env(t, sel, environ=environ, network=t)
    assert all(line.startswith(("# ", "export ")) for line in lines)
    assert any(line.startswith("# WARNING: NCCL_P2P_DISABLE=1") for line in lines)
    env = _eval_in_bash(lines, {"PATH": os.environ["PATH"]})
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["NCCL_SOCKET_IFNAME"] == "=eth0"  # default route beats the faster eth1; docker0/lo never
    assert env["GLOO_SOCKET_IFNAME"] == "eth0"
    assert env["NCCL_IB_HCA"] == "=mlx5_0"  # PIX to GPU0; nothing on GPU1's socket
    assert env["FASTPAR_RANK_NUMA"] == "0,1"


def test_env_from_saved_output_warns_about_one_socket_nics():
    t = parse_nvidia_smi((FIXTURES / "rtx4090_8x_nic_no_legend.txt").read_text(), source="x")
    lines = build_env(t, select_devices(8, t, explain=True), environ={}, network=None, network_note="another machine")
    text = "\n".join(lines)
    assert "# WARNING: all RDMA NICs sit on NUMA node 1; GPUs 0,1,2,3" in text
    assert "# NCCL_SOCKET_IFNAME: not set (another machine)" in text and "export NCCL_IB_HCA" not in text
    env = _eval_in_bash(lines, {"PATH": os.environ["PATH"]})
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7" and "NCCL_SOCKET_IFNAME" not in env


def test_cli_on_this_machine_and_from_file(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert (
        "CPUs:" in out and "NUMA nodes" in out and ("GPUs: none. no NVIDIA GPU/driver found" in out or "GPUs (" in out)
    )
    dgx = str(FIXTURES / "hgx_h100_nvswitch_nic_legend.txt")
    assert main(["--from", dgx, "--select", "4"]) == 0
    out = capsys.readouterr().out
    assert "selected GPUs 0,1,2,3" in out and "NV18" in out and "Legend:" in out
    assert main(["--from", dgx, "--matrix"]) == 0 and "mlx5_7" in capsys.readouterr().out
    assert main(["--from", dgx, "--json", "--select", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["selection"]["devices"] == [0, 1] and len(data["gpus"]) == 8
    assert main(["--from", dgx, "--select", "9"]) == 2
    assert "only 8 of 8 are available" in capsys.readouterr().err


ALL_FIXTURES = sorted(FIXTURES.glob("*.txt"))


@pytest.mark.parametrize("path", ALL_FIXTURES, ids=lambda p: p.name)
def test_cli_every_mode_on_every_fixture(path, capsys, monkeypatch):
    monkeypatch.setattr("fastpar.topology.cli.discover", lambda: Topology(source="sysfs"))  # no /sys reads here
    gpus = len(parse_nvidia_smi(path.read_text()).gpus)
    for mode in ([], ["--matrix"], ["--json"], ["--select", "1"], ["--select", str(gpus), "--json"]):
        assert main(["--from", str(path), *mode]) == 0, mode
    out = capsys.readouterr().out
    assert "Traceback" not in out and json.loads(out[out.rindex('{\n  "gpus"') :])["selection"]["devices"]
    assert main(["--from", str(path), "--select", str(min(2, gpus)), "--env"]) == 0
    env = _eval_in_bash(capsys.readouterr().out.splitlines(), {"PATH": os.environ["PATH"]})
    assert len(env["CUDA_VISIBLE_DEVICES"].split(",")) == min(2, gpus)
    assert main(["--from", str(path), "--select", str(gpus + 1)]) == 2
    assert main(["--from", str(path), "--select", "0"]) == 2
    assert "at least 1" in capsys.readouterr().err


def test_cli_reads_utf16_and_bom_files_and_rejects_empty_binary_missing(tmp_path, capsys):
    text = (FIXTURES / "rtx5090_2x_phb.txt").read_text()
    (tmp_path / "ps.txt").write_bytes(text.encode("utf-16"))  # Windows PowerShell `>` writes UTF-16 with BOM
    (tmp_path / "bom.txt").write_bytes(text.encode("utf-8-sig"))
    for name in ("ps.txt", "bom.txt"):
        assert (
            main(["--from", str(tmp_path / name), "--select", "2"]) == 0
            and "selected GPUs 0,1" in capsys.readouterr().out
        )
    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "blob.bin").write_bytes(bytes(range(128, 256)) * 3)
    (tmp_path / "notes.txt").write_text("hello\n")
    for name, message in [
        ("empty.txt", "is empty; save the output of `nvidia-smi topo -m`"),
        ("blob.bin", "is not text"),
        ("notes.txt", "no header line naming GPU0"),
        ("missing.txt", "No such file"),
    ]:
        assert main(["--from", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("fastpar topo: error: ") and message in err and "Traceback" not in err
        assert len(err.splitlines()) == 1


def test_cli_json_with_env_carries_the_settings(capsys):
    dgx = str(FIXTURES / "hgx_h100_nvswitch_nic_legend.txt")
    assert main(["--from", dgx, "--select", "2", "--env"]) == 0
    exported = _eval_in_bash(capsys.readouterr().out.splitlines(), {"PATH": os.environ["PATH"]})
    assert main(["--from", dgx, "--select", "2", "--env", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["selection"]["devices"] == [0, 1] and data["env"]["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert {k: exported[k] for k in data["env"]} == data["env"]  # the values --env exports, exactly
    assert any("NCCL_SOCKET_IFNAME" in note for note in data["env_notes"])
