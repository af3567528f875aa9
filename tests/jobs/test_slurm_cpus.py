"""Which CPUs a trial on Slurm runs on, without a cluster: the allocation as ``scontrol show job -d`` lists it,
this task's share of it, and Slurm's host lists. (On a real cluster: test_jobs_slurm.py.)"""

from __future__ import annotations

import os
import sys

import pytest

from fastpar.jobs import slurm

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU affinity is Linux-only")

SHOW_JOB = """JobId=42 JobName=trial
   JobState=RUNNING Reason=None Dependency=(null)
   NumNodes=3 NumCPUs=6 NumTasks=3 CPUs/Task=2 ReqB:S:C:T=0:0:*:*
     Nodes=gpu[07-08] CPU_IDs=2-3 Mem=1024 GRES=
     Nodes=vm CPU_IDs={cpus} Mem=1024 GRES=
   MinCPUsNode=2 MinMemoryCPU=512M MinTmpDiskNode=0
"""


@pytest.mark.parametrize(
    "hosts,names",
    [
        ("vm", ["vm"]),
        ("n[1-3,5],login", ["n1", "n2", "n3", "n5", "login"]),
        ("gpu[07-08]", ["gpu07", "gpu08"]),
    ],
)
def test_slurm_host_lists(hosts, names):
    assert slurm._host_names(hosts) == names


def test_the_allocation_of_this_node_is_read_from_scontrol():
    text = SHOW_JOB.format(cpus="0,4-5")
    assert slurm.node_cpu_ids(text, "vm") == [0, 4, 5]
    assert slurm.node_cpu_ids(text, "gpu08") == [2, 3]
    assert slurm.node_cpu_ids(text, "elsewhere") == []


@pytest.fixture
def in_a_slurm_task(tmp_path, monkeypatch):
    """A Slurm task on node "vm" whose controller lists the CPUs given to the returned function."""

    def allocate(cpus: str, local_id: int = 0, per_task: int = 1) -> None:
        (tmp_path / "show.txt").write_text(SHOW_JOB.format(cpus=cpus))
        scontrol = tmp_path / "scontrol"
        scontrol.write_text(f"#!{sys.executable}\nimport sys\nprint(open({str(tmp_path / 'show.txt')!r}).read())\n")
        scontrol.chmod(0o755)
        monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
        monkeypatch.setenv("SLURM_JOB_ID", "42")
        monkeypatch.setenv("SLURMD_NODENAME", "vm")
        monkeypatch.setenv("SLURM_LOCALID", str(local_id))
        monkeypatch.setenv("SLURM_CPUS_PER_TASK", str(per_task))

    return allocate


def test_a_task_gets_its_share_of_the_allocation(in_a_slurm_task):
    usable = sorted(os.sched_getaffinity(0))
    in_a_slurm_task(",".join(map(str, usable)), local_id=len(usable) - 1, per_task=1)
    assert slurm.task_cpus() == (usable[-1],)  # the last task on the node: the last CPU, not all of them
    in_a_slurm_task(",".join(map(str, usable)), local_id=0, per_task=len(usable))
    assert slurm.task_cpus() == tuple(usable)


def test_outside_slurm_or_outside_what_the_process_may_use_nothing_is_pinned(in_a_slurm_task, monkeypatch):
    in_a_slurm_task("100000")  # a CPU this process may not use
    assert slurm.task_cpus() is None
    monkeypatch.delenv("SLURM_JOB_ID")
    assert slurm.task_cpus() is None
