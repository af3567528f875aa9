"""Waiting for bucket collectives: a deadline that names who is missing, and the time spent waiting.

gloo (CPU): the host blocks in ``work.wait(timeout)``; a timeout becomes a :class:`BucketTimeoutError`.
NCCL: ``work.wait()`` only orders the current CUDA stream after the collective (no host sync, as in
torch's DDP), so ``wait()`` returns at once and a host-side deadline on ``is_completed()`` is watched
from a background thread (:class:`CompletionWatch`). An overdue bucket is diagnosed (which ranks never
arrived, through the store), written to stderr at once -- the training thread may be blocked in a CUDA
sync, and NCCL's own watchdog will end the process at the group's timeout -- and raised at the
reducer's next entry. The watch is plain Python over ``Work.is_completed()``: tests drive it on gloo.

Time waited: the host clock on CPU; on GPU, CUDA events around the stream waits (the time the compute
stream stalled for communication), read lazily so a step never syncs for its statistics.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .comm_hooks import hook_result
from .errors import BucketTimeoutError

__all__ = ["BucketWaiter", "CompletionWatch", "WaitTimer"]


def _is_future(handle) -> bool:
    return isinstance(handle, torch._C.Future)  # what work.get_future() and comm hooks return


@dataclass
class _Tracked:
    step: int
    bucket_index: int
    names: list[str]
    work: object
    started: float


class CompletionWatch:
    """Host-side deadlines on in-flight collectives. ``check()`` is one pass (the thread calls it every
    ``poll_s``); an overdue entry becomes an error from ``diagnose(step, bucket_index, names, cause)``."""

    def __init__(
        self,
        deadline_s: float,
        diagnose: Callable[[int, int, list[str], BaseException], BucketTimeoutError],
        *,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float = 0.05,
        start_thread: bool = True,
    ) -> None:
        self.deadline_s = deadline_s
        self._diagnose = diagnose
        self._clock = clock
        self._poll_s = poll_s
        self._start_thread = start_thread
        self._entries: list[_Tracked] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BucketTimeoutError | None = None

    def track(self, step: int, bucket_index: int, names: list[str], work) -> None:
        with self._lock:
            self._entries.append(_Tracked(step, bucket_index, names, work, self._clock()))
        if self._start_thread and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fastpar-ddp-watch", daemon=True)
            self._thread.start()

    def check(self) -> BucketTimeoutError | None:
        now = self._clock()
        with self._lock:
            self._entries = [e for e in self._entries if not e.work.is_completed()]
            overdue = next((e for e in self._entries if now - e.started > self.deadline_s), None)
            if overdue is not None:
                self._entries.clear()
        if overdue is None or self.error is not None:
            return None
        cause = TimeoutError(f"the collective did not complete within {self.deadline_s:.1f} s (host-side deadline)")
        error = self._diagnose(overdue.step, overdue.bucket_index, overdue.names, cause)
        self.error = error
        print(f"[fastpar DDP] {error}", file=sys.stderr, flush=True)
        return error

    def raise_if_failed(self) -> None:
        error, self.error = self.error, None
        if error is not None:
            raise error

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                self.check()
            except Exception as exc:  # never let the watch die silently: report, keep watching
                print(f"[fastpar DDP] completion watch failed: {exc}", file=sys.stderr, flush=True)


class WaitTimer:
    """Seconds the last synchronised step waited for communication after backward."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._start: float | torch.cuda.Event = 0.0
        self._events: tuple | None = None
        self._seconds = 0.0

    def start(self) -> None:
        if self._cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def stop(self) -> None:
        if self._cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events = (self._start, end)
        else:
            self._seconds = time.perf_counter() - self._start

    def seconds(self) -> float:
        if self._events is not None:  # CPU-GPU sync point, only when someone reads the statistics
            begin, end = self._events
            end.synchronize()
            self._seconds = begin.elapsed_time(end) / 1000.0
            self._events = None
        return self._seconds


class BucketWaiter:
    """Waits for one bucket's collective (a ``Work``, or a comm hook's ``Future``) and turns a failure into
    a :class:`BucketTimeoutError` naming the bucket, its parameters and the ranks that never arrived."""

    def __init__(
        self,
        device: torch.device,
        timeout_s: float,
        diagnose: Callable[[int, int, list[str], float, BaseException], BucketTimeoutError],
        *,
        host_blocking: bool | None = None,
    ) -> None:
        self.device = device
        self.timeout_s = timeout_s
        self.host_blocking = device.type == "cpu" if host_blocking is None else host_blocking
        self.grace_s = min(10.0, max(2.0, 0.15 * timeout_s))
        self._diagnose = diagnose
        # stream-ordered waits: fire before NCCL's watchdog (at the group's timeout) ends the process
        self.watch = CompletionWatch(
            max(0.5 * timeout_s, timeout_s - 2 * self.grace_s),
            lambda step, index, names, cause: diagnose(step, index, names, self.grace_s, cause),
            start_thread=True,
        )

    def wait(self, step: int, bucket_index: int, names: list[str], handle) -> torch.Tensor | None:
        """The hook's result tensor (None for a plain all-reduce, which works in place)."""
        try:
            if _is_future(handle):
                return hook_result(handle.wait())
            if self.host_blocking:
                handle.wait(timeout=_timedelta(self.timeout_s))
                return None
        except RuntimeError as exc:  # DistBackendError and gloo timeouts
            raise self._diagnose(step, bucket_index, names, self.grace_s, exc) from exc
        self.watch.track(step, bucket_index, names, handle)
        if self.device.type == "cuda":
            handle.wait()  # orders the current stream after the collective; no host sync
        return None

    def raise_if_failed(self) -> None:
        self.watch.raise_if_failed()

    def close(self) -> None:
        self.watch.close()


def _timedelta(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)
