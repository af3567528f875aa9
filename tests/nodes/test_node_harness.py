"""The node harness itself: each node has its own address, hostname and /dev/shm, reaches the others only
through the switch, its links carry no more than their rate, and nothing is left behind afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from fastpar.nodes import NodeCluster, NodeSlurm, link_rate_bits, remove_stale, slurm_available
from fastpar.nodes.harness import PREFIX

SINK = """
import socket, sys, time
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
got = 0
while chunk := conn.recv(1 << 20):
    got += len(chunk)
print(got, flush=True)
"""
SEND = """
import socket, sys, time
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])))
start = time.perf_counter()
conn.sendall(b"x" * int(sys.argv[3]))
conn.shutdown(socket.SHUT_WR)
conn.recv(1)  # the sink closes after reading everything: the bytes have crossed
print(time.perf_counter() - start, flush=True)
"""


def _ours() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    return [line.split()[0] for line in listed if line.startswith(f"{PREFIX}-{os.getpid()}-")]


def _transfer_seconds(nodes: NodeCluster, nbytes: int) -> float:
    sink = nodes[1].popen([sys.executable, "-c", SINK, nodes[1].address], stdout=subprocess.PIPE, text=True)
    port = sink.stdout.readline().strip()
    send = nodes[0].run(
        [sys.executable, "-c", SEND, nodes[1].address, port, str(nbytes)], capture_output=True, text=True, timeout=120
    )
    assert send.returncode == 0, send.stderr
    assert int(sink.stdout.readline()) == nbytes
    sink.wait(timeout=30)
    return float(send.stdout)


def test_nodes_have_their_own_address_hostname_and_shared_memory(make_nodes):
    nodes = make_nodes(3, link=None)
    marker = f"fastpar-node-test-{os.getpid()}"
    nodes[0].run(["sh", "-c", f"echo here > /dev/shm/{marker}"], check=True)
    for node in nodes:
        seen = node.run(
            ["sh", "-c", "hostname; ip -o -4 addr show dev eth0; ls /dev/shm"], capture_output=True, text=True
        ).stdout.splitlines()
        assert seen[0] == node.hostname == f"node{node.index}"
        assert f" {node.address}/24 " in seen[1]
        assert (marker in seen[2:]) == (node.index == 0), "a node saw another node's /dev/shm"
    assert not os.path.exists(f"/dev/shm/{marker}"), "a node's /dev/shm is the host's"
    # the same node: a second process sees the first one's file
    assert nodes[0].run(["cat", f"/dev/shm/{marker}"], capture_output=True, text=True).stdout == "here\n"
    reach = nodes[2].run(
        [sys.executable, "-c", f"import socket; socket.create_connection(('{nodes[0].address}', 9), 2)"],
        capture_output=True,
        text=True,
    )
    assert "ConnectionRefused" in reach.stderr, "node 2 does not reach node 0 through the switch"
    names = nodes[2].run(["getent", "hosts", "node0", "node1"], capture_output=True, text=True).stdout.split()
    assert names == [nodes[0].address, "node0", nodes[1].address, "node1"], "nodes do not resolve each other"


def test_a_shaped_link_takes_at_least_its_bytes_over_its_rate(make_nodes):
    nodes = make_nodes(2, link="200mbit")
    nbytes = 10_000_000
    floor = nodes.link_seconds(nbytes)
    assert floor == pytest.approx(0.4)
    seconds = _transfer_seconds(nodes, nbytes)
    burst = max(64 * 1024, link_rate_bits("200mbit") / 8 / 1000)
    assert seconds >= nodes.link_seconds(nbytes - 2 * burst), f"{nbytes} bytes in {seconds:.3f} s beat 200 Mbit/s"
    assert seconds < 20 * floor, f"{nbytes} bytes took {seconds:.3f} s at 200 Mbit/s: the link is not at its rate"


def test_everything_is_removed_after_an_error_inside(node_support):
    with pytest.raises(RuntimeError, match="inside"):
        with NodeCluster(2, link="1gbit") as nodes:
            sleeper = nodes[0].popen(["sleep", "600"])
            assert len(_ours()) == 3  # two nodes and the switch
            raise RuntimeError("inside")
    assert _ours() == []
    assert sleeper.wait(timeout=10) != 0, "a process started on a node outlived the cluster"


def test_a_dead_owners_namespaces_are_removed_by_the_next_harness(node_support, tmp_path):
    script = (
        "import os, sys\n"
        "from fastpar.nodes import NodeCluster\n"
        "nodes = NodeCluster(2, link=None).__enter__()\n"
        "print(nodes.tag, flush=True)\n"
        "os._exit(0)  # no teardown: a test run killed half-way\n"
    )
    left = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    tag = left.stdout.strip()
    assert tag.startswith(PREFIX), left.stderr
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"{tag}-n0" in listed
    removed = remove_stale()
    assert {f"{tag}-sw", f"{tag}-n0", f"{tag}-n1"} <= set(removed)
    assert tag not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not list(Path(tempfile.gettempdir()).glob(f"{tag}-hosts-*")), "the dead owner's hosts file was left"


def test_a_slurm_over_the_nodes_runs_a_step_on_each_and_stops_with_the_block(make_nodes, tmp_path):
    ok, why = slurm_available()
    if not ok:
        pytest.skip(why)
    nodes = make_nodes(2, link=None)
    with NodeSlurm(nodes, tmp_path / "slurm") as slurm:
        done = slurm.run(["srun", "--nodes=2", "--ntasks-per-node=1", "hostname"], timeout=60)
        assert done.returncode == 0, done.stderr
        assert sorted(done.stdout.split()) == ["node0", "node1"]
        assert _programs_on(nodes[0]) >= {"slurmctld", "slurmd"} and "slurmd" in _programs_on(nodes[1])
    assert not _programs_on(nodes[0]) & {"slurmctld", "slurmd"} and "slurmd" not in _programs_on(nodes[1])


def _programs_on(node) -> set[str]:
    """The names of the programs running in ``node``'s network namespace."""
    pids = subprocess.run(["ip", "netns", "pids", node.netns], capture_output=True, text=True).stdout.split()
    names = set()
    for pid in pids:
        try:
            names.add(Path(f"/proc/{pid}/comm").read_text().strip())
        except OSError:
            pass
    return names


def test_slurm_needs_nodes_that_are_up(tmp_path):
    with pytest.raises(ValueError, match="enter it first"):
        NodeSlurm(NodeCluster(2), tmp_path)


def test_a_bad_rate_is_refused_with_the_form_to_use():
    with pytest.raises(ValueError, match="'1gbit'"):
        NodeCluster(2, link="1 gigabit")


def test_the_command_line_runs_a_command_on_every_node_and_leaves_nothing(node_support):
    command = ["sh", "-c", 'echo "$FASTPAR_NODE/$FASTPAR_NODES $(hostname) $FASTPAR_NODE0_ADDRESS"; exit $FASTPAR_NODE']
    run = subprocess.Popen(
        [sys.executable, "-m", "fastpar.nodes", "2", "--link", "none", "--", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = run.communicate(timeout=120)
    assert sorted(out.split("\n")[:2]) == ["0/2 node0 10.213.0.1", "1/2 node1 10.213.0.1"], out
    assert run.returncode == 1 and "node1 (10.213.0.2) exited with status 1" in err, err
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"{PREFIX}-{run.pid}-" not in listed


def test_the_command_line_holds_the_nodes_until_it_is_stopped(node_support):
    up = subprocess.Popen(
        [sys.executable, "-m", "fastpar.nodes", "2", "--link", "100mbit"], stdout=subprocess.PIPE, text=True
    )
    try:
        lines = [up.stdout.readline().strip() for _ in range(3)]
        assert lines[0].startswith("node0 10.213.0.1: nsenter -t ") and lines[0].endswith(" bash"), lines
        assert lines[2] == "links: 100mbit; Ctrl-C takes everything down", lines
        entered = subprocess.run([*lines[1].split(": ", 1)[1].split()[:-1], "hostname"], capture_output=True, text=True)
        assert entered.stdout.strip() == "node1", entered.stderr
        mine = f"{PREFIX}-{up.pid}-"
        assert mine in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    finally:
        up.terminate()
        status = up.wait(timeout=60)
    assert status == 130
    assert mine not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
