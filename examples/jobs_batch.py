"""A batch job: submit a training script, close the session, come back for its result and logs
(MATLAB's batch). Prints the job's id and exits; the job keeps running.

    id=$(python examples/jobs_batch.py)            # examples/train_classifier.py on 2 CPU processes
    fastpar jobs list
    fastpar jobs result "$id" --wait               # waits, then prints the result (None: the script exited 0)
    fastpar jobs logs "$id"                        # the script's output

    python examples/jobs_batch.py --nodes 2        # two torchrun agents (here: on this machine) meeting at a
                                                   # c10d rendezvous, the trainer in its 'cluster' environment
    python examples/jobs_batch.py --cluster slurm --nodes 2 --gpus-per-node 8 --partition gpu
"""

from __future__ import annotations

import argparse
from pathlib import Path

import fastpar

SCRIPT = Path(__file__).with_name("train_classifier.py")

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--cluster", default="auto", choices=["auto", "local", "slurm"])
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int)
    p.add_argument("--partition", help="Slurm partition")
    args = p.parse_args()
    # one node: the script picks its own environment (2 CPU processes here); several: torchrun agents, one a node
    script_args = ["--environment", "cpu", "--devices", "2"] if args.nodes == 1 else ["--environment", "cluster"]
    job = fastpar.batch(
        SCRIPT,
        *script_args,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        cluster=args.cluster,
        name="classifier",
        resources={"timeout_min": 60, **({"slurm_partition": args.partition} if args.partition else {})},
    )
    print(job.id)
