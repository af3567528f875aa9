"""Several nodes on one Linux machine: each a network + UTS + mount namespace with its own address, hostname
and ``/dev/shm``, all joined to one switch (a bridge in a namespace of its own) through veth pairs shaped by
``tc tbf`` to a chosen rate in both directions.

Nothing touches the host's own network: the links are created inside the namespaces, the addresses are
private to them, and every name carries the owner's pid so that a later harness removes what a killed one
left (``remove_stale``). Needs root (``CAP_SYS_ADMIN`` + ``CAP_NET_ADMIN``), ``ip``, ``tc``, ``unshare`` and
``nsenter``; ``available()`` says why not where they are missing.

    with NodeCluster(2, link="1gbit") as nodes:
        server = nodes[1].popen([sys.executable, "serve.py", nodes[1].address])
        nodes[0].run([sys.executable, "send.py", nodes[1].address])
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "fpn"  # every namespace this harness makes: fpn-<owner pid>-<serial>-<n0|n1|...|sw>
SUBNET = "10.213.0"  # node i is 10.213.0.(i + 1)/24 inside its own namespace: no host route can clash
SPOOL_PREFIX = "fpslurm-"  # NodeSlurm's spool folders: fpslurm-<owner pid>-<random>, in the temporary folder
_serial = itertools.count()
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit)\s*$", re.IGNORECASE)
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


class NodeHarnessError(RuntimeError):
    """Namespaces, links or shaping could not be made; the message names the command and what it printed."""


def link_rate_bits(link: str) -> float:
    """``"1gbit"`` -> 1e9 bits/s (tc's units, decimal)."""
    match = _RATE.match(link)
    if not match:
        raise ValueError(f"link rate {link!r} is not a tc rate: write e.g. '100mbit', '1gbit' or '10gbit'")
    return float(match.group(1)) * _UNITS[match.group(2).lower()]


def available() -> tuple[bool, str]:
    """Whether this machine can make nodes, and why not: probes by making (and removing) one namespace."""
    if os.name != "posix" or not os.path.isdir("/proc/self/ns"):
        return False, "node namespaces need Linux"
    missing = [tool for tool in ("ip", "tc", "unshare", "nsenter") if shutil.which(tool) is None]
    if missing:
        return False, f"node namespaces need {', '.join(missing)} on PATH (iproute2, util-linux)"
    if os.geteuid() != 0:
        return False, "node namespaces need root (CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    probe = f"{PREFIX}-{os.getpid()}-probe{next(_serial)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return False, f"`ip netns add` failed here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return True, ""


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode:
        raise NodeHarnessError(f"`ip {' '.join(args)}` failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def _netns_names() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def _kill_netns_processes(netns: str) -> None:
    """SIGKILL every process whose network namespace is ``netns`` (its holders and anything started on it)."""
    for _ in range(50):
        pids = [
            int(p)
            for p in subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout.split()
        ]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Remove the namespaces (with their processes and links) of harnesses whose owner process is gone."""
    removed = []
    for netns in _netns_names():
        parts = netns.split("-")
        if len(parts) >= 3 and parts[0] == PREFIX and parts[1].isdigit() and not _pid_alive(int(parts[1])):
            _kill_netns_processes(netns)
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
            removed.append(netns)
    tmp = Path(tempfile.gettempdir())
    for left in [*tmp.glob(f"{PREFIX}-*-hosts-*"), *tmp.glob(f"{SPOOL_PREFIX}*-*")]:
        owner = left.name.split("-")[1]
        if not owner.isdigit() or _pid_alive(int(owner)):
            continue
        if left.is_dir():
            shutil.rmtree(left, ignore_errors=True)
        else:
            left.unlink(missing_ok=True)
    return removed


@dataclass
class Node:
    """One node: a network namespace with ``eth0`` at ``address``, and a holder process whose UTS and mount
    namespaces (hostname, private ``/dev/shm``) every process started on the node enters."""

    index: int
    netns: str
    hostname: str
    address: str
    _holder: subprocess.Popen = field(repr=False)

    def command(self, argv: list[str], cwd: str | None = None) -> list[str]:
        """``argv`` wrapped to run on this node (its network, hostname and ``/dev/shm``), in ``cwd``."""
        pid = self._holder.pid
        return ["nsenter", "-t", str(pid), "--net", "--uts", "--mount", f"--wd={cwd or os.getcwd()}", "--", *argv]

    def popen(self, argv: list[str], cwd: str | None = None, **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(argv, cwd), **kwargs)

    def run(self, argv: list[str], cwd: str | None = None, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(argv, cwd), **kwargs)


class NodeCluster:
    """``count`` nodes on one switch, each link shaped to ``link`` (a tc rate, or None for unshaped veths)
    both ways. A context manager: leaving it kills every process started on a node and removes the namespaces,
    links and ``/dev/shm`` tmpfs, also after an exception."""

    def __init__(self, count: int, link: str | None = "1gbit", mtu: int = 1500, shm_size: str = "1g"):
        if not 1 <= count <= 200:
            raise ValueError(f"count={count}: a NodeCluster has 1 to 200 nodes")
        self.count, self.link, self.mtu, self.shm_size = count, link, mtu, shm_size
        self.rate_bits = link_rate_bits(link) if link else None
        self.tag = f"{PREFIX}-{os.getpid()}-{next(_serial)}"
        self.switch = f"{self.tag}-sw"
        self.nodes: list[Node] = []
        self._made: list[str] = []
        self._hosts_file: str | None = None

    # --- up ---------------------------------------------------------------------------------------------
    def __enter__(self) -> NodeCluster:
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def __getitem__(self, index: int) -> Node:
        return self.nodes[index]

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self):
        return iter(self.nodes)

    def up(self) -> None:
        remove_stale()
        self._write_hosts_file()
        self._add_netns(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i in range(self.count):
            netns = f"{self.tag}-n{i}"
            self._add_netns(netns)
            port = f"p{i}"
            _ip(
                "-n",
                self.switch,
                "link",
                "add",
                port,
                "mtu",
                str(self.mtu),
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "mtu",
                str(self.mtu),
                "netns",
                netns,
            )
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            address = f"{SUBNET}.{i + 1}"
            _ip("-n", netns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", netns, "link", "set", "eth0", "up")
            _ip("-n", netns, "link", "set", "lo", "up")
            if self.rate_bits:
                self._shape(netns, "eth0")  # what the node sends
                self._shape(self.switch, port)  # what it receives
            self.nodes.append(Node(i, netns, f"node{i}", address, self._start_holder(netns, f"node{i}")))

    def _add_netns(self, netns: str) -> None:
        _ip("netns", "add", netns)
        self._made.append(netns)

    def _shape(self, netns: str, device: str) -> None:
        """tbf at the link's rate: a bucket of 1 ms of traffic (at least 64 KiB, so a full-size GSO packet
        passes) and a queue of 20 ms, so a transfer takes its bytes / rate give or take a millisecond."""
        burst = max(64 * 1024, int(self.rate_bits / 8 / 1000))
        command = [
            "tc",
            "-n",
            netns,
            "qdisc",
            "replace",
            "dev",
            device,
            "root",
            "tbf",
            "rate",
            self.link,
            "burst",
            str(burst),
            "latency",
            "20ms",
        ]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise NodeHarnessError(f"`{' '.join(command)}` failed: {done.stderr.strip()}")

    def _write_hosts_file(self) -> None:
        """An ``/etc/hosts`` for the nodes (bind-mounted over theirs): every node resolves every other by its
        hostname, as on a cluster (Slurm's daemons and ``srun`` look their peers up by name)."""
        fd, self._hosts_file = tempfile.mkstemp(prefix=f"{self.tag}-hosts-")
        lines = ["127.0.0.1 localhost", *(f"{SUBNET}.{i + 1} node{i}" for i in range(self.count))]
        with os.fdopen(fd, "w") as out:
            out.write("\n".join(lines) + "\n")
        os.chmod(self._hosts_file, 0o644)

    def _start_holder(self, netns: str, hostname: str) -> subprocess.Popen:
        """A process in the node's network namespace that unshares UTS and mount namespaces, sets the hostname,
        mounts a tmpfs of its own on /dev/shm and the nodes' hosts file on /etc/hosts; processes on the node
        enter its namespaces."""
        script = (
            f"hostname {hostname} && mount -t tmpfs -o mode=1777,size={self.shm_size} fastpar-node-shm /dev/shm"
            f" && mount --bind {shlex.quote(self._hosts_file)} /etc/hosts && echo ready && exec sleep infinity"
        )
        holder = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                netns,
                "unshare",
                "--uts",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                script,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        line = holder.stdout.readline().strip()
        if line != "ready":
            holder.kill()
            raise NodeHarnessError(f"node {hostname} did not start: {holder.stderr.read().strip() or line}")
        return holder

    # --- down -------------------------------------------------------------------------------------------
    def down(self) -> None:
        """Kill everything on the nodes and remove the namespaces (their veths and tmpfs go with them)."""
        for netns in reversed(self._made):
            _kill_netns_processes(netns)
        for node in self.nodes:
            node._holder.wait()
            for stream in (node._holder.stdout, node._holder.stderr):
                stream.close()
        for netns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        self._made.clear()
        self.nodes.clear()
        if self._hosts_file:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._hosts_file)
            self._hosts_file = None

    def link_seconds(self, nbytes: float) -> float:
        """The least time ``nbytes`` of payload take to cross one shaped link."""
        if not self.rate_bits:
            raise ValueError("this cluster's links are not shaped (link=None)")
        return nbytes * 8 / self.rate_bits
