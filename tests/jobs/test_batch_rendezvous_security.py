"""A multi-node batch job's rendezvous: a run id nobody can derive from the job id, the same on every node."""

from __future__ import annotations

import pickle
import re

import pytest

submitit = pytest.importorskip("submitit")

from fastpar.jobs.batchjob import NodeAgent  # noqa: E402


class _SlurmJob:
    """What submitit's JobEnvironment tells a task of a two-node Slurm job."""

    cluster, job_id, num_tasks, hostnames = "slurm", "4242", 2, ["node1", "node2"]


def test_run_id_is_random_not_derived_from_the_job_id(monkeypatch):
    monkeypatch.setattr(submitit, "JobEnvironment", _SlurmJob)
    first, second = NodeAgent("train.py", (), 1), NodeAgent("train.py", (), 1)
    nodes, endpoint, run_id = first.rendezvous()
    assert (nodes, endpoint.split(":")[0]) == (2, "node1")
    assert _SlurmJob.job_id not in run_id
    assert re.search(r"[0-9a-f]{32}", run_id), run_id
    assert second.rendezvous()[2] != run_id  # two submissions of the same job id: two run ids


def test_every_node_reads_the_same_run_id(monkeypatch):
    monkeypatch.setattr(submitit, "JobEnvironment", _SlurmJob)
    agent = NodeAgent("train.py", (), 1)
    on_nodes = [pickle.loads(pickle.dumps(agent)) for _ in range(2)]  # the payload every node unpickles
    assert {node.rendezvous()[2] for node in on_nodes} == {agent.rendezvous()[2]}
