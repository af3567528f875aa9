"""Shared-memory segment names another local user can neither guess nor take first.

Every part of a segment name but its random one can be read from /proc by any user. A name that exists anyway
(another user created it first) is retried under a new one: the group stays on shared memory, and the squatter's
file is never opened.
"""

from __future__ import annotations

import datetime
import os
import pwd
import re

import pytest
import torch
import torch.distributed as dist

from fastpar.comm import segments
from fastpar.launcher import LOOPBACK, loopback_store, spawn


def _without_counter(name: str) -> str:
    head, last = name.rsplit(".", 1)
    return f"{head}.{last.lstrip('0123456789')}"  # the per-process counter is guessable


def test_segment_names_differ_in_an_unguessable_part():
    first, second = segments.segment_name("g"), segments.segment_name("g")
    assert _without_counter(first) != _without_counter(second), (first, second)
    assert re.fullmatch(r"-[0-9a-f]{16,}", _without_counter(first).rsplit(".", 1)[1]), first


def test_a_taken_name_is_retried_and_other_errors_pass_through(monkeypatch):
    calls = []

    def create(name):
        calls.append(name)
        if len(calls) == 1:
            raise RuntimeError(f"fastpar shm: cannot create {name}: File exists (errno 17)")

    name = segments.create_segment(create, "g")
    assert name == calls[1] != calls[0]

    def full(name):
        raise RuntimeError(f"fastpar shm: cannot reserve 1 MB in /dev/shm for {name}: No space left (errno 28)")

    with pytest.raises(RuntimeError, match="errno 28"):
        segments.create_segment(full, "g")


def _squatted_rank(rank: int, world_size: int, port: int, squatter_uid: int) -> dict:
    import fastpar
    from fastpar.comm import backend

    timeout = datetime.timedelta(seconds=60)
    store = loopback_store(60.0, port) if rank == 0 else dist.TCPStore(LOOPBACK, port, None, False, timeout)
    squat = None
    if rank == 0:
        # another user creates the name this process will make next: the name, as a squatter would predict it
        squat = segments.segment_name("squatted")
        path = segments.SHM_DIR / squat.lstrip("/")
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        os.chown(path, squatter_uid, squatter_uid)
        real, predicted = segments.segment_name, iter([squat])
        for module in (segments, backend):  # wherever the backend takes its names from
            if hasattr(module, "segment_name"):
                module.segment_name = lambda group, real=real: next(predicted, None) or real(group)
    try:
        dist.init_process_group("fastpar", store=store, rank=rank, world_size=world_size)
        total = torch.ones(3) * (rank + 1)
        dist.all_reduce(total)
        status = fastpar.comm.shm_status()
        dist.destroy_process_group()
        squat_owner = os.stat(segments.SHM_DIR / squat.lstrip("/")).st_uid if squat else None
    finally:
        if squat:
            os.unlink(segments.SHM_DIR / squat.lstrip("/"))
    return {"status": status, "total": total.tolist(), "squat_owner": squat_owner}


def test_squatted_segment_name_is_retried_not_a_gloo_fallback():
    from fastpar.comm import is_available
    from fastpar.launcher import free_port

    if not is_available():
        pytest.skip("the shared-memory backend is not available (compiled extension or /dev/shm missing)")
    if os.geteuid() != 0:
        pytest.skip("simulating another user's file in /dev/shm needs root (os.chown to nobody)")
    nobody = pwd.getpwnam("nobody").pw_uid
    results = spawn(_squatted_rank, 2, free_port(), nobody, backend=None, timeout=240)
    for result in results:
        assert result["status"]["shm"], result["status"]
        assert result["total"] == [3.0, 3.0, 3.0]
    assert results[0]["squat_owner"] == nobody  # the squatter's file was left alone
