"""What a :class:`~fastpar.ShardedOptimizer` holds on this rank, measured from the tensors themselves.

Each tensor is counted by its storage (:mod:`fastpar.tensor_storage`, the one counter), each storage once: a parameter that
views its bucket's ``param_flat`` counts the flat buffer, once for all of them; the gradient shard that
views stage 1's gradient bucket is the bucket. A storage goes to the first category that holds it, in the
order parameters, gradients, optimizer state. Nothing is computed from formulas, so the report says what
an allocator would see (before fragmentation and the caching allocator's reserve).
"""

from __future__ import annotations

import torch

from ..tensor_storage import StorageCounter

__all__ = ["MEMORY_KEYS", "held_tensors", "measure_memory"]

MEMORY_KEYS = ("parameters", "gradients", "optimizer_state", "gradient_pool", "total")


def held_tensors(optimizer: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
    """The tensors a ``ShardedOptimizer`` holds on this rank, by category (see :func:`measure_memory`):
    ``"parameters"``, ``"gradients"`` (the pool's buffers first), ``"optimizer_state"``. A tensor may appear
    in two categories; counting keeps the first."""
    collective, sharded = optimizer._collective, optimizer._sharded
    params = list(optimizer.model.module.parameters())
    pool = getattr(collective, "pool", None)
    grads: list[torch.Tensor | None] = list(pool.tensors()) if pool is not None else []
    if optimizer.stage == 2:
        grads += collective.gradient_tensors()
    else:
        for zb in sharded:
            grads += [zb.bucket.grad_flat, zb.bucket.comm_flat, zb.scratch]
    grads += [p.grad for p in params] + [zb.shard_param.grad for zb in sharded]
    state = [
        v for inner in optimizer._inner for state in inner.state.values() for v in state.values() if torch.is_tensor(v)
    ]
    return {
        "parameters": [*params, *(zb.param_flat for zb in sharded)],
        "gradients": [t for t in grads if t is not None],
        "optimizer_state": state,
    }


def measure_memory(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """``{key: bytes}`` for :data:`MEMORY_KEYS` of a ``ShardedOptimizer`` (see its ``memory_report``)."""
    counter = StorageCounter()
    held = held_tensors(optimizer)
    pool = getattr(optimizer._collective, "pool", None)
    report = {"parameters": counter.count(held["parameters"])}
    pool_bytes = counter.count(pool.tensors()) if pool is not None else 0
    report["gradients"] = pool_bytes + counter.count(held["gradients"])
    report["optimizer_state"] = counter.count(held["optimizer_state"])
    report["gradient_pool"] = pool_bytes
    report["total"] = report["parameters"] + report["gradients"] + report["optimizer_state"]
    return report
