"""Point-to-point sends and receives posted off the training thread, waited for as one ``Work``.

On gloo, posting a send or a receive takes the peer pair's lock, which gloo's transport thread holds while
it moves a large message through the socket; a training thread posting the next bucket's messages waits
for the previous bucket's transfer. Measured on 2 loaded CPU cores, a 67 MB model: ~70 ms per step of the
training thread blocked in ``isend``/``irecv`` (3 ms of it CPU). A dedicated thread posts them instead, in
the order they were submitted (the same on every rank), as gloo's own collectives are run by its worker
threads. NCCL posts on the submitting thread's CUDA stream, so there posting stays inline.
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["PostingThread", "WorkSet"]

Op = tuple[Callable[..., Any], tuple, dict]  # (dist.isend or dist.irecv, args, kwargs)


class WorkSet:
    """Several point-to-point works, waited for as one (the ``Work`` interface :class:`BucketWaiter` uses)."""

    def __init__(self, works: Sequence | None = None) -> None:
        self.works = list(works or [])
        self.posted = threading.Event()
        self.error: BaseException | None = None
        if works is not None:
            self.posted.set()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        if not self.posted.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
            raise RuntimeError("the point-to-point messages were not even posted in time (the posting thread is stuck)")
        if self.error is not None:
            raise RuntimeError(f"posting a point-to-point message failed: {self.error}") from self.error
        for work in self.works:
            if deadline is None:
                work.wait()
            else:
                work.wait(timeout=datetime.timedelta(seconds=max(0.0, deadline - time.monotonic())))
        return True

    def is_completed(self) -> bool:
        return self.posted.is_set() and (self.error is not None or all(w.is_completed() for w in self.works))


class PostingThread:
    """Posts submitted batches of point-to-point operations, in order, from one background thread."""

    def __init__(self, name: str = "fastpar-zero-post") -> None:
        self._name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, ops: Sequence[Op]) -> WorkSet:
        works = WorkSet()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        self._queue.put((works, list(ops)))
        return works

    def close(self) -> None:
        """Stop the thread after what it was given, and wait for it (briefly: a peer may be gone). Joining
        matters at interpreter exit (this runs from a ``weakref.finalize``): a daemon thread that wakes while
        the interpreter finalizes is unwound through torch's C++ frames, which aborts the process ("terminate
        called without an active exception")."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout=5.0)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            works, ops = item
            try:
                works.works = [fn(*args, **kwargs) for fn, args, kwargs in ops]
            except BaseException as exc:  # reported by WorkSet.wait on the training thread
                works.error = exc
            finally:
                works.posted.set()
            item = works = ops = None  # hold no buffer while waiting for the next batch (ZeRO-2 frees them early)


def post_inline(ops: Sequence[Op]) -> WorkSet:
    return WorkSet([fn(*args, **kwargs) for fn, args, kwargs in ops])
