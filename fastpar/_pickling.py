"""Pickle something that must reach another process, and when that fails, name the part that can't."""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable
from typing import Any


class Unpicklable(Exception):
    """``culprit`` (a name for people) could not be pickled; ``error`` says why."""

    def __init__(self, culprit: str, error: Exception) -> None:
        super().__init__(f"{culprit}: {type(error).__name__}: {error}")
        self.culprit, self.error = culprit, error


def dumps_naming_culprit(
    whole: Any, parts: Iterable[tuple[str, Any]], *, default: str, dumps: Callable[[Any], bytes] = pickle.dumps
) -> bytes:
    """``dumps(whole)``; on failure raise :class:`Unpicklable` naming the first of ``parts`` that fails on
    its own (``default`` when each part pickles alone)."""
    try:
        return dumps(whole)
    except Exception as exc:  # find the culprit for a useful message
        error = exc
    for name, value in parts:
        try:
            dumps(value)
        except Exception as exc:
            raise Unpicklable(name, exc) from exc
    raise Unpicklable(default, error) from error
