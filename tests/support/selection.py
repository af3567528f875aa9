"""Which cases of a parametrized test this pytest run selected, so that a module-scoped fixture computing many
cases in one launch of ranks computes only those the run checks (the fast default suite, ``-k``); with every
test selected (``--full``) it computes them all, as before."""

from __future__ import annotations

import pytest


def selected_params(request: pytest.FixtureRequest, name: str) -> tuple:
    """The values of parameter ``name`` among the selected tests of the requesting module that use the
    requesting fixture, in collection order, each once."""
    values: dict = {}
    for item in request.session.items:
        if getattr(item, "module", None) is not request.module or request.fixturename not in item.fixturenames:
            continue
        callspec = getattr(item, "callspec", None)
        if callspec is not None and name in callspec.params:
            values.setdefault(callspec.params[name], None)
    return tuple(values)
