"""What one synchronised step costs, recorded by the reducer's own hooks (for ``bucket_cap_mb="auto"``).

While a step is recorded the reducer stamps: the forward's start, each gradient's arrival (its hook),
the start and end of its own work (packing a bucket, finishing one), the end of backward (its queued
end-of-backward callback) and the end of the sync. :meth:`StepRecorder.end` turns the stamps into
:class:`StepTimes`: every gradient's ready time as *compute* seconds since the first arrival (the
reducer's own work before it subtracted, so a simulator can add back the work of any layout), backward's
compute, the end of the sync (wall seconds since the first arrival), the reducer's seconds per byte packed
and finished, and the step.

Clocks: the host clock on CPU; on GPUs CUDA events on the current stream (a hook runs when its work is
queued, the event when it has run), resolved once per recorded step (a CPU-GPU sync point, only while
recording).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

__all__ = ["StepRecorder", "StepTimes"]

_FORWARD, _READY, _WORK_START, _WORK_END, _BACKWARD_END, _END = range(6)


class _HostClock:
    def stamp(self) -> float:
        return time.perf_counter()

    def seconds(self, stamps: list) -> list[float]:
        return [s - stamps[0] for s in stamps]


class _CudaClock:
    def stamp(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, stamps: list) -> list[float]:
        stamps[-1].synchronize()  # CPU-GPU sync point, once per recorded step
        return [stamps[0].elapsed_time(e) / 1e3 for e in stamps]


@dataclass
class StepTimes:
    ready: dict[int, float]  # parameter index -> compute seconds since the first arrival
    backward_s: float  # backward's compute, first arrival to end, the reducer's own work excluded
    sync_s: float  # first arrival to the end of the sync (wall: the reducer's work and the wait included)
    step_s: float  # forward start to the end of the sync
    work_s: dict[str, float]  # "pack" / "finish" -> seconds
    work_bytes: dict[str, int]  # "pack" / "finish" -> gradient bytes moved


class _Timed:
    __slots__ = ("recorder", "kind", "nbytes")

    def __init__(self, recorder: StepRecorder, kind: str, nbytes: int) -> None:
        self.recorder, self.kind, self.nbytes = recorder, kind, nbytes

    def __enter__(self) -> None:
        self.recorder._add(_WORK_START, (self.kind, self.nbytes))

    def __exit__(self, *exc) -> None:
        self.recorder._add(_WORK_END, self.kind)


class StepRecorder:
    """Stamps of the step being recorded; ``steps`` holds the finished ones."""

    def __init__(self, device: torch.device) -> None:
        self._clock = _CudaClock() if device.type == "cuda" else _HostClock()
        self._events: list[tuple[int, object, object]] | None = None
        self.steps: list[StepTimes] = []

    def _add(self, code: int, value: object) -> None:
        if self._events is not None:
            self._events.append((code, value, self._clock.stamp()))

    def forward(self) -> None:
        """A synchronised forward starts: a new step (an unfinished one is dropped)."""
        self._events = []
        self._add(_FORWARD, None)

    def ready(self, index: int) -> None:
        self._add(_READY, index)

    def timed(self, kind: str, nbytes: int) -> _Timed:
        """``with recorder.timed("pack", nbytes): ...`` around the reducer's own work."""
        return _Timed(self, kind, nbytes)

    def backward_end(self) -> None:
        self._add(_BACKWARD_END, None)

    def end(self) -> None:
        """The sync is over: resolve the step (if it saw a gradient and the end of backward)."""
        self._add(_END, None)
        events, self._events = self._events, None
        if not events or not any(code == _READY for code, _, _ in events):
            return
        if not any(code == _BACKWARD_END for code, _, _ in events):
            return
        times = self._clock.seconds([stamp for _, _, stamp in events])
        origin = next(t for (code, _, _), t in zip(events, times, strict=True) if code == _READY)
        ready: dict[int, float] = {}
        work_s = {"pack": 0.0, "finish": 0.0}
        work_bytes = {"pack": 0, "finish": 0}
        spent = started = backward_s = 0.0
        in_backward = True
        for (code, value, _), t in zip(events, times, strict=True):
            if code == _WORK_START:
                started = t
                kind, nbytes = value
                work_bytes[kind] += nbytes
            elif code == _WORK_END:
                work_s[value] += t - started
                if in_backward:
                    spent += t - started
            elif code == _READY:
                ready[value] = max(t - origin - spent, 0.0)
            elif code == _BACKWARD_END:
                in_backward = False
                backward_s = max(t - origin - spent, 0.0)
        self.steps.append(StepTimes(ready, backward_s, times[-1] - origin, times[-1], work_s, work_bytes))

    def reset(self) -> None:
        self._events = None
        self.steps = []

    def median_step_s(self) -> float:
        return statistics.median(s.step_s for s in self.steps)

    def summary(self, num_params: int) -> list[float]:
        """Medians over the recorded steps, as one vector: each parameter's ready time (0 if it never arrived:
        unused, so ready when backward starts), backward, the end of the sync, the step, and the reducer's
        seconds per byte packed and finished."""
        steps = self.steps
        ready = [statistics.median(s.ready.get(i, 0.0) for s in steps) for i in range(num_params)]
        per_byte = []
        for kind in ("pack", "finish"):
            nbytes = sum(s.work_bytes[kind] for s in steps)
            per_byte.append(sum(s.work_s[kind] for s in steps) / nbytes if nbytes else 0.0)
        medians = [statistics.median(getattr(s, name) for s in steps) for name in ("backward_s", "sync_s", "step_s")]
        return ready + medians + per_byte
