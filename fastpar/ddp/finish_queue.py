"""The pipelined bucket path: finish each bucket the moment its collective is back, not after all of them.

A bucket goes pack -> collective -> finish (unpack, average, cast back). Launching every bucket as soon
as it is packed already overlaps packing bucket k+1 with bucket k's collective: on CPU the collective
runs on gloo's threads, on GPUs on NCCL's communication stream (ordered after the pack through an
event ProcessGroupNCCL records; no host sync). :class:`FinishQueue` does the other half: it finishes
launched buckets in launch order, each as soon as :func:`is_done` says its collective is back, while
later ones are still on the wire. Polling never blocks:

- gloo: ``Work.is_completed()`` / ``Future.done()`` read a flag the worker thread set.
- NCCL: ``Work.is_completed()`` queries the collective's end event (``cudaEventQuery``, no host sync);
  the finish then orders the current stream after that event (``work.wait()``, already passed on the
  GPU) and queues the unpack kernel there, so nothing waits on the host. A comm hook's ``Future`` on
  CUDA is done once its work is *queued*; finishing it early would stall the compute stream, so DDP
  leaves those to the end of backward (``Reducer._pollable``).

Whoever finishes decides when it is safe: DDP only once no gradient of the bucket can change any more.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

__all__ = ["FinishQueue", "is_done"]

T = TypeVar("T")


def is_done(handle) -> bool:
    """Whether a collective's ``Work`` or a comm hook's ``Future`` has completed (never blocks; None: unknown, so no)."""
    if handle is None:
        return False
    if isinstance(handle, torch._C.Future):
        return handle.done()
    return handle.is_completed()


class FinishQueue:
    """Finishes launched items strictly in launch order: ``poll`` the ones already done (non-blocking),
    ``drain`` the rest (blocking, through ``finish``). ``finished`` counts the items done so far and
    ``early`` those finished by ``poll``, i.e. before the caller had to wait."""

    def __init__(self) -> None:
        self.finished = 0
        self.early = 0

    def reset(self) -> None:
        self.finished = self.early = 0

    def poll(
        self,
        items: Sequence[T],
        launched: int,
        handle: Callable[[T], object],
        finish: Callable[[T], None],
        may_finish: Callable[[T], bool] | None = None,
    ) -> int:
        """Finish ``items[finished:launched]`` while each one's collective is done (and ``may_finish``
        allows it); stop at the first that is not. Returns how many it finished."""
        start = self.finished
        while self.finished < launched:
            item = items[self.finished]
            if not is_done(handle(item)) or (may_finish is not None and not may_finish(item)):
                break
            finish(item)
            self.finished += 1
        self.early += self.finished - start
        return self.finished - start

    def drain(self, items: Sequence[T], finish: Callable[[T], None]) -> None:
        """Finish every item not finished yet, in order (``finish`` waits for each collective)."""
        while self.finished < len(items):
            finish(items[self.finished])
            self.finished += 1
