"""A known torch 2.13 failure outside fastpar: a torchrun worker that has finished its script sometimes aborts
while the interpreter shuts down ("terminate called without an active exception", SIGABRT, no Python frame).
It reproduces with stock torch alone (DDP on gloo, then ``destroy_process_group``) in a fresh venv. Tests that
launch torchrun run such a launch once more when -- and only when -- it failed with exactly that signature."""

from __future__ import annotations

SIGNATURE = "terminate called without an active exception"


def aborted_at_teardown(returncode: int | None, output: str) -> bool:
    return returncode != 0 and SIGNATURE in output
