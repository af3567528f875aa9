"""Hooks that hold the reducer weakly: a hook registered on a parameter must not keep a dropped wrapper alive."""

from __future__ import annotations

import weakref

import torch

__all__ = ["call_weakly", "grad_hook"]


def grad_hook(reducer: weakref.ref, index: int, param: torch.Tensor) -> None:
    bound = reducer()
    if bound is not None:
        bound._on_grad(index, param)


def call_weakly(method: weakref.WeakMethod, index, *args) -> None:
    bound = method()
    if bound is not None:
        if index is None:
            bound(*args)
        else:
            bound(index, *args)
