"""The stores of local groups and agents listen on loopback only; a multi-node run says where its store listens.

Whoever reaches a rendezvous store can read its keys (the shared-memory plan among them) and, through the
rendezvous state torch's elastic agent unpickles, run code in the agent. The listening addresses are read from
the socket table (/proc/net/tcp, /proc/net/tcp6); no traffic goes anywhere but loopback.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from pathlib import Path

import torch

from fastpar import launcher

_LISTEN = "0A"


def _address(hex_address: str) -> str:
    """An address of /proc/net/tcp{,6} (the kernel's words, in host byte order) as text."""
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, struct.pack("=I", int(hex_address, 16)))
    words = struct.unpack(">4I", raw)
    return socket.inet_ntop(socket.AF_INET6, struct.pack("=4I", *words))


def _listening() -> list[tuple[str, int, str]]:
    """(address, port, socket inode) of every listening TCP socket on this machine."""
    rows = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == _LISTEN:
                address, port = fields[1].split(":")
                rows.append((_address(address), int(port, 16), fields[9]))
    return rows


def listening_on(port: int) -> list[str]:
    """The bound addresses of the sockets listening on ``port``."""
    return [address for address, bound, _ in _listening() if bound == port]


def listening_of(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every socket process ``pid`` listens on."""
    fd_dir = Path(f"/proc/{pid}/fd")
    inodes = set()
    for fd in fd_dir.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return [(address, port) for address, port, inode in _listening() if inode in inodes]


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


def _not_loopback(addresses) -> list:
    return [a for a in addresses if not is_loopback(a if isinstance(a, str) else a[0])]


# --- run in the ranks (module level: spawned processes import it) -----------------------------------
def _spawned_probe(rank: int, world_size: int) -> dict:
    torch.distributed.barrier()  # every rank connected: the store is up
    return {
        "store": listening_on(int(os.environ["MASTER_PORT"])),
        "mine": listening_of(os.getpid()),
        "parent": listening_of(os.getppid()),
    }


def _agent_probe(rendezvous_port: int | None) -> dict:
    return {
        "workers_store": listening_on(int(os.environ["MASTER_PORT"])),
        "rendezvous_store": listening_on(rendezvous_port) if rendezvous_port else None,
        "agent": listening_of(os.getppid()),
    }


class _ProbingLoss:
    """Cross-entropy that fails the run when a store of this run listens beyond loopback."""

    def __call__(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        workers_store = listening_on(int(os.environ["MASTER_PORT"]))
        agent = listening_of(os.getppid())
        assert workers_store, "the workers' store is not listening"
        bad = _not_loopback(workers_store) + _not_loopback(agent)
        assert not bad, f"the Trainer's stores listen beyond loopback: {bad}"
        return torch.nn.functional.cross_entropy(out, y)


# --- local groups -------------------------------------------------------------------------------------
def test_loopback_store_listens_on_loopback_only():
    store = launcher.loopback_store(10.0)
    assert listening_on(store.port) == ["127.0.0.1"]
    client = torch.distributed.TCPStore(launcher.LOOPBACK, store.port, None, False)
    client.set("k", "v")
    assert store.get("k") == b"v"


def test_spawned_group_store_listens_on_loopback_only():
    results = launcher.spawn(_spawned_probe, 2, backend="gloo", timeout=240)
    stores = [address for result in results for address in result["store"]]
    assert stores, "no socket listens on the group's store port"
    for result in results:
        assert not _not_loopback(result["store"]), result
        assert not _not_loopback(result["mine"]), result
        assert not _not_loopback(result["parent"]), result


def test_agent_stores_listen_on_loopback_only():
    port = launcher.free_port()
    results = launcher.launch_agent(
        _agent_probe, (port,), nproc_per_node=2, rdzv_endpoint=f"{launcher.LOOPBACK}:{port}"
    )
    assert sorted(results) == [0, 1]
    for result in results.values():
        assert result["rendezvous_store"], "the rendezvous store is not listening on its endpoint's port"
        assert result["workers_store"], "the workers' store is not listening"
        assert not _not_loopback(result["rendezvous_store"]), result
        assert not _not_loopback(result["workers_store"]), result
        assert not _not_loopback(result["agent"]), result


def test_trainer_local_run_stores_listen_on_loopback_only(tmp_path):
    from fastpar.train import Trainer, TrainingOptions

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g)
    options = TrainingOptions(
        max_epochs=1,
        batch_size=16,
        execution_environment="cpu",
        devices=2,
        cpu_backend="gloo",
        output_dir=str(tmp_path / "out"),
        progress_bar=False,
    )
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    result = Trainer(model, optimizer, _ProbingLoss(), (x, y), options=options).fit()
    assert result.steps == 2


# --- multi-node runs ------------------------------------------------------------------------------------
def test_multi_node_agent_says_where_its_store_listens(monkeypatch, capsys):
    launched = {}

    def fake_elastic_launch(config, target):
        launched["config"] = config
        return lambda *args: {0: None}

    monkeypatch.setattr("torch.distributed.launcher.api.elastic_launch", fake_elastic_launch)
    launcher.launch_agent(
        "python", ("x.py",), nproc_per_node=1, nnodes=2, rdzv_endpoint="node1:29411", run_id="r", local_addr="10.0.0.5"
    )
    lines = [line for line in capsys.readouterr().err.splitlines() if "node1:29411" in line]
    assert len(lines) == 1, lines
    assert "trusted" in lines[0]
    assert launched["config"].rdzv_endpoint == "node1:29411"


def test_local_agent_prints_no_network_notice(monkeypatch, capsys):
    monkeypatch.setattr("torch.distributed.launcher.api.elastic_launch", lambda config, target: lambda *a: {0: None})
    launcher.launch_agent("python", ("x.py",), nproc_per_node=1)
    assert "trusted" not in capsys.readouterr().err


def test_local_agent_run_id_is_random(monkeypatch):
    run_ids = []

    def fake_elastic_launch(config, target):
        run_ids.append(config.run_id)
        return lambda *args: {0: None}

    monkeypatch.setattr("torch.distributed.launcher.api.elastic_launch", fake_elastic_launch)
    for _ in range(2):
        launcher.launch_agent("python", ("x.py",), nproc_per_node=1)
    assert run_ids[0] != run_ids[1]
    assert all(len(run_id.rsplit("-", 1)[1]) >= 32 for run_id in run_ids), run_ids


def test_trainer_cluster_environment_says_where_the_store_listens(monkeypatch, capsys):
    from fastpar.train import environment

    torchrun = {"RANK": "0", "WORLD_SIZE": "16", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8"}
    for name, value in {**torchrun, "MASTER_ADDR": "node1", "MASTER_PORT": "29433"}.items():
        monkeypatch.setenv(name, value)
    plan = environment.resolve("cluster")
    assert plan.kind == "cluster"
    lines = [line for line in capsys.readouterr().err.splitlines() if "node1:29433" in line]
    assert len(lines) == 1, lines
    assert "trusted" in lines[0]
