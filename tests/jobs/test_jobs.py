"""fastpar.jobs on submitit's local executor: real job processes, no mocks of the engine.

Sweeps (two trials at once on disjoint cores, each bit-identical to its config trained alone; a failing
trial; resume), futures (result, callbacks, progress of a running Trainer, cancel with no orphans),
batch jobs that outlive their submitter and are fetched by id from a fresh process, and bad input.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("submitit")

import fastpar  # noqa: E402
from fastpar import jobs  # noqa: E402
from fastpar.jobs import proctree  # noqa: E402
from fastpar.jobs.cli import main as jobs_cli  # noqa: E402
from fastpar.jobs.executor import local_gpus  # noqa: E402
from fastpar.launcher import spawn  # noqa: E402
from fastpar.topology import parse_nvidia_smi  # noqa: E402
from fastpar.user_errors import UserError  # noqa: E402

pytestmark = pytest.mark.timeout(900)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "topo"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def jobs_dir(tmp_path, monkeypatch):
    folder = tmp_path / "jobs"
    monkeypatch.setenv("FASTPAR_JOBS_DIR", str(folder))
    return folder


# --- functions the jobs run (module level: job processes import this file) --------------------------
def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))


def make_sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _data(seed: int, n: int = 384) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


def train_params(config: dict, output_dir: str) -> dict[str, torch.Tensor]:
    """A real Trainer run in this process; the trained parameters."""
    x, y = _data(config["seed"])
    options = fastpar.TrainingOptions(
        execution_environment="cpu",
        devices=1,
        max_epochs=config.get("epochs", 2),
        batch_size=32,
        seed=config["seed"],
        validation_data=_data(99, 96),
        output_dir=output_dir,
        progress_bar=False,
        log_every=4,
    )
    result = fastpar.Trainer(make_model, make_sgd, torch.nn.functional.cross_entropy, (x, y), options=options).fit()
    return {k: v.clone() for k, v in result.model.state_dict().items()}


def overlapping_trial(config: dict) -> dict:
    """Announce this trial, wait (bounded) until the other trial has too — both then provably run at the
    same time — and train. A sequential run would wait out the bound and report saw_other=False."""
    if config.get("fail"):
        raise ValueError(f"bad config {config}")
    barrier = Path(config["barrier"])
    (barrier / str(config["seed"])).touch()
    deadline = time.time() + 240
    while len(list(barrier.iterdir())) < 2 and time.time() < deadline:
        time.sleep(0.05)
    saw_other = len(list(barrier.iterdir())) >= 2
    start = time.time()
    params = train_params(config, str(jobs.job_dir()))
    return {
        "start": start,
        "end": time.time(),
        "saw_other": saw_other,
        "cpus": sorted(os.sched_getaffinity(0)),
        "threads": torch.get_num_threads(),
        "params": params,
    }


def alone(rank: int, world_size: int, config: dict, output_dir: str) -> dict:
    return train_params(config, output_dir)


def add(a: int, b: int) -> int:
    jobs.report(iteration=1, value=a + b)
    return a + b


def fail_with(message: str) -> None:
    raise KeyError(message)


def long_cpu_training(output_dir: str) -> None:
    """A 2-process Trainer (elastic agent + workers) that runs far longer than the test waits."""
    x, y = _data(0, 4096)
    options = fastpar.TrainingOptions(
        execution_environment="cpu",
        devices=2,
        max_epochs=10_000,
        batch_size=8,
        output_dir=output_dir,
        progress_bar=False,
        log_every=1,
        ddp="torch",
    )
    fastpar.Trainer(make_model, make_sgd, torch.nn.functional.cross_entropy, (x, y), options=options).fit()


# --- sweep ----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_sweep_runs_trials_at_once_on_disjoint_cores_bit_identical_to_alone_and_survives_a_failure(tmp_path):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 usable CPUs for two slots")
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    configs = [
        {"seed": 1, "barrier": str(barrier)},
        {"seed": 2, "barrier": str(barrier)},
        {"seed": 3, "barrier": str(barrier), "fail": True},
    ]
    folder = tmp_path / "sweep"
    result = fastpar.sweep(
        overlapping_trial, configs, folder=folder, cpus_per_trial=1, max_parallel=2, metric="val_loss", live=True
    )

    states = [r["state"] for r in result.records]
    assert states == ["COMPLETED", "COMPLETED", "FAILED"], result.records
    assert "ValueError: bad config" in result.records[2]["error"]
    first, second = result.results[0], result.results[1]
    assert first["saw_other"] and second["saw_other"]  # both were at the barrier at once
    assert max(first["start"], second["start"]) < min(first["end"], second["end"])  # and trained at once
    assert len(first["cpus"]) == len(second["cpus"]) == 1 and first["cpus"] != second["cpus"]
    assert first["threads"] == second["threads"] == 1
    for index, trial in enumerate((first, second)):  # the same config trained alone in a fresh process
        reference = spawn(alone, 1, configs[index], str(tmp_path / f"alone{index}"), backend=None, threads=1)[0]
        for name, tensor in reference.items():
            assert torch.equal(trial["params"][name], tensor), f"trial {index}: {name} differs from training alone"

    assert result.metric == "val_loss" and result.best["trial"] in (0, 1)
    assert result.best_result is result.results[result.best["trial"]]
    assert result.plot_path.read_bytes()[:8] == PNG_MAGIC
    saved = [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]
    assert [r["state"] for r in saved] == states
    table = result.table
    pandas = pytest.importorskip("pandas")
    assert isinstance(table, pandas.DataFrame) and list(table["seed"]) == [1, 2, 3]

    # resume: the finished trials are read back, not rerun; the failed one runs again
    trial_jobs = [json.loads((Path(r["folder"]) / "job.json").read_text())["cluster_job_id"] for r in saved[:2]]
    for marker in barrier.iterdir():
        marker.unlink()
    again = fastpar.sweep(overlapping_trial, configs, folder=folder, cpus_per_trial=1, live=False, plot=False)
    assert [r["state"] for r in again.records] == states
    assert [
        json.loads((Path(r["folder"]) / "job.json").read_text())["cluster_job_id"] for r in again.records[:2]
    ] == trial_jobs
    assert again.results[0]["start"] == first["start"]
    assert list((folder / "trials").glob("*.attempt-1")), "the failed trial's first attempt is kept aside"
    assert not list(barrier.iterdir()), "no finished trial ran again"


def test_slots_from_a_recorded_gpu_topology():
    topology = parse_nvidia_smi((FIXTURES / "hgx_h100_nvswitch_nic_legend.txt").read_text())
    slots = jobs.plan_slots(gpus_per_trial=2, topology=topology)
    assert len(slots) == 4
    assert sorted(g for s in slots for g in s.gpus) == list(range(8))
    cores = [set(s.cpus) for s in slots]
    assert all(a.isdisjoint(b) for i, a in enumerate(cores) for b in cores[i + 1 :])
    with pytest.raises(ValueError, match="gpus_per_trial=9, but this machine has 8 GPU"):
        jobs.plan_slots(gpus_per_trial=9, topology=topology)


# --- submit: futures ----------------------------------------------------------------------------------------
def test_submit_future_result_callback_progress_and_failure(jobs_dir):
    future = fastpar.submit(add, 2, 3)
    called = threading.Event()
    future.add_done_callback(lambda f: called.set())
    failing = fastpar.submit(fail_with, "no such column")
    done, not_done = concurrent.futures.wait([future, failing], timeout=300)
    assert not not_done
    assert future.result() == 5 and future.state() == "COMPLETED" and called.wait(10)
    assert future.progress()["value"] == 5
    error = failing.exception()
    assert isinstance(error, KeyError) and "no such column" in str(error)
    assert any("Traceback in the job" in note for note in error.__notes__)
    assert failing.state() == "FAILED"
    assert jobs.load(future.id).result(timeout=60) == 5  # a second handle, by id


@pytest.mark.slow
def test_cancel_stops_a_running_trainer_and_every_process_it_started(jobs_dir, tmp_path):
    future = fastpar.submit(long_cpu_training, str(tmp_path / "out"), cluster="local")
    deadline = time.time() + 300
    while future.progress() is None:  # the Trainer has logged a step: agent and both workers are up
        assert not future.done(), future.exception()
        assert time.time() < deadline, "the training never reported progress"
        time.sleep(0.5)
    progress = future.progress()
    assert progress["iteration"] >= 1 and "loss" in progress
    leader = int(future.record.cluster_job_id)
    before = proctree.job_processes(leader, future.record.controller_start_ticks, future.record.process_marker)
    assert len(before) >= 4, before  # controller, job process, and the Trainer's 2 workers (+ helpers)
    assert future.running()
    assert future.cancel() and future.cancelled() and future.state() == "CANCELLED"
    alive = [
        p
        for p in before
        if (now := proctree.read_proc(p.pid)) is not None and now.alive and now.start_ticks == p.start_ticks
    ]
    assert not alive, f"left running: {alive}"
    orphans = [p for p in proctree.snapshot().values() if p.session == leader and p.alive]
    assert not orphans, f"orphans of the job's session: {orphans}"
    with pytest.raises(concurrent.futures.CancelledError):
        future.result(timeout=5)


def starts_a_daemon(pid_file: str) -> None:
    """Starts a process in a session of its own whose parent exits at once (a daemon's double fork)."""
    subprocess.run(
        ["setsid", "sh", "-c", f"sleep 600 & echo $! > {pid_file}.tmp; mv {pid_file}.tmp {pid_file}"], check=True
    )
    time.sleep(600)


def test_cancel_stops_processes_that_left_the_jobs_session(jobs_dir, tmp_path):
    pid_file = tmp_path / "daemon.pid"
    future = fastpar.submit(starts_a_daemon, str(pid_file), cluster="local")
    deadline = time.time() + 120
    while not pid_file.exists():
        assert not future.done(), future.exception()
        assert time.time() < deadline, "the job never started its daemon"
        time.sleep(0.2)
    daemon = proctree.read_proc(int(pid_file.read_text()))
    assert daemon is not None and daemon.alive
    leader = int(future.record.cluster_job_id)
    assert daemon.session != leader and daemon.ppid != leader  # neither in the session nor a child of it
    assert future.cancel()
    now = proctree.read_proc(daemon.pid)
    assert now is None or not now.alive or now.start_ticks != daemon.start_ticks, f"daemon {daemon} still running"


# --- batch: survives the submitter, fetched by id -------------------------------------------------------
SUBMITTER = """
import sys, fastpar
job = fastpar.batch(sys.argv[1], "--greeting", "hello", cluster="local", name="greeter")
print(job.id)
"""

FETCHER = """
import sys, fastpar.jobs as jobs
future = jobs.load(sys.argv[1])
future.result(timeout=300)
print("STATE", future.state())
print(future.logs())
"""

SCRIPT = """
import argparse, time
parser = argparse.ArgumentParser()
parser.add_argument("--greeting")
args = parser.parse_args()
time.sleep(2)  # still running when the submitting process has exited
print("script says", args.greeting, flush=True)
"""


@pytest.mark.slow
def test_batch_job_outlives_its_submitter_and_is_fetched_by_id_in_a_fresh_process(jobs_dir, tmp_path):
    script = tmp_path / "greet.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    submitted = subprocess.run(
        [sys.executable, "-c", SUBMITTER, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.split()[-1]
    fetched = subprocess.run(
        [sys.executable, "-c", FETCHER, job_id], env=env, capture_output=True, text=True, timeout=400, cwd=tmp_path
    )
    assert fetched.returncode == 0, fetched.stderr
    assert "STATE COMPLETED" in fetched.stdout and "script says hello" in fetched.stdout


@pytest.mark.slow
def test_jobs_cli_list_status_logs_result_cancel(jobs_dir, capsys):
    ok, bad = fastpar.submit(add, 20, 22, name="adder"), fastpar.submit(fail_with, "boom")
    concurrent.futures.wait([ok, bad], timeout=300)
    assert jobs_cli(["list"]) == 0
    listing = capsys.readouterr().out
    assert ok.id in listing and "COMPLETED" in listing and bad.id in listing and "FAILED" in listing
    assert jobs_cli(["status", ok.id, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["progress"]["value"] == 42
    assert jobs_cli(["result", ok.id]) == 0 and capsys.readouterr().out.strip() == "42"
    assert jobs_cli(["result", bad.id]) == 1 and "KeyError" in capsys.readouterr().err
    assert jobs_cli(["logs", ok.id]) == 0 and "Starting with JobEnvironment" in capsys.readouterr().out
    assert jobs_cli(["cancel", ok.id]) == 0 and "already ended (COMPLETED)" in capsys.readouterr().out
    with pytest.raises(UserError, match="no fastpar job .nosuchjob."):
        jobs_cli(["status", "nosuchjob"])


# --- bad input: clear errors before anything is submitted ---------------------------------------------------
def test_bad_input_is_refused_before_anything_is_submitted(jobs_dir, tmp_path):
    lock = threading.Lock()

    def holds_a_lock():
        return lock.locked()

    with pytest.raises(jobs.UnpicklableError, match="the function can't be sent"):
        fastpar.submit(holds_a_lock)
    with pytest.raises(jobs.UnpicklableError, match="argument 0 can't be sent"):
        fastpar.submit(add, lock, 1)
    with pytest.raises(jobs.UnpicklableError, match="config 1 can't be sent"):
        fastpar.sweep(overlapping_trial, [{"seed": 1}, {"seed": 2, "lock": lock}], folder=tmp_path / "s", live=False)
    assert not jobs_dir.exists() or not any(jobs_dir.iterdir())
    assert not (tmp_path / "s" / "trials").exists()

    with pytest.raises(jobs.JobNotFoundError, match="no fastpar job 'deadbeef'"):
        jobs.load("deadbeef")
    gpus = local_gpus()  # more than this machine has (on a cluster, the cluster judges: test_jobs_slurm.py)
    with pytest.raises(ValueError, match=f"asks for {gpus + 1} GPU"):
        fastpar.submit(add, 1, 2, resources={"gpus_per_node": gpus + 1}, cluster="local")
    with pytest.raises(ValueError, match=f"asks for {gpus + 2} GPU"):
        fastpar.batch(add, 1, 2, gpus_per_node=gpus + 2, cluster="local")
    with pytest.raises(ValueError, match=f"gpus_per_trial={gpus + 1}, but this machine has {gpus} GPU"):
        fastpar.sweep(add, [1], gpus_per_trial=gpus + 1, folder=tmp_path / "g", live=False, cluster="local")
    with pytest.raises(ValueError, match="cpus_per_trial=999"):
        fastpar.sweep(add, [1], cpus_per_trial=999, folder=tmp_path / "c", live=False, cluster="local")
    with pytest.raises(ValueError, match="unknown resource 'gpus'"):
        fastpar.submit(add, 1, 2, resources={"gpus": 1})
    with pytest.raises(ValueError, match="non-empty list of configs"):
        fastpar.sweep(add, [], folder=tmp_path / "e")
    with pytest.raises(FileNotFoundError, match="batch script"):
        fastpar.batch(tmp_path / "missing.py")
    with pytest.raises(ValueError, match="cluster must be one of"):
        fastpar.submit(add, 1, 2, cluster="kubernetes")
    assert not jobs_dir.exists() or not any(jobs_dir.iterdir())


# --- the README's examples, run as written ---------------------------------------------------------------
@pytest.mark.slow
def test_readme_examples_run_as_written(tmp_path):
    """examples/jobs_sweep.py, jobs_submit.py and the shell lines of jobs_batch.py, from a fresh folder."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "fastpar").write_text(f'#!/bin/sh\nexec {sys.executable} -m fastpar "$@"\n')  # the console script
    (bin_dir / "fastpar").chmod(0o755)
    env = {
        **os.environ,
        "FASTPAR_JOBS_DIR": str(tmp_path / "jobs"),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    examples = REPO / "examples"

    def run(command: str) -> str:
        done = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
        return done.stdout

    out = run(f"python {examples / 'jobs_sweep.py'}")
    assert "best trial by val_loss" in out and (tmp_path / "runs" / "sweep" / "curves.png").is_file()
    assert "COMPLETED" in run(f"python {examples / 'jobs_sweep.py'}")  # again: read back, nothing rerun
    out = run(f"python {examples / 'jobs_submit.py'}")
    assert "done: " in out and "now CANCELLED" in out
    out = run(
        f'id=$(python {examples / "jobs_batch.py"}) && fastpar jobs list && fastpar jobs result "$id" --wait '
        f'&& fastpar jobs logs "$id"'
    )
    assert "classifier" in out and "validation accuracy" in out


def test_bench_sweep_refuses_bad_flags(capsys):
    from fastpar.cli import main

    assert main(["bench", "sweep", "--slots", "999"]) == 2
    assert "--slots must be between 1 and" in capsys.readouterr().err
    assert main(["bench", "sweep", "-n", "3"]) == 2
    assert "-n must be 1" in capsys.readouterr().err


def test_sweep_record_and_table_show_the_same_epoch(tmp_path):
    from fastpar.jobs.channel import PROGRESS_FILE
    from fastpar.jobs.live import LiveTable
    from fastpar.jobs.results import COMPLETED, Trial, record_of
    from fastpar.train.trainer import TrainingResult

    # the last step a Trainer logs in its 4th (last) epoch: metrics.jsonl counts epochs from 0
    step = {
        "state": "iteration",
        "epoch": 3,
        "iteration": 40,
        "loss": 0.5,
        "accuracy": 0.8,
        "val_loss": 0.6,
        "val_accuracy": 0.75,
        "lr": 0.01,
        "elapsed": 3.0,
        "samples_per_s": 900.0,
        "max_epochs": 4,
        "total_steps": 40,
    }
    trainer_folder, report_folder = tmp_path / "trainer", tmp_path / "report"
    for folder, record in ((trainer_folder, step), (report_folder, {"time": 1.0, "epoch": 3, "value": 2.0})):
        folder.mkdir()
        (folder / PROGRESS_FILE).write_text(json.dumps(record) + "\n")
    result = TrainingResult(None, [step], None, None, [], False, steps=40, elapsed=3.0)
    trained = Trial(0, "a", {"lr": 0.1}, trainer_folder, state=COMPLETED, result=result)
    reported = Trial(1, "b", {"lr": 0.2}, report_folder, state=COMPLETED, result=2.0)
    table = LiveTable([trained, reported], live=False)
    epoch_column = 4
    for trial in (trained, reported):
        record = record_of(trial, json.loads((trial.folder / PROGRESS_FILE).read_text()))
        assert str(record["epoch"]) == table.row(trial)[epoch_column]
    assert record_of(trained, step)["epoch"] == 4  # as the Trainer's progress bar says: epoch 4 of 4
    assert record_of(reported, {"epoch": 3, "value": 2.0})["epoch"] == 3  # a reported epoch stays as given
