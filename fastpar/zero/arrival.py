"""Every rank checks in through the process group's store before a collective that users call on one rank by
mistake (``opt.state_dict()`` on rank 0 alone, to save there), so the mistake raises, naming the missing
ranks, within a bounded time instead of hanging in the collective forever.

Each call posts ``<key>/<rank>`` and waits for every rank's post; one verdict per call, decided atomically
with ``compare_set`` (``"go"`` by the first rank that sees everyone, else the missing ranks by the first rank
that gives up), so a rank arriving just as another gives up either proceeds with everyone or raises too --
never enters the collective alone. The training step pays nothing: only the callers of :func:`check_in` do.
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

__all__ = ["ARRIVAL_TIMEOUT_ENV", "RankArrivalError", "arrival_timeout_s", "check_in"]

ARRIVAL_TIMEOUT_ENV = "FASTPAR_ZERO_ARRIVAL_TIMEOUT_S"
_DEFAULT_TIMEOUT_S = 60.0
_GO = "go"


class RankArrivalError(RuntimeError):
    """Not every rank of the process group called a collective method within the arrival timeout."""


def arrival_timeout_s(group_timeout_s: float) -> float:
    """``$FASTPAR_ZERO_ARRIVAL_TIMEOUT_S`` (default 60 s), at most the group's collective timeout."""
    raw = os.environ.get(ARRIVAL_TIMEOUT_ENV, "")
    try:
        wanted = float(raw) if raw else _DEFAULT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{ARRIVAL_TIMEOUT_ENV}={raw!r}: expected a number of seconds") from None
    if wanted <= 0:
        raise ValueError(f"{ARRIVAL_TIMEOUT_ENV}={raw!r}: expected a positive number of seconds")
    return min(wanted, group_timeout_s)


def check_in(group: dist.ProcessGroup, key: str, timeout_s: float, call: str, remedy: str) -> None:
    """Return once every rank of ``group`` has checked in under ``key`` (unique per call, the same on every
    rank); raise :class:`RankArrivalError` naming the missing ranks after ``timeout_s``."""
    store = dist.distributed_c10d._get_process_group_store(group)
    rank, world_size = group.rank(), group.size()
    posts = [f"{key}/{r}" for r in range(world_size)]
    store.set(posts[rank], "1")
    try:
        store.wait(posts, datetime.timedelta(seconds=timeout_s))
        proposal = _GO
    except Exception:  # the store's timeout error (its type differs between store kinds and torch versions)
        missing = [r for r, post in enumerate(posts) if not store.check([post])]
        proposal = _GO if not missing else ",".join(map(str, missing))
    verdict = _text(store.compare_set(f"{key}/verdict", "", proposal))
    if verdict == _GO:
        return
    late = " -- this rank among them: it came after another rank gave up" if str(rank) in verdict.split(",") else ""
    raise RankArrivalError(
        f"fastpar ZeRO: {call} is collective, but rank(s) {verdict} of the process group did not call it within "
        f"{timeout_s:g} s{late} ({ARRIVAL_TIMEOUT_ENV} sets this timeout). {remedy}"
    )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
