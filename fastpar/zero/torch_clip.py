"""``torch.nn.utils.clip_grad_norm_`` on a ShardedOptimizer's parameters: exact, or refused.

Under ZeRO the reduced gradients exist only as shards (``p.grad`` is None after a synchronised backward), so
torch's function would find no gradient, clip nothing and return 0 -- silently. The first ShardedOptimizer
built in a process replaces ``torch.nn.utils.clip_grad_norm_`` and ``torch.nn.utils.clip_grad.clip_grad_norm_``
(torch's deprecated ``clip_grad_norm`` calls the latter) with :func:`clip_grad_norm_` below, once:

- no parameter of a live ShardedOptimizer among those given: torch's own function, unchanged;
- exactly the parameters one ShardedOptimizer shards (any order; parameters without a gradient, such as
  frozen ones, may come along, as torch skips them), L2 norm: that optimizer's exact sharded clip
  (:meth:`ShardedOptimizer.clip_grad_norm_`), which returns the very total norm torch would and scales the
  shards as torch would scale the gradients;
- anything it cannot do exactly raises :class:`ZeroClipError` naming the call to make instead: a strict
  subset of the sharded parameters, another norm type, sharded parameters beside others that have a
  gradient, ``foreach=False``, or sharded parameters that hold local gradients (after a ``no_sync()``
  backward).

Hazard: ``from torch.nn.utils import clip_grad_norm_`` executed *before* the first ShardedOptimizer is built
binds torch's original function, which this cannot reach: it still clips nothing under ZeRO. Import the
module (``torch.nn.utils.clip_grad_norm_(...)``) or call ``opt.clip_grad_norm_(max_norm)``.
"""

from __future__ import annotations

import functools
import types
import weakref
from typing import Any

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad

__all__ = ["ZeroClipError", "clip_grad_norm_", "install", "register"]

_optimizers: weakref.WeakSet = weakref.WeakSet()  # live ShardedOptimizers
_original = torch.nn.utils.clip_grad.clip_grad_norm_  # torch's, as imported before any replacement
_INSTEAD = "call opt.clip_grad_norm_(max_norm) on the ShardedOptimizer (the L2 norm of the reduced gradient shards)"


class ZeroClipError(ValueError):
    """``torch.nn.utils.clip_grad_norm_`` was asked for something the ZeRO shards cannot give exactly."""


def register(optimizer: torch.optim.Optimizer) -> None:
    """Route torch's clipping of ``optimizer``'s sharded parameters (``optimizer._sharded_param_ids``: the ids of
    the parameters in its buckets, alive as long as it is) to it, held weakly, and install the wrapper."""
    _optimizers.add(optimizer)
    install()


def install() -> None:
    """Replace torch's ``clip_grad_norm_`` (both names) by :func:`clip_grad_norm_`; idempotent."""
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    torch.nn.utils.clip_grad.clip_grad_norm_ = clip_grad_norm_


def uninstall() -> None:
    """Put torch's own function back under both names (tests)."""
    torch.nn.utils.clip_grad_norm_ = _original
    torch.nn.utils.clip_grad.clip_grad_norm_ = _original


@functools.wraps(_original)
def clip_grad_norm_(
    parameters: Any,
    max_norm: float,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    if not _optimizers:  # no ShardedOptimizer alive: torch's, untouched
        return _original(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
    is_generator = isinstance(parameters, types.GeneratorType)
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    owner = _owner(params)
    if owner is None:
        given = (p for p in params) if is_generator else params  # torch warns about an empty generator
        return _original(given, max_norm, norm_type, error_if_nonfinite, foreach)
    optimizer, sharded = owner
    _refuse_inexact(params, sharded, norm_type, foreach)
    return optimizer.clip_grad_norm_(max_norm, 2.0, error_if_nonfinite)


def _owner(params: list[torch.Tensor]) -> tuple[Any, frozenset[int]] | None:
    """The ShardedOptimizer sharding any of ``params`` and the ids it shards; None if none does; refuses two."""
    ids = {id(p) for p in params}
    owners = []
    for optimizer in list(_optimizers):
        sharded = getattr(optimizer, "_sharded_param_ids", None)
        if sharded is None:
            continue  # still being built
        if not ids.isdisjoint(sharded):
            owners.append((optimizer, sharded))
    if len(owners) > 1:
        raise ZeroClipError(
            "torch.nn.utils.clip_grad_norm_ was given the parameters of several ShardedOptimizers; their norms "
            f"live in different shards. Clip each separately: {_INSTEAD}"
        )
    return owners[0] if owners else None


def _refuse_inexact(params: list[torch.Tensor], sharded: frozenset[int], norm_type: Any, foreach: Any) -> None:
    try:
        l2 = float(norm_type) == 2.0
    except (TypeError, ValueError):
        l2 = False
    if not l2:
        raise ZeroClipError(
            f"torch.nn.utils.clip_grad_norm_(..., norm_type={norm_type!r}) on a ShardedOptimizer's parameters: only "
            f"the L2 norm (norm_type=2) of the gradient shards is computed exactly; {_INSTEAD}"
        )
    if foreach is False:
        raise ZeroClipError(
            "torch.nn.utils.clip_grad_norm_(..., foreach=False) on a ShardedOptimizer's parameters: the sharded clip "
            f"measures each gradient with torch._foreach_norm (torch's default); drop foreach=False, or {_INSTEAD}"
        )
    given = [p for p in params if id(p) in sharded]
    if len({id(p) for p in given}) != len(given):
        raise ZeroClipError(
            "torch.nn.utils.clip_grad_norm_ was given a sharded parameter more than once (torch would count its "
            f"gradient twice); pass model.parameters(), or {_INSTEAD}"
        )
    if len(given) != len(sharded):
        raise ZeroClipError(
            f"torch.nn.utils.clip_grad_norm_ was given {len(given)} of the {len(sharded)} parameters a "
            "ShardedOptimizer shards; the norm of a subset of the gradient shards is not computed. Pass all of "
            f"them (model.parameters()), or {_INSTEAD}"
        )
    others = [p for p in params if id(p) not in sharded and p.grad is not None]
    if others:
        raise ZeroClipError(
            f"torch.nn.utils.clip_grad_norm_ was given a ShardedOptimizer's parameters together with {len(others)} "
            "other tensor(s) that have gradients; one norm over sharded and whole gradients is not computed. Clip "
            f"the others with a separate call, and {_INSTEAD}"
        )
    local = [p for p in given if p.grad is not None]
    if local:
        raise ZeroClipError(
            f"torch.nn.utils.clip_grad_norm_ on a ShardedOptimizer's parameters while {len(local)} of them hold local, "
            "unreduced gradients (a backward under no_sync()); clip after the synchronised backward: "
            f"{_INSTEAD}"
        )
