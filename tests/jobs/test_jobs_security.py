"""What a job folder may do to whoever looks at it: listing and status unpickle nothing, a job id is not a
path, a forged ``job.json`` makes ``cancel`` signal nothing, a failed cancel leaves no process stopped, and
job folders and files are their owner's only."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("submitit")

import fastpar  # noqa: E402
from fastpar import jobs  # noqa: E402
from fastpar.jobs import proctree  # noqa: E402
from fastpar.jobs.cli import main as jobs_cli  # noqa: E402
from fastpar.jobs.store import JobRecord  # noqa: E402
from fastpar.user_errors import UserError  # noqa: E402

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def jobs_dir(tmp_path, monkeypatch):
    folder = tmp_path / "jobs"
    monkeypatch.setenv("FASTPAR_JOBS_DIR", str(folder))
    return folder


class _Planted:
    """Unpickling this creates a file: proof that someone unpickled it."""

    def __init__(self, witness: Path) -> None:
        self.witness = witness

    def __reduce__(self):
        return (Path.touch, (self.witness,))


def _plant_job(root: Path, job_id: str, cluster_job_id: str, **fields) -> Path:
    folder = root / job_id
    folder.mkdir(parents=True)
    record = {"id": job_id, "name": "planted", "kind": "submit", "cluster": "local", "folder": str(folder)}
    record.update(cluster_job_id=cluster_job_id, submitted="2026-01-01T00:00:00+00:00", **fields)
    (folder / "job.json").write_text(json.dumps(record))
    return folder


def _result_pickle(folder: Path, cluster_job_id: str) -> Path:
    from submitit.core.utils import JobPaths

    return JobPaths(folder, cluster_job_id, 0).result_pickle


def _exited_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_list_and_status_unpickle_no_result(jobs_dir, tmp_path, capsys):
    witness = tmp_path / "unpickled"
    pid = str(_exited_pid())
    done = _plant_job(jobs_dir, "done", pid, controller_start_ticks=1, process_marker="m")
    _result_pickle(done, pid).write_bytes(pickle.dumps(("success", _Planted(witness))))
    odd = _plant_job(jobs_dir, "odd", pid, controller_start_ticks=1, process_marker="m")
    _result_pickle(odd, pid).write_bytes(pickle.dumps(_Planted(witness)))  # not submitit's (tag, value)

    assert jobs_cli(["list", "--json"]) == 0
    states = {row["id"]: row["state"] for row in map(json.loads, capsys.readouterr().out.splitlines())}
    assert jobs_cli(["list"]) == 0 and "COMPLETED" in capsys.readouterr().out
    for job_id in ("done", "odd"):
        assert jobs_cli(["status", job_id, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["state"] == states[job_id]
        assert jobs_cli(["logs", job_id]) == 0 and jobs_cli(["cancel", job_id]) == 0
        assert "already ended" in capsys.readouterr().out
    assert not witness.exists(), "listing or status unpickled a job's result"
    assert states == {"done": "COMPLETED", "odd": "FAILED"}

    jobs_cli(["result", "done"])  # result() unpickles, by design: the planted pickle is a live one
    assert witness.exists()


def test_a_job_id_is_not_a_path(jobs_dir, tmp_path):
    pid = str(_exited_pid())
    _plant_job(tmp_path, "outside", pid)  # a job folder next to the jobs root, not in it
    (tmp_path / "job.json").write_text((tmp_path / "outside" / "job.json").read_text())
    jobs_dir.mkdir()
    for climbing in ("..", "../outside", f"{jobs_dir}/../outside"):
        with pytest.raises(UserError, match=r"not a job id|must not contain '\.\.'"):
            jobs_cli(["status", climbing])
        with pytest.raises(ValueError, match=r"not a job id|must not contain '\.\.'"):
            jobs.load(climbing)
    for odd in (".hidden", "a b", "x" * 65, ""):
        with pytest.raises(ValueError, match="not a job id"):
            jobs.load(odd)
    assert jobs.load(tmp_path / "outside").id == "outside"  # a job folder named by its path still works


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to hand a folder to nobody")
def test_a_job_folder_of_another_user_is_refused(jobs_dir):
    folder = _plant_job(jobs_dir, "theirs", str(_exited_pid()))
    for path in (folder, folder / "job.json"):
        os.chown(path, 65534, 65534)
    with pytest.raises(UserError, match="belongs to user id 65534"):
        jobs_cli(["status", "theirs"])
    assert jobs.list_jobs() == []


def _state(pid: int) -> str:
    proc = proctree.read_proc(pid)
    return proc.state if proc is not None else "gone"


@pytest.mark.parametrize(
    "forged",
    [
        {"controller_start_ticks": None, "process_marker": None},
        {"controller_start_ticks": None, "process_marker": "forged"},
        {"controller_start_ticks": "real", "process_marker": "forged"},
    ],
    ids=["no-ticks-no-marker", "no-ticks", "marker-not-carried"],
)
def test_cancel_of_a_forged_record_signals_nothing(jobs_dir, capsys, forged):
    bystander = subprocess.Popen(["sleep", "120"], start_new_session=True)  # a process of the user, not a job's
    try:
        ticks = proctree.read_proc(bystander.pid).start_ticks
        fields = {**forged, "controller_start_ticks": ticks if forged["controller_start_ticks"] else None}
        _plant_job(jobs_dir, "forged", str(bystander.pid), **fields)
        assert jobs_cli(["cancel", "forged"]) == 0
        said = capsys.readouterr().out
        assert "nothing was signalled" in said, said
        time.sleep(0.2)
        assert bystander.poll() is None and _state(bystander.pid) in ("S", "R"), _state(bystander.pid)
        with pytest.raises(proctree.JobProcessesError, match="nothing was signalled"):
            proctree.kill_job(bystander.pid, None, marker=None)
        if forged["process_marker"]:
            assert proctree.kill_job(bystander.pid, fields["controller_start_ticks"], marker="forged") == []
        assert bystander.poll() is None and _state(bystander.pid) in ("S", "R")
    finally:
        bystander.kill()
        bystander.wait()


def _start_marked_tree(marker: str, children: int = 3) -> subprocess.Popen:
    """A controller in a session of its own carrying ``marker``, with ``children`` sleeping children."""
    script = " ".join(["sleep 120 &"] * children) + " wait"
    env = {**os.environ, proctree.MARKER_ENV: marker}
    leader = subprocess.Popen(["sh", "-c", script], env=env, start_new_session=True)
    deadline = time.monotonic() + 30
    ticks = proctree.read_proc(leader.pid).start_ticks
    while len(proctree.job_processes(leader.pid, ticks, marker)) < children + 1:
        assert time.monotonic() < deadline, "the children never started"
        time.sleep(0.05)
    return leader


def test_a_signal_failing_half_way_leaves_no_process_stopped(monkeypatch):
    leader = _start_marked_tree("halfway")
    ticks = proctree.read_proc(leader.pid).start_ticks
    members = [p.pid for p in proctree.job_processes(leader.pid, ticks, "halfway")]
    real_kill, signalled = os.kill, []

    def kill_refusing_the_second(pid: int, sig: int) -> None:
        if pid not in signalled:
            signalled.append(pid)
        if len(signalled) >= 2 and pid == signalled[1] and sig != signal.SIGCONT:
            raise PermissionError(1, "Operation not permitted")
        real_kill(pid, sig)

    monkeypatch.setattr(os, "kill", kill_refusing_the_second)
    try:
        with pytest.raises((PermissionError, getattr(proctree, "JobProcessesError", PermissionError))):
            proctree.kill_job(leader.pid, ticks, marker="halfway")
        monkeypatch.setattr(os, "kill", real_kill)
        time.sleep(0.2)
        stopped = [pid for pid in members if _state(pid) == "T"]
        assert not stopped, f"left stopped: {stopped}"
        assert all(_state(pid) in ("S", "R") for pid in members)
    finally:
        monkeypatch.setattr(os, "kill", real_kill)
        os.killpg(leader.pid, signal.SIGKILL)  # the tree this test started: its own process group
        leader.wait()
    # and a cancel that can signal kills the whole tree
    leader = _start_marked_tree("whole")
    ticks = proctree.read_proc(leader.pid).start_ticks
    killed = proctree.kill_job(leader.pid, ticks, marker="whole")
    leader.wait()
    assert leader.pid in killed and len(killed) == 4
    assert all(_state(pid) in ("gone", "Z") for pid in killed)


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_job_folders_and_files_are_private(jobs_dir):
    umask = current_umask()
    future = fastpar.submit(current_umask, cluster="local")
    assert future.result(timeout=300) == umask, "the function runs with the submitter's umask"
    assert current_umask() == umask
    assert stat.S_IMODE(jobs_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(future.folder.stat().st_mode) == 0o700
    files = [p for p in future.folder.rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert "job.json" in names and "controller.log" in names and any(n.endswith("_result.pkl") for n in names)
    assert any(n.endswith("_submitted.pkl") for n in names) and any(n.endswith("_log.out") for n in names)
    assert "progress.jsonl" in names
    loose = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in files if stat.S_IMODE(p.stat().st_mode) != 0o600}
    assert not loose, f"job files readable by others: {loose}"


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv to act as a second user",
)
def test_another_user_can_read_no_job_file(monkeypatch):
    base = Path(tempfile.mkdtemp(prefix="fastpar-jobs-"))
    try:
        base.chmod(0o755)  # a place another user can reach: only the jobs root's own modes keep them out
        monkeypatch.setenv("FASTPAR_JOBS_DIR", str(base / "jobs"))
        future = fastpar.submit(current_umask, cluster="local")
        future.result(timeout=300)
        result = _result_pickle(future.folder, future.record.cluster_job_id)
        for path in (result, future.folder / "job.json"):
            as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "cat", str(path)]
            read = subprocess.run(as_nobody, capture_output=True, timeout=60)
            assert read.returncode != 0 and b"Permission denied" in read.stderr, (path, read)
    finally:
        shutil.rmtree(base)


def test_fixed_temporary_names_follow_no_planted_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    folder = tmp_path / "job"
    folder.mkdir()
    (folder / "job.tmp").symlink_to(victim)  # the name job.json's writer used to go through
    record = JobRecord(id="job", name="n", kind="submit", cluster="local", folder=str(folder))
    record.save()
    assert victim.read_text() == "precious"
    assert not (folder / "job.json").is_symlink() and JobRecord.load(folder).name == "n"
    assert stat.S_IMODE((folder / "job.json").stat().st_mode) == 0o600

    pytest.importorskip("matplotlib")
    from fastpar.jobs.curves import plot_trials

    curves = tmp_path / "curves.png"
    (tmp_path / f".curves.png.tmp-{os.getpid()}.png").symlink_to(victim)  # the temporary name it used to take
    assert plot_trials(["a"], [[{"iteration": 1, "loss": 1.0}]], curves) == curves
    assert victim.read_text() == "precious" and curves.read_bytes().startswith(b"\x89PNG")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_a_slurm_job_killed_at_its_time_limit_before_writing_a_result_names_the_limit(jobs_dir, monkeypatch):
    # Slurm may kill the task before submitit's handler of the warning signal has written a result
    from fastpar.jobs import slurm

    monkeypatch.setattr(slurm, "job_state", lambda job_id: "TIMEOUT")
    reasons = {"TIMEOUT": "JobState TIMEOUT, Reason TimeLimit, TimeLimit 00:01:00, RunTime 00:01:06"}
    for state, fields in (("TIMEOUT", {"timeout_min": 1}), ("OUT_OF_MEMORY", {})):
        monkeypatch.setattr(slurm, "job_reason", lambda job_id, s=state: reasons.get(s, f"JobState {s}"))
        folder = _plant_job(jobs_dir, f"slurm-{state.lower()}", "4242", resources=fields)
        record = json.loads((folder / "job.json").read_text())
        (folder / "job.json").write_text(json.dumps({**record, "cluster": "slurm"}))
        future = jobs.load(folder.name)
        with pytest.raises(jobs.JobFailedError) as caught:
            future.result(timeout=60)
        message = str(caught.value)
        if state == "TIMEOUT":
            assert "exceeded its time limit (1 min)" in message and "Slurm said: JobState TIMEOUT" in message
        else:
            assert "ended without a result" in message and "JobState OUT_OF_MEMORY" in message
