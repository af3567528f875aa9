"""fastpar.jobs on a real Slurm: sweeps, submit, batch, cancel, failures and time limits as Slurm jobs.

Run against the one-node cluster ``scripts/slurm-up.sh`` starts (CI does); skipped, saying why, where no
Slurm controller answers. Accounting is off on that cluster, so these tests also show that job states come
from the controller without submitit's sacct warnings.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

pytest.importorskip("submitit")

import fastpar  # noqa: E402
from fastpar.jobs import slurm  # noqa: E402
from fastpar.jobs.future import JobFailedError  # noqa: E402
from fastpar.jobs.submission import JobSubmitError  # noqa: E402
from fastpar.launcher import free_port  # noqa: E402

_PROBLEM = slurm.controller_problem()
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        _PROBLEM is not None, reason=f"no Slurm cluster to run on: {_PROBLEM} (scripts/slurm-up.sh starts one, as root)"
    ),
]
REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parents[1] / "support" / "cluster_train_script.py"
SACCT_WARNING = "Bypassing sacct error"


@pytest.fixture
def jobs_dir(tmp_path, monkeypatch):
    folder = tmp_path / "jobs"
    monkeypatch.setenv("FASTPAR_JOBS_DIR", str(folder))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return folder


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.5)
    raise AssertionError(f"{what} did not happen within {timeout:g} s")


def _in_squeue(job_id: str) -> bool:
    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, check=True).stdout
    return job_id in out.split()


# --- functions the jobs run (module level: job processes import this file) --------------------------
def where_am_i(config: dict) -> dict:
    import torch

    job = os.environ.get("SLURM_JOB_ID")
    shown = subprocess.run(["scontrol", "show", "job", "-d", job], capture_output=True, text=True).stdout
    return {
        "job": job,
        "cpus": sorted(os.sched_getaffinity(0)),
        "allocated": re.findall(r"CPU_IDs=(\S+)", shown),  # the controller's word, whether or not it binds
        "threads": torch.get_num_threads(),
        "square": config["x"] ** 2,
    }


def reporting(steps: int, release: str) -> int:
    from fastpar.jobs import report

    for step in range(steps):
        report(iteration=step, loss=1.0 / (step + 1))
    while not Path(release).exists():  # stays running until the test has seen its progress
        time.sleep(0.1)
    return steps


def sleeping(seconds: float) -> None:
    time.sleep(seconds)


def failing(message: str) -> None:
    raise ValueError(message)


# --- the tests ------------------------------------------------------------------------------------------
def test_sweep_trials_are_slurm_jobs_on_their_own_cores(jobs_dir, tmp_path, capfd):
    configs = [{"x": 2}, {"x": 3}]
    result = fastpar.sweep(
        where_am_i, configs, folder=tmp_path / "sweep", cluster="slurm", cpus_per_trial=1, live=False, plot=False
    )
    assert [r["state"] for r in result.records] == ["COMPLETED", "COMPLETED"], result.records
    first, second = result.results
    assert first["square"] == 4 and second["square"] == 9
    assert first["job"] and second["job"] and first["job"] != second["job"]
    # --cpus-per-task=1: each trial on the one CPU Slurm allocated to it, whether the cluster binds tasks
    # (TaskPlugin=task/affinity) or not (task/none: fastpar pins the trial)
    for trial in (first, second):
        assert trial["allocated"] == [str(cpu) for cpu in trial["cpus"]] and len(trial["cpus"]) == 1, trial
    assert first["threads"] == second["threads"] == 1
    assert SACCT_WARNING not in "".join(capfd.readouterr())


@pytest.mark.slow
def test_submit_reports_progress_and_returns_without_sacct_warnings(jobs_dir, tmp_path, capfd):
    release = tmp_path / "release"
    future = fastpar.submit(reporting, 3, str(release), cluster="slurm", resources={"timeout_min": 5})
    assert future.record.cluster == "slurm" and future.record.cluster_job_id.isdigit()
    latest = _wait_for(lambda: (p := future.progress()) and p.get("iteration") == 2 and p, 120, "progress")
    assert latest["loss"] == pytest.approx(1 / 3)
    assert future.state() == "RUNNING"
    release.touch()
    assert future.result(timeout=120) == 3
    assert [r["iteration"] for r in future.history()] == [0, 1, 2]
    assert future.state() == "COMPLETED"
    captured = capfd.readouterr()
    assert SACCT_WARNING not in captured.out + captured.err


@pytest.mark.slow
def test_batch_result_fetched_from_a_fresh_process(jobs_dir, tmp_path):
    script = tmp_path / "hello.py"
    script.write_text("import os, sys\nprint('hello from', os.environ['SLURM_JOB_ID'], sys.argv[1:])\n")
    job = fastpar.batch(script, "a", "b", cluster="slurm", resources={"timeout_min": 5})
    fetch = (
        "import sys, fastpar.jobs as j; f = j.load(sys.argv[1]); v = f.result(timeout=180); "
        "print('state', f.state(), 'value', v)"
    )
    done = subprocess.run([sys.executable, "-c", fetch, job.id], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert "state COMPLETED value None" in done.stdout
    assert SACCT_WARNING not in done.stdout + done.stderr
    assert f"hello from {job.record.cluster_job_id} ['a', 'b']" in job.logs()


@pytest.mark.slow
def test_cancel_takes_the_job_off_the_queue(jobs_dir):
    future = fastpar.submit(sleeping, 600, cluster="slurm", resources={"timeout_min": 15})
    job_id = future.record.cluster_job_id
    _wait_for(lambda: future.state() == "RUNNING", 120, "the job running")
    assert _in_squeue(job_id)
    done = subprocess.run(
        [sys.executable, "-m", "fastpar", "jobs", "cancel", future.id], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and f"job {future.id} cancelled" in done.stdout, done.stdout + done.stderr
    _wait_for(lambda: not _in_squeue(job_id), 60, f"job {job_id} leaving squeue")
    _wait_for(lambda: future.done(), 30, "the future seeing the cancel")
    assert future.cancelled() and future.state() == "CANCELLED"
    assert slurm.job_state(job_id) in ("CANCELLED", "COMPLETING")


@pytest.mark.slow
def test_a_failing_job_raises_its_own_error(jobs_dir, capfd):
    future = fastpar.submit(failing, "bad input", cluster="slurm", resources={"timeout_min": 5})
    with pytest.raises(ValueError, match="bad input") as caught:
        future.result(timeout=180)
    assert any("Traceback in the job" in note for note in getattr(caught.value, "__notes__", []))
    assert future.state() == "FAILED"
    assert SACCT_WARNING not in "".join(capfd.readouterr())


def test_what_the_cluster_cannot_give_is_one_clear_error(jobs_dir):
    with pytest.raises(JobSubmitError) as caught:  # a petabyte of memory
        fastpar.submit(sleeping, 1, cluster="slurm", resources={"mem_gb": 1_000_000})
    message = str(caught.value)
    assert "\n" not in message and "slurm refused the job 'sleeping'" in message and "mem_gb=1000000" in message
    assert "Memory specification can not be satisfied" in message


@pytest.mark.slow
def test_a_job_over_its_time_limit_fails_naming_the_limit(jobs_dir):
    future = fastpar.submit(sleeping, 600, cluster="slurm", resources={"timeout_min": 1})
    with pytest.raises(JobFailedError, match=r"time limit \(1 min\)"):
        future.result(timeout=300)
    assert future.state() == "FAILED"
    _wait_for(lambda: not _in_squeue(future.record.cluster_job_id), 120, "the job leaving squeue")


def _torchrun_reference(out: Path) -> dict[str, torch.Tensor]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(GLOO_SOCKET_IFNAME="lo", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        f"--rdzv-id={uuid.uuid4().hex}",
        str(SCRIPT),
        str(out),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    return torch.load(out)


@pytest.mark.slow
def test_batch_with_two_processes_runs_the_cluster_environment_under_srun(jobs_dir, tmp_path):
    if int(subprocess.run(["sinfo", "-h", "-o", "%c"], capture_output=True, text=True).stdout.split()[0]) < 2:
        pytest.skip("needs a Slurm node with 2 CPUs")
    out = tmp_path / "params.pt"
    job = fastpar.batch(
        SCRIPT, out, nodes=1, processes_per_node=2, cluster="slurm", resources={"cpus_per_task": 2, "timeout_min": 10}
    )
    assert job.record.num_tasks == 1 and job.record.result_from == "rank0"
    assert job.result(timeout=400) is None, job.logs()
    assert "saved rank 0's parameters" in job.logs()
    reference = _torchrun_reference(tmp_path / "reference.pt")
    params = torch.load(out)
    assert params.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(params[name], tensor), f"{name} differs from torchrun with 2 processes"
