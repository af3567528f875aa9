"""fastpar's multi-node path across real nodes: one ``launch_agent`` per node (what ``fastpar.batch(...,
nodes=N)`` runs on each node) meeting at a c10d rendezvous on node 0's address, the workers training with the
Trainer's ``cluster`` environment on the nodes' shaped links. On gloo the parameters end bit-identical to one
agent with the same number of processes on one machine; the stores listen on node 0's address only; a node
that cannot reach the rendezvous fails in seconds naming the address; a node that dies fails the others in
seconds and the run resumes exactly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
from torch_teardown import aborted_at_teardown

from fastpar.launcher import free_port
from fastpar.nodes import NodeSlurm, slurm_available

pytestmark = pytest.mark.timeout(900)
REPO = Path(__file__).resolve().parents[2]
AGENT = REPO / "tests" / "support" / "node_agent.py"
SUBMIT = REPO / "tests" / "support" / "nodes_batch_submit.py"
RDZV_PORT = 29400


def _env(**extra: str) -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    return env | extra


def _agent_argv(nnodes: int, nproc: int, endpoint: str, run_id: str, out: Path, restarts: int = 0) -> list[str]:
    return [sys.executable, "-u", str(AGENT), str(nnodes), str(nproc), endpoint, run_id, str(out), str(restarts)]


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


def _one_machine(world: int, out: Path, **env: str) -> dict[str, torch.Tensor]:
    for _ in range(2):
        argv = _agent_argv(1, world, f"127.0.0.1:{free_port()}", uuid.uuid4().hex, out)
        agent = subprocess.Popen(argv, env=_env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if _finish([agent])[0]:
            return torch.load(out)
    raise AssertionError("aborted at teardown twice")


def _on_nodes(nodes, nproc: int, out: Path, **env: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    for _ in range(2):
        endpoint, run_id = f"{nodes[0].address}:{RDZV_PORT}", uuid.uuid4().hex
        agents = [
            node.popen(
                _agent_argv(len(nodes), nproc, endpoint, run_id, out),
                env=_env(**env),
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
    "count, nproc, backend",
    [
        (2, 1, "auto"),
        pytest.param(3, 1, "auto", marks=pytest.mark.slow),
        pytest.param(2, 2, "gloo", marks=pytest.mark.slow),
    ],
)
def test_nodes_train_bit_identical_to_one_machine(make_nodes, tmp_path, count, nproc, backend):
    """One rank per node: the fastpar backend is gloo between hosts, with gloo's bits as on one machine. Several
    ranks per node sum hierarchically by default (another order: the node-death test runs it); on gloo they match
    bit for bit."""
    env = {"FASTPAR_TEST_CPU_BACKEND": backend}
    reference = _one_machine(count * nproc, tmp_path / "one.pt", **env)
    nodes = make_nodes(count, link="1gbit")
    params, outputs = _on_nodes(nodes, nproc, tmp_path / "nodes.pt", **env)
    _assert_same(params, reference, f"{count} nodes x {nproc} and one machine with {count * nproc} processes")
    notice = [line for line in outputs[0].splitlines() if "store listens on" in line]
    assert notice and f"({nodes[0].address} only" in notice[0], outputs[0]


@pytest.mark.slow
def test_fastpar_batch_on_a_slurm_across_nodes_is_bit_identical_to_one_machine(make_nodes, tmp_path):
    """``fastpar.batch(script, nodes=2, processes_per_node=2, cluster="slurm")`` submitted from node 0 to a Slurm
    whose controller and daemons run on the nodes (NodeSlurm): one agent per node (task 0 on node0, task 1 on
    node1), meeting at the rendezvous on the allocation's first host by name; on gloo the trained parameters
    equal one machine's with 4 processes bit for bit."""
    ok, why = slurm_available()
    if not ok:
        pytest.skip(why)
    env = {"FASTPAR_TEST_CPU_BACKEND": "gloo"}
    reference = _one_machine(4, tmp_path / "one.pt", **env)
    nodes = make_nodes(2, link="1gbit")
    out = tmp_path / "batch.pt"
    with NodeSlurm(nodes, tmp_path / "slurm") as slurm:
        argv = [sys.executable, "-u", str(SUBMIT), "2", "2", str(out), str(tmp_path / "jobs")]
        done = nodes[0].run(argv, env=slurm.env(_env(**env)), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    _assert_same(torch.load(out), reference, "fastpar.batch on 2 Slurm nodes x 2 and one machine with 4 processes")
    logs = done.stdout.split("--- task 1 log ---")
    assert "hostname=node0" in logs[0] and "hostname=node1" in logs[1], done.stdout[-6000:]
    assert f"({nodes[0].address} only" in logs[1], logs[1]  # node 1's agent found node 0 by its name


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


def _timed_lines(proc: subprocess.Popen, into: list[tuple[float, str]]) -> threading.Thread:
    """Collect ``proc``'s output lines with the time each arrived."""

    def read() -> None:
        for line in proc.stdout:
            into.append((time.monotonic(), line.rstrip("\n")))

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def _workers_on(node) -> list[int]:
    """The training workers running on ``node`` (not its agent)."""
    pids = subprocess.run(["ip", "netns", "pids", node.netns], capture_output=True, text=True).stdout.split()
    found = []
    for pid in pids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(arg.endswith(b"cluster_train_script.py") for arg in argv):
            found.append(int(pid))
    return found


@pytest.mark.slow
def test_a_node_that_dies_fails_the_run_in_seconds_and_it_resumes_exactly(make_nodes, tmp_path):
    """2 nodes x 2 ranks, the Trainer's default CPU backend running hierarchically (every rank reports it). Node 1's
    training processes are killed mid-run: node 0's ranks fail within seconds with an error naming node 1's
    address (the leader's gloo connection is lost; its error reaches the node's other rank through shared memory),
    node 0's agent names the node that left, both agents restart their workers (max_restarts=1), the workers of
    both nodes resume from the last checkpoint on the shared folder, and the run ends bit-identical to an
    uninterrupted one on the same nodes."""
    nproc = 2
    nodes = make_nodes(2, link="1gbit")
    reference, outputs = _on_nodes(nodes, nproc, tmp_path / "uninterrupted.pt")
    statuses = [line for output in outputs for line in output.splitlines() if "backend status" in line]
    assert len(statuses) == 4 and all("'nodes': 2" in line for line in statuses), statuses
    checkpoints = tmp_path / "ck"
    env = _env(FASTPAR_TEST_CHECKPOINT_DIR=str(checkpoints), FASTPAR_TEST_STEP_SLEEP="0.25")
    # another port: the uninterrupted run's store port may still be held on node 0 (TIME_WAIT)
    endpoint, run_id = f"{nodes[0].address}:{RDZV_PORT + 1}", uuid.uuid4().hex
    out = tmp_path / "nodes.pt"
    agents = [
        node.popen(
            _agent_argv(2, nproc, endpoint, run_id, out, restarts=1),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in nodes
    ]
    lines: list[list[tuple[float, str]]] = [[], []]
    readers = [_timed_lines(agent, into) for agent, into in zip(agents, lines, strict=True)]
    try:
        deadline = time.monotonic() + 300
        while not (checkpoints / "ckpt-000000004.pt").exists():
            assert time.monotonic() < deadline and all(a.poll() is None for a in agents), lines
            time.sleep(0.02)
        victims = _workers_on(nodes[1])
        assert len(victims) == nproc, f"expected {nproc} training processes on node 1, found {victims}"
        killed_at = time.monotonic()
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        for agent in agents:
            agent.wait(timeout=300)
    finally:
        for agent in agents:
            agent.kill()
        for reader in readers:
            reader.join(timeout=30)
    output = ["\n".join(text for _, text in node_lines) for node_lines in lines]
    for agent, text in zip(agents, output, strict=True):
        if aborted_at_teardown(agent.returncode, text):
            pytest.skip("torch's gloo teardown abort (torch_teardown.py), not this test's subject")
        assert agent.returncode == 0, text[-6000:]
    after = [(t - killed_at, text) for t, text in lines[0] if t > killed_at]
    failed = [(dt, text) for dt, text in after if "failed:" in text and nodes[1].address in text]
    ranks_failed = {text.split(" on ")[0] for _, text in failed}
    assert len(ranks_failed) == nproc, f"not every rank of node 0 failed naming node 1:\n{output[0][-6000:]}"
    assert max(dt for dt, _ in failed) < 20, failed
    named = [dt for dt, text in after if f"node(s) {nodes[1].address} rejoined" in text]
    assert named and named[0] < 20, output[0][-6000:]
    assert any("resuming from" in text and "ckpt-" in text for _, text in after), output[0][-6000:]
    _assert_same(torch.load(out), reference, "the restarted run and an uninterrupted one")
