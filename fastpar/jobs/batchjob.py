"""``fastpar.batch``: a script or function as a batch job (MATLAB's ``batch``), on one node or many.

- One node, no ``processes_per_node``: the job runs the script (``python script args``) or calls the
  function once; a Trainer inside picks its own execution environment (all GPUs, CPU processes, ...).
- Several nodes, or ``processes_per_node``: each node runs one torchrun agent (torch's elastic agent,
  :func:`fastpar.launcher.launch_agent`) with ``processes_per_node`` workers (default: ``gpus_per_node``,
  else 1); the agents meet at a c10d rendezvous on the job's first node, so a Trainer in the workers runs
  its ``cluster`` environment. On Slurm that is one task per node (``--ntasks-per-node=1``) and the first
  host of the allocation; on the local executor ``nodes=N`` rehearses the job with N agents on this
  machine meeting on 127.0.0.1, with every store on loopback. Across nodes the rendezvous store listens on the
  first node's network interfaces (the agents print where): the network between the nodes must be trusted.
  The run id is random, drawn once at submission, so knowing the job id is not enough to join the rendezvous.

The result is the script's exit (None when it succeeded) or the function's return value on global rank 0.
"""

from __future__ import annotations

import random
import secrets
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..launcher import free_port, launch_agent
from .executor import check_resources, fill_local_gpus, resolve_cluster
from .future import JobFuture
from .submission import describe, start_job
from .task import call_packed, pack_call


class ScriptFailedError(RuntimeError):
    """The batch script exited with a non-zero status; its output is in the job's log."""


def run_script(script: str, args: tuple[str, ...]) -> None:
    """Run ``python script args`` here, its output going to the job's log."""
    sys.stdout.flush()
    status = subprocess.call([sys.executable, "-u", script, *args])
    if status != 0:
        raise ScriptFailedError(f"{script} exited with status {status}; its output is in the job's log above")


def rendezvous_port(job_id: str) -> int:
    """The same port on every node of a job, from its id (submitit's TorchDistributedEnvironment rule)."""
    return random.Random(job_id).randint(20000, 60000)


class NodeAgent:
    """One node's share of a multi-node job: a torchrun agent whose workers run the script or function."""

    def __init__(
        self, target: Callable[..., Any] | str, args: tuple[Any, ...], nproc_per_node: int, port: int | None = None
    ) -> None:
        self.target, self.args, self.nproc_per_node, self.port = target, args, nproc_per_node, port
        # drawn here, at submission, and pickled with the agent: every node reads the same one, nobody can derive it
        self.run_id = f"fastpar-{secrets.token_hex(16)}"

    def rendezvous(self) -> tuple[int, str, str]:
        """(nodes, HOST:PORT, run id) of this job, the same on every node."""
        from submitit import JobEnvironment

        env = JobEnvironment()
        host = env.hostnames[0] if env.cluster == "slurm" else "127.0.0.1"
        port = self.port or rendezvous_port(env.job_id)
        return env.num_tasks, f"{host}:{port}", self.run_id

    def __call__(self) -> dict[int, Any]:
        nodes, endpoint, run_id = self.rendezvous()
        if isinstance(self.target, str):
            entrypoint, args = sys.executable, ("-u", self.target, *map(str, self.args))
        else:  # the workers unpack it themselves: a function from the submitting script needs cloudpickle
            entrypoint, args = call_packed, (pack_call(self.target, self.args),)
        return launch_agent(
            entrypoint, args, nproc_per_node=self.nproc_per_node, nnodes=nodes, rdzv_endpoint=endpoint, run_id=run_id
        )


def batch(
    script_or_fn: str | Path | Callable[..., Any],
    *args: Any,
    nodes: int = 1,
    gpus_per_node: int | None = None,
    processes_per_node: int | None = None,
    cluster: str = "auto",
    name: str | None = None,
    resources: Mapping[str, Any] | None = None,
    root: str | Path | None = None,
) -> JobFuture:
    """Submit a script (path to a ``.py`` file, run with ``args`` as its command line) or a function
    (called with ``args``) as a batch job on ``nodes`` nodes; return its future at once.

    ``resources``: more of submitit's parameters (``timeout_min``, ``cpus_per_task``, ``mem_gb``,
    ``slurm_partition``, ``slurm_account``, ...). The job survives this process: ``fastpar jobs`` lists it,
    shows its logs and result, and cancels it.
    """
    for label, value, minimum in (
        ("nodes", nodes, 1),
        ("gpus_per_node", gpus_per_node, 0),
        ("processes_per_node", processes_per_node, 1),
    ):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < minimum):
            raise ValueError(f"{label} must be a whole number >= {minimum}, got {value!r}")
    if isinstance(script_or_fn, (str, Path)):
        script = Path(script_or_fn)
        if not script.is_file():
            raise FileNotFoundError(f"batch script {str(script)!r} does not exist (working folder {Path.cwd()})")
        target: Callable[..., Any] | str = str(script.resolve())
        args = tuple(str(a) for a in args)
    elif callable(script_or_fn):
        target = script_or_fn
    else:
        raise TypeError(f"batch needs a script path or a function, got {type(script_or_fn).__name__}")
    cluster = resolve_cluster(cluster)
    params = check_resources(
        {**(resources or {}), **({} if gpus_per_node is None else {"gpus_per_node": gpus_per_node})}
    )
    gpus = params.get("gpus_per_node", 0)  # asked for: sets the workers per node
    if cluster == "local":
        fill_local_gpus(params, "fastpar.batch")
    multi = nodes > 1 or processes_per_node is not None
    if multi:
        agent = NodeAgent(target, args, processes_per_node or gpus or 1, free_port() if cluster == "local" else None)
        payload, result_from = pack_call(agent, ()), "rank0"
        # one agent per node; the local executor has one node, so it runs the N agents side by side there
        params.update(
            {"nodes": 1, "tasks_per_node": nodes} if cluster == "local" else {"nodes": nodes, "tasks_per_node": 1}
        )
    elif isinstance(target, str):
        payload, result_from = pack_call(run_script, (target, args)), "task0"
    else:
        payload, result_from = pack_call(target, args), "task0"
    what = describe(target) + (" " + " ".join(map(str, args)) if isinstance(target, str) and args else "")
    name = name or (Path(target).stem if isinstance(target, str) else getattr(target, "__name__", "batch"))
    return start_job(
        payload, kind="batch", name=name, what=what, cluster=cluster, params=params, root=root, result_from=result_from
    )
