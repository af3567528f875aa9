"""fastpar: fast data-parallel PyTorch training, with its own measurements.

Heavy parts load on first use, so ``import fastpar`` is cheap (it does not import torch) and never fails
because of the compiled extension or an optional dependency.
"""

from __future__ import annotations

import importlib
import os

from ._after_import import call_after_import
from ._version import __version__

__all__ = [
    "DDP",
    "DistributedDataParallel",
    "ShardedGradScaler",
    "ShardedOptimizer",
    "Trainer",
    "TrainingOptions",
    "__version__",
    "batch",
    "ext_status",
    "fully_shard_model",
    "jobs",
    "loss_from_batch",
    "ops",
    "submit",
    "sweep",
]

# public name -> (module, attribute), imported when first touched (PEP 562)
_LAZY = {
    "DistributedDataParallel": ("fastpar.ddp", "DistributedDataParallel"),
    "DDP": ("fastpar.ddp", "DistributedDataParallel"),
    "ShardedOptimizer": ("fastpar.zero", "ShardedOptimizer"),
    "ShardedGradScaler": ("fastpar.zero", "ShardedGradScaler"),
    "ext_status": ("fastpar.ops.loader", "ext_status"),
    "fully_shard_model": ("fastpar.shard", "fully_shard_model"),
    "Trainer": ("fastpar.train", "Trainer"),
    "TrainingOptions": ("fastpar.train", "TrainingOptions"),
    "loss_from_batch": ("fastpar.train.batches", "loss_from_batch"),
    "ops": ("fastpar.ops", None),
    "jobs": ("fastpar.jobs", None),
    "sweep": ("fastpar.jobs.sweeper", "sweep"),
    "submit": ("fastpar.jobs.submission", "submit"),
    "batch": ("fastpar.jobs.batchjob", "batch"),
}


def _register_backend() -> None:
    """``init_process_group("fastpar")`` works once fastpar and torch are imported (fastpar.comm; never raises)."""
    import sys
    import warnings

    backend = sys.modules.get("fastpar.comm.backend")
    if backend is not None and getattr(backend.__spec__, "_initializing", False):
        # torch finished importing inside fastpar.comm.backend's own import (``import fastpar.comm`` before
        # torch): its names are not defined yet, and its last line registers the backend.
        return
    try:
        from .comm import register

        register()
    except Exception as exc:  # noqa: BLE001 - import fastpar must not fail because of the backend
        warnings.warn(f"fastpar: could not register the 'fastpar' torch.distributed backend: {exc}", stacklevel=2)


call_after_import("torch", _register_backend)


def _register_lightning_strategy() -> None:
    try:
        import fastpar.integrations.lightning  # noqa: F401 - registers Trainer(strategy="fastpar")
    except Exception as exc:  # noqa: BLE001 - an unsupported Lightning must not break import fastpar or lightning
        import warnings

        warnings.warn(f"fastpar: could not register the Lightning strategy 'fastpar': {exc}", stacklevel=2)


call_after_import("lightning", _register_lightning_strategy)


def _accelerate_builds_fastpar_ddp() -> None:
    from .integrations import accelerate

    accelerate.enable()


if os.environ.get("FASTPAR_ACCELERATE_DDP", "").lower() in ("1", "true", "yes"):
    call_after_import("accelerate", _accelerate_builds_fastpar_ddp)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'fastpar' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
