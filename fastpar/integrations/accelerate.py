"""accelerate (and what runs on it: Hugging Face's ``transformers.Trainer``) building fastpar's DDP.

    import fastpar.integrations.accelerate as fastpar_accelerate
    fastpar_accelerate.enable()          # before accelerator.prepare(...) / trainer.train()
    model, optimizer = accelerator.prepare(model, optimizer)   # a fastpar.DistributedDataParallel

Why this shape: accelerate has no setting for the DDP class -- ``Accelerator.prepare_model`` calls
``torch.nn.parallel.DistributedDataParallel(model, **kwargs)`` itself, its kwargs handlers are looked up by their
exact class (a subclass of ``DistributedDataParallelKwargs`` is refused) and its launch config has no such key.
So :func:`enable` wraps ``Accelerator.prepare_model``: while it runs, that name is fastpar's class (same arguments,
bit-identical results), which then gets everything accelerate gives torch's (``ddp_handler`` kwargs and comm
hooks, ``no_sync``, ``trigger_sync_in_backward``, ``unwrap_model``). Every Accelerator is affected, including the
one ``transformers.Trainer`` makes; :func:`disable` (or ``with enabled():``) undoes it. A script launched with
``FASTPAR_ACCELERATE_DDP=1`` gets it as soon as it imports fastpar and accelerate (either order).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

_original = None


def enable() -> None:
    """Make every ``accelerate.Accelerator`` wrap models in fastpar's DDP where it would use torch's (idempotent)."""
    global _original
    from accelerate import Accelerator

    if _original is not None:
        return
    original = Accelerator.prepare_model

    @functools.wraps(original)
    def prepare_model(self, *args, **kwargs):
        from ..ddp.distributed import DistributedDataParallel

        saved = torch.nn.parallel.DistributedDataParallel
        torch.nn.parallel.DistributedDataParallel = DistributedDataParallel
        try:
            return original(self, *args, **kwargs)
        finally:
            torch.nn.parallel.DistributedDataParallel = saved

    Accelerator.prepare_model = prepare_model
    _original = original


def disable() -> None:
    """Back to accelerate's own choice (torch's DDP) for models prepared from now on."""
    global _original
    if _original is None:
        return
    from accelerate import Accelerator

    Accelerator.prepare_model = _original
    _original = None


def is_enabled() -> bool:
    return _original is not None


@contextlib.contextmanager
def enabled() -> Iterator[None]:
    """``with enabled():`` fastpar's DDP for the models prepared inside (restores the previous choice after)."""
    was = is_enabled()
    enable()
    try:
        yield
    finally:
        if not was:
            disable()


__all__ = ["disable", "enable", "enabled", "is_enabled"]
