"""A Slurm cluster over harness nodes: ``slurmctld`` on node 0, one ``slurmd`` per node, each on its node's
address, hostname and ``/dev/shm`` — so a multi-node Slurm job (``fastpar.batch(..., nodes=2)``) really runs on
two network stacks joined by the shaped links.

Its own configuration, state and logs live in a folder of the caller's (``SLURM_CONF`` points there); the
daemons listen inside the nodes' namespaces only, so they neither clash with a Slurm on the host nor can be
reached from outside. Slurm's commands (``sbatch``, ``squeue``, ...) must run on a node as well:
``slurm.command(argv)``/``slurm.env()`` give what a process on node 0 needs. Authentication is the host's
munge (its socket is a file, shared by the nodes); ``scripts/slurm-up.sh`` sets munge up.

    with NodeCluster(2, link="1gbit") as nodes, NodeSlurm(nodes, folder) as slurm:
        nodes[0].run([sys.executable, "submit.py"], env=slurm.env())
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from .harness import SPOOL_PREFIX, NodeCluster, NodeHarnessError

DAEMONS = ("slurmctld", "slurmd", "sinfo", "sbatch", "munge")


def slurm_available() -> tuple[bool, str]:
    """Whether Slurm's daemons and a working munge are here (``scripts/slurm-up.sh`` installs both)."""
    missing = [tool for tool in DAEMONS if shutil.which(tool) is None]
    if missing:
        return False, f"Slurm on nodes needs {', '.join(missing)} (scripts/slurm-up.sh installs them)"
    probe = subprocess.run("munge -n | unmunge", shell=True, capture_output=True, text=True)
    if probe.returncode:
        return False, "munge does not answer here (run scripts/slurm-up.sh, which starts munged)"
    return True, ""


class NodeSlurm:
    """Slurm on ``nodes`` (a NodeCluster that is up), configured and logged under ``folder``. Leaving the
    context stops the daemons (and with them every job step); the nodes stay up."""

    partition = "nodes"

    def __init__(self, nodes: NodeCluster, folder: str | os.PathLike, cpus_per_node: int | None = None) -> None:
        if not nodes.nodes:
            raise ValueError("NodeSlurm needs a NodeCluster that is up (enter it first)")
        self.nodes, self.folder = nodes, Path(folder).resolve()
        self.cpus = cpus_per_node or len(os.sched_getaffinity(0))
        self.conf = self.folder / "slurm.conf"
        self._daemons: list[subprocess.Popen] = []
        self._spool: str | None = None

    def __enter__(self) -> NodeSlurm:
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of a process that uses this Slurm: ``SLURM_CONF`` set, the host Slurm's job
        variables removed."""
        env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("SLURM_")}
        return env | {"SLURM_CONF": str(self.conf)}

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` wrapped to run on node 0, where the controller listens (pair it with ``env()``)."""
        return self.nodes[0].command(argv, cwd=str(self.folder))

    def run(self, argv: list[str], timeout: float = 30.0) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.command(argv), env=self.env(), capture_output=True, text=True, timeout=timeout, check=False
        )

    # --- up ---------------------------------------------------------------------------------------------
    def up(self, timeout: float = 60.0) -> None:
        ok, why = slurm_available()
        if not ok:
            raise NodeHarnessError(why)
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "ctld").mkdir(exist_ok=True)
        # the job steps' sockets live in slurmd's spool folder, and a socket's path has at most 107 bytes: a short
        # folder of its own, not one under the caller's (pytest's tmp_path alone can take 80)
        self._spool = tempfile.mkdtemp(prefix=f"{SPOOL_PREFIX}{os.getpid()}-")
        self.conf.write_text(self._config())
        # `ip netns exec` gives each node a sysfs of its own, without the host's cgroup mounts: name the cgroup
        # plugin so that slurmd does not probe /sys/fs/cgroup (nothing here tracks or binds through cgroups)
        (self.folder / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
        env = self.env()
        head = self.nodes[0]
        # -D: in the foreground, so that the daemon is this Popen and leaving kills it; -i: ignore old state
        self._daemons.append(self._start(head, ["slurmctld", "-D", "-i", "-f", str(self.conf)], env, "slurmctld"))
        for node in self.nodes:
            os.mkdir(os.path.join(self._spool, node.hostname))
            argv = ["slurmd", "-D", "-N", node.hostname, "-f", str(self.conf)]
            self._daemons.append(self._start(node, argv, env, f"slurmd-{node.hostname}"))
        self._wait_idle(timeout)

    def _start(self, node, argv: list[str], env: dict[str, str], name: str) -> subprocess.Popen:
        log = open(self.folder / f"{name}.out", "ab")  # noqa: SIM115 - the daemon writes to its own copy
        try:
            return node.popen(argv, cwd=str(self.folder), env=env, stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()

    def _config(self) -> str:
        f = self.folder
        node_lines = "\n".join(
            f"NodeName={n.hostname} NodeAddr={n.address} CPUs={self.cpus} State=UNKNOWN" for n in self.nodes
        )
        names = ",".join(n.hostname for n in self.nodes)
        head = self.nodes[0]
        return f"""# written by fastpar.nodes.NodeSlurm: Slurm over {len(self.nodes)} harness nodes
ClusterName=fastpar-nodes
SlurmctldHost={head.hostname}({head.address})
SlurmUser=root
AuthType=auth/munge
StateSaveLocation={f}/ctld
SlurmdSpoolDir={self._spool}/%n
SlurmctldPidFile={f}/slurmctld.pid
SlurmdPidFile={f}/slurmd-%n.pid
SlurmctldLogFile={f}/slurmctld.log
SlurmdLogFile={f}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
MpiDefault=none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
InactiveLimit=0
KillWait=5
MinJobAge=300
{node_lines}
PartitionName={self.partition} Nodes={names} Default=YES MaxTime=INFINITE State=UP
"""

    def _wait_idle(self, timeout: float) -> None:
        deadline, states = time.monotonic() + timeout, ""
        while time.monotonic() < deadline:
            for daemon in self._daemons:
                if daemon.poll() is not None:
                    raise NodeHarnessError(f"a Slurm daemon exited ({daemon.args[-4:]}); {self._log_tail()}")
            done = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=10)
            states = done.stdout.strip()
            rows = [line.split() for line in states.splitlines()]
            if len(rows) == len(self.nodes) and all(r[1].rstrip("*~#!%$@^-") == "idle" for r in rows):
                return
            for name, state in (r for r in rows if len(r) == 2):
                if state.rstrip("*") in ("down", "drain"):
                    self.run(["scontrol", "update", f"nodename={name}", "state=resume"], timeout=10)
            time.sleep(0.5)
        raise NodeHarnessError(f"Slurm's nodes did not become idle in {timeout:g} s ({states!r}); {self._log_tail()}")

    def _log_tail(self) -> str:
        tails = []
        for log in sorted(self.folder.glob("*.log")) + sorted(self.folder.glob("*.out")):
            lines = log.read_text(errors="replace").strip().splitlines()[-3:]
            if lines:
                tails.append(f"{log.name}: " + " | ".join(lines))
        return "; ".join(tails) or "no log written"

    # --- down -------------------------------------------------------------------------------------------
    def down(self) -> None:
        for daemon in reversed(self._daemons):
            if daemon.poll() is None:
                daemon.terminate()
        for daemon in reversed(self._daemons):
            try:
                daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        self._daemons.clear()
        if self._spool:
            shutil.rmtree(self._spool, ignore_errors=True)
            self._spool = None
