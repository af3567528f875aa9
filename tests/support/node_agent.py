"""One node's agent in the multi-node tests (not a test itself): ``fastpar.launcher.launch_agent`` running the
cluster training script (cluster_train_script.py) on ``NPROC`` workers, meeting the other nodes' agents at
``ENDPOINT`` under ``RUN_ID``. Usage: node_agent.py NNODES NPROC ENDPOINT RUN_ID OUT [MAX_RESTARTS]"""

from __future__ import annotations

import sys
from pathlib import Path

from fastpar.launcher import launch_agent

SCRIPT = Path(__file__).resolve().parent / "cluster_train_script.py"

if __name__ == "__main__":
    nnodes, nproc, endpoint, run_id, out = sys.argv[1:6]
    restarts = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    launch_agent(
        sys.executable,
        ("-u", str(SCRIPT), out),
        nproc_per_node=int(nproc),
        nnodes=int(nnodes),
        rdzv_endpoint=endpoint,
        run_id=run_id,
        max_restarts=restarts,
    )
