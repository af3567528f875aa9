"""Faults on the "fastpar" backend: a rank killed mid-collective, a rank that never arrives, a rank that left,
mismatched calls, a rank that dies during init_process_group or while aborting the group. The others must get an
error naming the rank within the group's timeout (never a hang), the group must stay failed afterwards, and
/dev/shm must hold nothing of the job (kill -9 included). The sweep of names a crash left removes only those whose
creator is surely gone, also when containers with their own PID namespaces share /dev/shm.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import multiprocessing as mp
import os
import queue
import signal
import stat
import subprocess
import sys
import time
import traceback

import pytest
import torch
import torch.distributed as dist

from fastpar.comm import backend as comm_backend
from fastpar.comm import list_segments, segments
from fastpar.launcher import free_port, loopback_env, spawn


def _entry(rank, world, port, pg_timeout, fn, results, setup):
    os.environ.update(loopback_env(port, rank, world))
    torch.set_num_threads(1)
    try:
        if setup is not None:
            setup(rank)
        dist.init_process_group(
            "fastpar",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        results.put((rank, "ok", fn(rank, world)))
    except Exception as exc:  # the error a user would see, as text
        results.put((rank, "error", f"{type(exc).__name__}: {exc}"))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(fn, world: int, pg_timeout: float, wait: float = 240.0, setup=None) -> tuple[dict, list[int]]:
    """Run ``fn(rank, world)`` on fresh ranks that may die; returns ({rank: (kind, value)}, pids). A rank that
    ends without a result shows as ("died", exit code). ``setup(rank)`` runs before init_process_group."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, pg_timeout, fn, results, setup)) for r in range(world)]
    for p in procs:
        p.start()
    outcome: dict = {}
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and (any(p.is_alive() for p in procs) or len(outcome) < world):
        try:
            rank, kind, value = results.get(timeout=0.5)
            outcome[rank] = (kind, value)
        except queue.Empty:
            if not any(p.is_alive() for p in procs):
                break
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(5)
    for r, p in enumerate(procs):
        outcome.setdefault(r, ("died", p.exitcode))
    return outcome, [p.pid for p in procs]


def _timed(call):
    start = time.monotonic()
    try:
        call()
        return "completed", time.monotonic() - start
    except Exception as exc:
        return str(exc), time.monotonic() - start


def _killed_mid_collective(rank: int, world: int):
    big = torch.ones(16 << 20)  # 64 MB: a few hundred steps
    dist.barrier()
    if rank == world - 1:
        dist.all_reduce(big, async_op=True)  # the worker thread is stepping through it...
        time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGKILL)  # ...when the process is killed
    first = _timed(lambda: dist.all_reduce(big))
    again = _timed(lambda: dist.all_reduce(torch.ones(4)))
    return first, again


@pytest.mark.slow
def test_rank_killed_mid_collective_is_named_and_nothing_is_left_in_dev_shm():
    outcome, pids = _run(_killed_mid_collective, 3, pg_timeout=120)
    assert outcome[2] == ("died", -signal.SIGKILL)
    for rank in (0, 1):
        kind, ((message, seconds), (again, again_seconds)) = outcome[rank]
        assert kind == "ok", outcome[rank]
        assert "rank 2" in message and "died" in message, message
        assert seconds < 60, f"rank {rank} took {seconds:.1f} s to notice (timeout 120 s)"
        assert "rank 2" in again and again_seconds < 5, (again, again_seconds)  # the group stays failed
    assert [name for name in list_segments() if any(f".{pid}." in name for pid in pids)] == []


def _never_arrives(rank: int, world: int):
    if rank == 1:
        time.sleep(8)  # alive, but never calls the collective
        return None
    return _timed(lambda: dist.all_reduce(torch.ones(10)))


@pytest.mark.slow
def test_rank_that_never_arrives_is_named_at_the_timeout():
    outcome, _ = _run(_never_arrives, 2, pg_timeout=3)
    kind, (message, seconds) = outcome[0]
    assert kind == "ok"
    assert "rank 1" in message and "did not reach all_reduce" in message and "alive" in message, message
    assert 2.5 <= seconds < 30, seconds


def _left_early(rank: int, world: int):
    if rank == 1:
        return None  # returns at once: its process group is destroyed while rank 0 still wants a collective
    time.sleep(2)
    return _timed(lambda: dist.all_reduce(torch.ones(10)))


@pytest.mark.slow
def test_rank_that_left_is_named():
    outcome, _ = _run(_left_early, 2, pg_timeout=120)
    kind, (message, seconds) = outcome[0]
    assert kind == "ok" and "rank 1" in message and "left the group" in message, outcome[0]
    assert seconds < 60


def _mismatched(rank: int, world: int):
    return _timed(lambda: dist.all_reduce(torch.ones(10 * (rank + 1))))


def test_mismatched_calls_fail_on_every_rank_with_both_calls_named():
    outcome, _ = _run(_mismatched, 2, pg_timeout=120)
    for rank in (0, 1):
        kind, (message, _seconds) = outcome[rank]
        assert kind == "ok" and "collective mismatch" in message, outcome[rank]
        assert "float32 x 10" in message and "float32 x 20" in message, message


def _broadcast_roots_disagree(rank: int, world: int):
    # Each rank names itself as the root: without the root checking the others' calls, every rank "broadcast" to
    # itself and returned its own tensor, a silent divergence.
    return _timed(lambda: dist.broadcast(torch.full((10,), float(rank)), src=rank))


@pytest.mark.slow
def test_broadcast_with_different_roots_fails_on_every_rank():
    outcome, _ = _run(_broadcast_roots_disagree, 2, pg_timeout=120)
    for rank in (0, 1):
        kind, (message, _seconds) = outcome[rank]
        assert kind == "ok" and "collective mismatch" in message, outcome[rank]
        assert "root 0" in message and "root 1" in message, message


def _broadcast_sizes_disagree(rank: int, world: int):
    return _timed(lambda: dist.broadcast(torch.zeros(10 + rank), src=0))


@pytest.mark.slow
def test_broadcast_root_learns_of_a_receiver_with_another_size():
    outcome, _ = _run(_broadcast_sizes_disagree, 2, pg_timeout=120)
    for rank in (0, 1):
        kind, (message, _seconds) = outcome[rank]
        assert kind == "ok" and "collective mismatch" in message, outcome[rank]


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_sweep_removes_segments_of_dead_creators_only(tmp_path):
    uid = os.geteuid()
    here = segments.creator_tag()
    boot, namespace = here.split(".")[:2]
    dead = _dead_pid()
    stale = tmp_path / f"fastpar.{uid}.{segments.creator_tag(dead, '12345')}.0.0"
    earlier_boot = tmp_path / f"fastpar.{uid}.{'0' * len(boot)}.{namespace}.{os.getpid()}.1.0.0"
    live = tmp_path / f"fastpar.{uid}.{here}.0.0"
    other_namespace = tmp_path / f"fastpar.{uid}.{boot}.{int(namespace) + 1}.{dead}.12345.0.0"  # pid means nothing here
    other_user = tmp_path / f"fastpar.{uid + 1}.{segments.creator_tag(dead, '1')}.0.0"
    unknown_form = tmp_path / f"fastpar.{uid}.{dead}.12345.0.0"
    for path in (stale, earlier_boot, live, other_namespace, other_user, unknown_form):
        path.write_bytes(b"x")
    assert sorted(segments.sweep_stale_segments(tmp_path)) == sorted([stale.name, earlier_boot.name])
    assert live.exists() and other_namespace.exists() and other_user.exists() and unknown_form.exists()


def _unshare_pid_namespace() -> list[str]:
    """The command prefix that runs a process in a new PID namespace with its own /proc (a container's view), as
    this user; skips the test where this machine does not allow it."""
    command = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
    if os.geteuid() != 0:
        command[1:1] = ["--user", f"--map-user={os.geteuid()}", f"--map-group={os.getegid()}"]
    try:
        probe = subprocess.run([*command, "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        probe = None
    if probe is None or probe.returncode != 0:
        pytest.skip("cannot create a PID namespace here (unshare)")
    return command


def test_sweep_leaves_a_live_segment_made_in_another_pid_namespace(tmp_path):
    # Two containers sharing /dev/shm: the creator's pid is 1 in its own namespace, which here is another process.
    code = (
        "import sys, time; from pathlib import Path; from fastpar.comm import segments; "
        "Path(sys.argv[1], segments.segment_name('other').lstrip('/')).write_bytes(b'x'); "
        "print('made', flush=True); time.sleep(120)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    creator = subprocess.Popen(
        [*_unshare_pid_namespace(), sys.executable, "-c", code, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert creator.stdout.readline().strip() == "made"
        made = [p.name for p in tmp_path.iterdir()]
        assert len(made) == 1, made
        assert segments.sweep_stale_segments(tmp_path) == []
        assert (tmp_path / made[0]).exists()
    finally:
        creator.kill()
        creator.wait(30)


def _dies_on_reading_the_plan(rank: int) -> None:
    """Rank 1 dies once rank 0 has created the segment, before mapping it or saying so."""
    if rank != 1:
        return

    class DieOnLoads:
        dumps = staticmethod(json.dumps)

        @staticmethod
        def loads(text):  # the backend reads the segment's name from the plan rank 0 published
            os._exit(3)

    comm_backend.json = DieOnLoads


def _unreachable(rank: int, world: int):
    return "init_process_group returned"


@pytest.mark.slow
def test_peer_dying_during_init_leaves_nothing_in_dev_shm():
    outcome, pids = _run(_unreachable, 2, pg_timeout=5, wait=120, setup=_dies_on_reading_the_plan)
    left = [name for name in list_segments() if f".{pids[0]}." in name]
    for name in left:
        (segments.SHM_DIR / name).unlink(missing_ok=True)
    assert outcome[1] == ("died", 3), outcome
    assert left == [], f"rank 0 left {left} in /dev/shm"
    kind, message = outcome[0]
    assert kind == "error" and "rank(s) [1]" in message, outcome[0]


_SEGMENT_MAGIC = 0x66617374706172_04  # csrc/shm/segment.cpp kMagic
_ABORTED_OFFSET = 128  # offsetof(Header, aborted): after two 64-byte lines


def _segment_header() -> int:
    """Address of this process's mapping of the group's segment (its name is unlinked: '(deleted)')."""
    for line in open("/proc/self/maps"):
        fields = line.split()
        if len(fields) >= 6 and "/dev/shm/fastpar." in fields[5] and int(fields[2], 16) == 0:
            address = int(fields[0].split("-")[0], 16)
            if ctypes.c_uint64.from_address(address).value == _SEGMENT_MAGIC:
                return address
    raise AssertionError("no fastpar segment mapped in this process")


def _dies_while_aborting(rank: int, world: int):
    dist.barrier()
    if rank == 1:
        ctypes.c_uint32.from_address(_segment_header() + _ABORTED_OFFSET).value = 1  # claims the abort...
        os.kill(os.getpid(), signal.SIGKILL)  # ...and dies before it writes why
    time.sleep(1)
    return _timed(lambda: dist.all_reduce(torch.ones(4)))


@pytest.mark.slow
def test_rank_dying_while_it_aborts_the_group_is_named():
    outcome, _ = _run(_dies_while_aborting, 2, pg_timeout=120, wait=60)
    assert outcome[1] == ("died", -signal.SIGKILL)
    kind, value = outcome[0]
    assert kind == "ok", f"rank 0 did not return (a hang ends as 'died'): {outcome[0]}"
    message, seconds = value
    assert "rank 1" in message and "died" in message, message
    assert seconds < 30, seconds


def _status(rank: int, world: int):
    import fastpar

    t = torch.ones(3) * (rank + 1)
    dist.all_reduce(t)
    return fastpar.comm.shm_status(), t.tolist()


@pytest.mark.slow
def test_next_group_removes_a_segment_a_crash_left():
    stale = segments.SHM_DIR / f"fastpar.{os.geteuid()}.{segments.creator_tag(_dead_pid(), '777')}.0.0"
    stale.write_bytes(b"left by a crash during init")
    try:
        results = spawn(_status, 2, backend="fastpar", timeout=300)
        assert not stale.exists()
        assert all(status["shm"] for status, _ in results)
    finally:
        stale.unlink(missing_ok=True)


def test_segment_is_private_to_the_user_and_reserved():
    from fastpar.ops import loader

    ext = loader.extension()
    if ext is None or not hasattr(ext, "shm_create"):
        pytest.skip("the compiled extension is not available")
    name = segments.segment_name("test")
    ext.shm_create(name, 2, 64 * 1024, 4, 1234)
    try:
        info = os.stat(segments.SHM_DIR / name.lstrip("/"))
        assert stat.S_IMODE(info.st_mode) == 0o600
        assert info.st_size == ext.shm_segment_bytes(2, 64 * 1024, 4)
        assert info.st_blocks * 512 >= info.st_size  # pages reserved, not sparse
    finally:
        ext.shm_unlink(name)


@pytest.mark.slow
def test_disabled_shm_falls_back_to_gloo_with_the_reason(monkeypatch):
    monkeypatch.setenv("FASTPAR_SHM", "0")  # inherited by the spawned ranks
    for status, total in spawn(_status, 2, backend="fastpar", timeout=300):
        assert status == {"backend": "fastpar", "shm": False, "reason": "disabled by FASTPAR_SHM=0", "nodes": 0}
        assert total == [3.0, 3.0, 3.0]


def test_reasons_for_gloo():
    same = ["h|b|1|0"] * 3
    assert comm_backend._why_not(same) == ""
    assert "host of its own" in comm_backend._why_not(["a|b|1|0", "c|b|1|0"])
    assert comm_backend._why_not(["a|b|1|0", "a|b|1|0", "c|b|1|0"]) == ""  # across nodes: hierarchical
    assert comm_backend._node_layout(["a", "c", "a", "d", "c"]) == [0, 1, 0, 2, 1]
    assert "above" in comm_backend._why_not(["h"] * (comm_backend.MAX_RANKS + 1))
