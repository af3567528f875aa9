"""Start local workers through torch's elastic launcher (the machinery behind torchrun).

Single-machine runs rendezvous over c10d on 127.0.0.1 with a free port, so nothing listens beyond
loopback. ``max_restarts`` is torchrun's: when a worker dies the agent stops the group and starts it
again, and the workers resume from the newest checkpoint.
"""

from __future__ import annotations

import logging
import signal
import uuid
from typing import Any

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from .._spawn import free_port
from .job import Job


@record  # a failing worker's traceback reaches the launcher's error instead of "error_file: <N/A>"
def _worker_entry(job: Job) -> Any:
    from .worker import run_worker

    try:
        return run_worker(job)
    except KeyboardInterrupt:  # Ctrl-C reaches every process of the terminal's group: one message, from the launcher
        raise SystemExit(130) from None


def launch_local(job: Job, nprocs: int, max_restarts: int) -> Any:
    """Run ``job`` on ``nprocs`` local processes and return rank 0's result."""
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=f"fastpar-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        local_addr="127.0.0.1",
    )
    # The agent logs every rendezvous at INFO/WARNING; our own progress output is what users read.
    quiet = logging.getLogger("torch.distributed.elastic")
    previous = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        results = elastic_launch(config, _worker_entry)(job)
    except SignalException as exc:  # the agent has stopped the workers; report Ctrl-C as Python does
        if exc.sigval == signal.SIGINT:
            raise KeyboardInterrupt("training interrupted; the worker processes were stopped") from None
        raise
    finally:
        quiet.setLevel(previous)
    return results[0]
