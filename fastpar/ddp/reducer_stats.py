"""What the reducer reports about its last synchronised backward (``model.comm_stats()``) and the timing hook
``bucket_cap_mb="auto"`` reads. A mixin of :class:`fastpar.ddp.reducer.Reducer`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from .buckets import ParamSlot

_NOT_TIMED = contextlib.nullcontext()


class ReducerStats:
    """The statistics of the last synchronised backward, for :class:`~fastpar.ddp.reducer.Reducer`."""

    def _record_stats(self) -> None:
        used_bytes = self._used_work[0].numel() * 4 if self._used_work is not None else 0
        self.last_stats = {
            "step": self.step,
            "bytes": self._bytes + used_bytes,
            "collectives": len(self.buckets) + (self._used_work is not None),
            "wait_s": None,  # read lazily from the timer (a CUDA sync on GPU)
            "buckets": len(self.buckets),
            "finished_early": self.finishing.early,  # finished from the hooks, before backward ended
            "hot_path": "extension" if self._native_armed else "python",  # where the hooks ran (extension_hooks.py)
        }

    def stats(self) -> dict:
        stats = dict(self.last_stats)
        stats["wait_s"] = self.timer.seconds() if self.step else 0.0
        if self.auto is not None:
            stats["auto"] = self.auto.summary()
        return stats

    def _timed(self, kind: str, slots: Sequence[ParamSlot]):
        """Times the reducer's own work on ``slots``' gradients while "auto" records this step."""
        if self._recorder is None:
            return _NOT_TIMED
        return self._recorder.timed(kind, sum(s.numel * s.param.element_size() for s in slots))
