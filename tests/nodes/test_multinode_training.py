"""fastpar's multi-node path across real nodes: one ``launch_agent`` per node (what ``fastpar.batch(...,
nodes=N)`` runs on each node) meeting at a c10d rendezvous on node 0's address, the workers training with the
Trainer's ``cluster`` environment over gloo on the nodes' shaped links. The parameters end bit-identical to one
agent with the same number of processes on one machine; the stores listen on node 0's address only; a node
that cannot reach the rendezvous fails in seconds naming the address."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from torch_teardown import aborted_at_teardown

from fastpar.launcher import free_port

pytestmark = pytest.mark.timeout(900)
REPO = Path(__file__).resolve().parents[2]
AGENT = REPO / "tests" / "support" / "node_agent.py"
RDZV_PORT = 29400


def _env() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    return env


def _agent_argv(nnodes: int, nproc: int, endpoint: str, run_id: str, out: Path) -> list[str]:
    return [sys.executable, "-u", str(AGENT), str(nnodes), str(nproc), endpoint, run_id, str(out)]


def _finish(agents: list[subprocess.Popen]) -> tuple[bool, list[str]]:
    """Wait for every agent; (False, outputs) when one hit torch's teardown abort (torch_teardown.py)."""
    outputs, again = [], False
    for agent in agents:
        output, _ = agent.communicate(timeout=600)
        outputs.append(output)
        if aborted_at_teardown(agent.returncode, output):
            again = True
            continue
        assert agent.returncode == 0, output
    return not again, outputs


def _one_machine(world: int, out: Path) -> dict[str, torch.Tensor]:
    for _ in range(2):
        argv = _agent_argv(1, world, f"127.0.0.1:{free_port()}", uuid.uuid4().hex, out)
        agent = subprocess.Popen(argv, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if _finish([agent])[0]:
            return torch.load(out)
    raise AssertionError("aborted at teardown twice")


def _on_nodes(nodes, nproc: int, out: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    for _ in range(2):
        endpoint, run_id = f"{nodes[0].address}:{RDZV_PORT}", uuid.uuid4().hex
        agents = [
            node.popen(
                _agent_argv(len(nodes), nproc, endpoint, run_id, out),
                env=_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for node in nodes
        ]
        finished, outputs = _finish(agents)
        if finished:
            return torch.load(out), outputs
    raise AssertionError("aborted at teardown twice")


def _assert_same(params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], what: str) -> None:
    assert params.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(params[name], tensor), f"{name} differs between {what}"


@pytest.mark.parametrize(
    "count, nproc", [(2, 1), pytest.param(3, 1, marks=pytest.mark.slow), pytest.param(2, 2, marks=pytest.mark.slow)]
)
def test_nodes_train_bit_identical_to_one_machine(make_nodes, tmp_path, count, nproc):
    reference = _one_machine(count * nproc, tmp_path / "one.pt")
    nodes = make_nodes(count, link="1gbit")
    params, outputs = _on_nodes(nodes, nproc, tmp_path / "nodes.pt")
    _assert_same(params, reference, f"{count} nodes x {nproc} and one machine with {count * nproc} processes")
    notice = [line for line in outputs[0].splitlines() if "store listens on" in line]
    assert notice and f"({nodes[0].address} only" in notice[0], outputs[0]


def test_the_stores_listen_on_node_0s_address_only(make_nodes):
    """The rendezvous store (the endpoint) and the workers' store (rank 0's node): no wildcard listener."""
    nodes = make_nodes(2, link=None)
    probe = (
        "import subprocess, sys\n"
        "from torch.distributed.elastic.rendezvous import RendezvousParameters\n"
        "from fastpar.rendezvous import bound_rendezvous_handler\n"
        f"params = RendezvousParameters('c10d', '{nodes[0].address}:{RDZV_PORT}', 'probe', 1, 1)\n"
        "handler = bound_rendezvous_handler(params)\n"
        "info = handler.next_rendezvous()\n"
        "print(info.bootstrap_store_info.master_addr, flush=True)\n"
        "print(subprocess.run(['ss', '-ltnH'], capture_output=True, text=True).stdout, flush=True)\n"
    )
    done = nodes[0].run([sys.executable, "-c", probe], env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == nodes[0].address  # what the workers are told, found from the routes (no name lookup)
    listening = [line.split()[3] for line in lines[1:] if line.strip()]
    assert f"{nodes[0].address}:{RDZV_PORT}" in listening
    assert len(listening) >= 2 and all(addr.startswith(nodes[0].address + ":") for addr in listening), listening


@pytest.mark.parametrize("where", ["no route", "no host"])
def test_a_node_that_cannot_reach_the_rendezvous_fails_in_seconds_naming_it(make_nodes, tmp_path, where):
    nodes = make_nodes(2, link=None)
    host = "10.214.0.1" if where == "no route" else "10.213.0.99"  # another network; no node has .99
    start = time.monotonic()
    done = nodes[1].run(
        _agent_argv(2, 1, f"{host}:{RDZV_PORT}", "r", tmp_path / "x.pt"),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    seconds = time.monotonic() - start
    assert done.returncode != 0
    assert f"{host}:{RDZV_PORT}" in done.stderr or f"{host} ({host})" in done.stderr, done.stderr[-2000:]
    assert "cannot reach" in done.stderr or "no route" in done.stderr, done.stderr[-2000:]
    assert seconds < 30, f"took {seconds:.0f} s to fail"
