"""Where one synchronised backward stands: one value, and the transitions the reducer may make, in one place.

::

    IDLE ──prepare_for_backward──► ARMED ──first gradient──► REDUCING ──last bucket launched──► FINISHING
     ▲                              │ ▲                          │                                  │
     │                              └─┘ another forward           │                                  │
     └──────────────── end of backward (finished, aborted, or reset) ◄───────────────────────────────┘

- IDLE: no reducing backward is expected; gradients accumulate locally (``no_sync``, evaluation, between steps).
- ARMED: torch's DDP called ``prepare_for_backward``; the next backward reduces. No gradient has arrived yet.
- REDUCING: the first gradient arrived (the backward's bookkeeping started); buckets launch in order as they fill.
- FINISHING: every bucket has been launched and the end of backward is queued: wait for each bucket, finish it
  into ``.grad``, record, learn -- then IDLE again. An error in any state ends the backward (IDLE), after waiting
  for every collective already launched.

Per-backward details that are not the backward's stage (a graph search done, an end-of-graph check queued, the
extension armed) stay plain fields of the reducer; they are reset with the state at the end of backward.
"""

from __future__ import annotations

import enum

__all__ = ["BackwardState", "BackwardTracker"]


class BackwardState(enum.Enum):
    IDLE = "idle"
    ARMED = "armed"
    REDUCING = "reducing"
    FINISHING = "finishing"


_ALLOWED = {
    BackwardState.IDLE: {BackwardState.ARMED, BackwardState.IDLE},
    BackwardState.ARMED: {BackwardState.ARMED, BackwardState.REDUCING, BackwardState.IDLE},
    BackwardState.REDUCING: {BackwardState.FINISHING, BackwardState.IDLE},
    BackwardState.FINISHING: {BackwardState.IDLE},
}


class BackwardTracker:
    """The state of the running backward; :meth:`to` refuses a transition the diagram above does not have."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state = BackwardState.IDLE

    def to(self, new: BackwardState) -> None:
        if new not in _ALLOWED[self.state]:
            raise RuntimeError(
                f"fastpar DDP: internal error, a backward cannot go from {self.state.name} to {new.name}; please "
                "report it with the traceback"
            )
        self.state = new

    @property
    def expecting(self) -> bool:
        """A reducing backward is expected or running (torch's ``expect_autograd_hooks_``)."""
        return self.state is not BackwardState.IDLE

    @property
    def started(self) -> bool:
        """Its first gradient arrived."""
        return self.state is BackwardState.REDUCING or self.state is BackwardState.FINISHING

    @property
    def finishing(self) -> bool:
        """Every bucket was launched; the end of backward is queued."""
        return self.state is BackwardState.FINISHING
