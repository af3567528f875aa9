"""Submits the multi-node tests' training script as ``fastpar.batch(script, OUT, nodes=N,
processes_per_node=P, cluster="slurm")`` and waits for it (not a test itself). Run on node 0 of a NodeCluster with
``SLURM_CONF`` naming the NodeSlurm over those nodes. Prints the job id, each task's host and the lines of its log
that say where the rendezvous store listens. Usage: nodes_batch_submit.py NODES PROCESSES OUT JOBS_ROOT"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import fastpar

SCRIPT = Path(__file__).resolve().parent / "cluster_train_script.py"

if __name__ == "__main__":
    nodes, processes, out, root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    print(f"submitting from {socket.gethostname()}", flush=True)
    job = fastpar.batch(
        SCRIPT,
        out,
        nodes=nodes,
        processes_per_node=processes,
        cluster="slurm",
        resources={"cpus_per_task": 2, "timeout_min": 10},
        root=root,
    )
    print(f"job {job.id}", flush=True)
    try:
        job.result()
    finally:
        for task in range(nodes):
            print(f"--- task {task} log ---\n{job.logs(task)}", flush=True)
    print("job done", flush=True)
