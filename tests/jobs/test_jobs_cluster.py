"""Multi-node without a cluster, and the Slurm submission without Slurm.

- The trainer's ``cluster`` environment as two torchrun agents on this machine (``--nnodes=2``, node ranks 0
  and 1, c10d rendezvous on 127.0.0.1) ends bit-identical to one agent with the same number of processes;
  so does ``fastpar.batch(script, nodes=2)`` on the local executor (two agents meeting on 127.0.0.1).
- Stand-in ``srun``/``sbatch``/``sinfo``/``sacct``/``scancel`` on PATH record what submitit would hand to
  Slurm, and the generated sbatch scripts are checked for several resource requests (the real cluster's
  tests are in test_jobs_slurm.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

pytest.importorskip("submitit")

import cloudpickle  # noqa: E402
import submitit  # noqa: E402
from torch_teardown import aborted_at_teardown

import fastpar  # noqa: E402
from fastpar.jobs.batchjob import NodeAgent, rendezvous_port  # noqa: E402
from fastpar.launcher import free_port  # noqa: E402

pytestmark = pytest.mark.timeout(900)
REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parents[1] / "support" / "cluster_train_script.py"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(GLOO_SOCKET_IFNAME="lo", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return env


def _torchrun(nnodes: int, nproc: int, node_rank: int, port: int, run_id: str, out: Path) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        f"--node-rank={node_rank}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={run_id}",
        "--local-addr=127.0.0.1",
        str(SCRIPT),
        str(out),
    ]
    return subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(agents: list[subprocess.Popen]) -> bool:
    """Wait for the agents; False when one hit torch's teardown abort (torch_teardown.py): run them again."""
    again = False
    for agent in agents:
        output, _ = agent.communicate(timeout=600)
        if aborted_at_teardown(agent.returncode, output):
            again = True
            continue
        assert agent.returncode == 0, output
    return not again


@pytest.fixture(scope="module")
def one_agent(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The reference: one torchrun agent with 2 processes."""
    out = tmp_path_factory.mktemp("one") / "params.pt"
    if not _finish([_torchrun(1, 2, 0, free_port(), uuid.uuid4().hex, out)]):
        assert _finish([_torchrun(1, 2, 0, free_port(), uuid.uuid4().hex, out)]), "aborted at teardown twice"
    return torch.load(out)


def _assert_same(params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert params.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(params[name], tensor), f"{name} differs from one agent with 2 processes"


def test_the_trainer_leaves_no_gloo_thread_behind_under_torchrun(tmp_path, monkeypatch):
    """A group kept alive by reference cycles after destroy_process_group keeps gloo's threads until interpreter
    shutdown, where tearing them down now and then aborts a rank that trained fine (SIGABRT)."""
    monkeypatch.setenv("FASTPAR_TEST_REPORT_THREADS", "1")
    agent = _torchrun(1, 2, 0, free_port(), uuid.uuid4().hex, tmp_path / "params.pt")
    output, _ = agent.communicate(timeout=300)
    reports = [line for line in output.splitlines() if line.startswith("threads after fit")]
    assert len(reports) == 2, output
    for line in reports:
        assert "gloo" not in line, f"gloo threads outlived Trainer.fit(): {line}"


@pytest.mark.slow
def test_two_torchrun_agents_end_bit_identical_to_one_agent(one_agent, tmp_path):
    out = tmp_path / "params.pt"
    for attempt in range(2):
        port, run_id = free_port(), uuid.uuid4().hex
        if _finish([_torchrun(2, 1, node_rank, port, run_id, out) for node_rank in (0, 1)]):
            break
        assert attempt == 0, "aborted at teardown twice"
    _assert_same(torch.load(out), one_agent)


@pytest.mark.slow
def test_batch_on_two_local_nodes_ends_bit_identical_to_one_agent(one_agent, tmp_path, monkeypatch):
    monkeypatch.setenv("FASTPAR_JOBS_DIR", str(tmp_path / "jobs"))
    out = tmp_path / "params.pt"
    for attempt in range(2):
        job = fastpar.batch(SCRIPT, out, nodes=2, cluster="local", name="two-nodes")
        assert job.record.num_tasks == 2 and job.record.result_from == "rank0"
        try:
            assert job.result(timeout=600) is None, job.logs(0)  # a script returns nothing; its exit was 0
            break
        except Exception:
            if attempt or not aborted_at_teardown(1, job.logs(0) + job.logs(1)):
                raise
    _assert_same(torch.load(out), one_agent)
    assert "saved rank 0's parameters" in job.logs(0) + job.logs(1)


# --- Slurm, as far as it can be checked without Slurm ----------------------------------------------------
FAKE_SBATCH = """#!/bin/sh
n=$(ls "$FAKE_SLURM_DIR" | grep -c '^sbatch-')
cp "$1" "$FAKE_SLURM_DIR/sbatch-$n.sh"
echo "Submitted batch job $((4200 + n))"
"""


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch) -> Path:
    """srun/sbatch/sinfo/sacct/scancel stand-ins: sbatch keeps each script it is given and answers a job id."""
    bin_dir, record = tmp_path / "bin", tmp_path / "slurm"
    bin_dir.mkdir()
    record.mkdir()
    tools = {
        "sbatch": FAKE_SBATCH,
        "srun": "#!/bin/sh\nexit 0\n",
        "sinfo": "#!/bin/sh\necho 'debug up'\n",
        "sacct": "#!/bin/sh\necho 'JobID|State|NodeList'\n",
        "scancel": '#!/bin/sh\necho "$@" >> "$FAKE_SLURM_DIR/scancel.log"\n',
    }
    for name, text in tools.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM_DIR", str(record))
    monkeypatch.setenv("FASTPAR_JOBS_DIR", str(tmp_path / "jobs"))
    return record


def _directives(script: str) -> dict[str, str]:
    flags = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH --"):
            key, _, value = line.removeprefix("#SBATCH --").partition("=")
            flags[key] = value
    return flags


def _submitted_call(job) -> object:
    """What the job will run: submitit's pickled call, unpacked as the job process would."""
    delayed = submitit.core.utils.DelayedSubmission.load(job.folder / f"{job.record.cluster_job_id}_submitted.pkl")
    fn, args = cloudpickle.loads(delayed.function.payload)
    return fn, args


def add(a: int, b: int) -> int:
    return a + b


def test_sbatch_scripts_for_several_resource_requests(fake_slurm, tmp_path, monkeypatch):
    one = fastpar.submit(
        add,
        1,
        2,
        cluster="slurm",
        resources={"timeout_min": 30, "gpus_per_node": 1, "cpus_per_task": 8, "mem_gb": 32, "slurm_partition": "gpu"},
    )
    flags = _directives((fake_slurm / "sbatch-0.sh").read_text())
    assert {
        k: flags[k] for k in ("job-name", "nodes", "gpus-per-node", "cpus-per-task", "mem", "time", "partition")
    } == {
        "job-name": "add",
        "nodes": "1",
        "gpus-per-node": "1",
        "cpus-per-task": "8",
        "mem": "32GB",
        "time": "30",
        "partition": "gpu",
    }
    assert one.record.cluster == "slurm" and one.record.cluster_job_id == "4200"
    assert _submitted_call(one) == (add, (1, 2))

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    two = fastpar.batch(
        script,
        "--epochs",
        "3",
        nodes=2,
        gpus_per_node=8,
        cluster="slurm",
        resources={"timeout_min": 120, "slurm_account": "proj", "slurm_constraint": "h100"},
    )
    text = (fake_slurm / "sbatch-1.sh").read_text()
    flags = _directives(text)
    assert {k: flags[k] for k in ("nodes", "ntasks-per-node", "gpus-per-node", "time", "account", "constraint")} == {
        "nodes": "2",
        "ntasks-per-node": "1",
        "gpus-per-node": "8",
        "time": "120",
        "account": "proj",
        "constraint": "h100",
    }
    command = text.strip().splitlines()[-1]
    assert command.startswith("srun --unbuffered --output") and "-m submitit.core._submit" in command
    assert "--cpu-bind=cores" in command and flags["cpus-per-task"] == "1"  # each task bound to the cores it asked for
    assert str(two.folder) in command
    assert two.record.num_tasks == 2 and two.record.result_from == "rank0"
    agent, args = _submitted_call(two)
    assert isinstance(agent, NodeAgent) and args == ()
    assert (agent.target, agent.args, agent.nproc_per_node) == (str(script.resolve()), ("--epochs", "3"), 8)
    # on node 1 of that job, the agent meets the others on the allocation's first host
    slurm_env = {
        "SUBMITIT_EXECUTOR": "slurm",
        "SLURM_JOB_ID": "4201",
        "SLURM_NTASKS": "2",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NODEID": "1",
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "0",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
    }
    for key, value in slurm_env.items():
        monkeypatch.setenv(key, value)
    # the run id was drawn at submission: the same on every node, not derived from the job id
    assert agent.rendezvous() == (2, f"gpu07:{rendezvous_port('4201')}", agent.run_id)
    assert "4201" not in agent.run_id
    for key in slurm_env:
        monkeypatch.delenv(key)

    three = fastpar.batch(add, 1, 2, nodes=4, processes_per_node=4, cluster="slurm", resources={"slurm_qos": "high"})
    flags = _directives((fake_slurm / "sbatch-2.sh").read_text())
    assert (flags["nodes"], flags["ntasks-per-node"], flags["qos"], flags["time"]) == ("4", "1", "high", "1440")
    assert "gpus-per-node" not in flags
    assert _submitted_call(three)[0].nproc_per_node == 4

    assert three.state() == "PENDING"  # sacct does not know it yet
    assert three.cancel() and three.state() == "CANCELLED"
    assert "4202" in (fake_slurm / "scancel.log").read_text()
    for job in (one, two):
        job.cancel()


def test_slurm_without_slurm_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no Slurm anywhere
    with pytest.raises(RuntimeError, match="sinfo/sbatch are not on this machine's PATH"):
        fastpar.submit(add, 1, 2, cluster="slurm")


def _slurm_client_without_controller(tmp_path, monkeypatch) -> None:
    """Slurm's client tools whose controller never answers, as on a machine where only the client is installed."""
    bin_dir = tmp_path / "client"
    bin_dir.mkdir()
    for name in ("sinfo", "sbatch", "srun", "squeue", "scontrol"):
        (bin_dir / name).write_text(
            "#!/bin/sh\necho 'slurm_load_partitions: Unable to contact slurm controller "
            "(connect failure)' >&2\nexit 1\n"
        )
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FASTPAR_JOBS_DIR", str(tmp_path / "jobs"))


def test_slurm_client_without_a_controller_is_one_clear_error(monkeypatch, tmp_path):
    _slurm_client_without_controller(tmp_path, monkeypatch)
    with pytest.raises(RuntimeError) as caught:
        fastpar.submit(add, 1, 2, cluster="slurm")
    message = str(caught.value)
    assert "\n" not in message and "Unable to contact slurm controller" in message and "cluster='local'" in message
    assert not (tmp_path / "jobs").exists()  # nothing was submitted


def test_auto_runs_locally_and_says_so_when_no_controller_answers(monkeypatch, tmp_path, capfd):
    _slurm_client_without_controller(tmp_path, monkeypatch)
    from fastpar.jobs import executor

    monkeypatch.setattr(executor, "_said", set())  # said once per process: an earlier test may have said it
    future = fastpar.submit(add, 1, 2)
    assert future.record.cluster == "local"
    assert future.result(timeout=120) == 3
    lines = [line for line in capfd.readouterr().err.splitlines() if "Slurm" in line]
    assert len(lines) == 1 and "running jobs on this machine" in lines[0], lines


@pytest.mark.parametrize(
    "resources",
    [
        {"cpus_per_task": 0},
        {"cpus_per_task": -2},
        {"mem_gb": -1},
        {"mem_gb": 0},
        {"gpus_per_node": -1},
        {"timeout_min": 0},
        {"slurm_cpus_per_gpu": -4},
    ],
)
def test_out_of_range_resources_are_refused_before_submitting(fake_slurm, resources):
    key = next(iter(resources))
    with pytest.raises(ValueError, match=f"{key} must"):
        fastpar.submit(add, 1, 2, cluster="slurm", resources=resources)
    assert not list(fake_slurm.iterdir())  # sbatch never ran
