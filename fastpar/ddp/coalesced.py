"""In-place all-reduce of many tensors through a few flat buffers, with packing overlapped.

Used by benchmarks and by code that reduces a list of tensors outside DDP (e.g. metrics, EMA weights).
Each bucket is packed with one ``fastpar.ops.pack`` call, and its collective is launched
asynchronously before the next bucket is packed, so packing bucket i+1 overlaps reducing bucket i.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .. import ops

__all__ = ["all_reduce_coalesced", "plan_coalesced_buckets"]


def plan_coalesced_buckets(tensors: Sequence[torch.Tensor], bucket_cap_mb: float = 25.0) -> list[list[int]]:
    """Group tensor indices into buckets: one dtype and device per bucket, each under ``bucket_cap_mb``
    (a tensor larger than the cap gets a bucket of its own). Order within a dtype is kept."""
    if bucket_cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
    cap_bytes = int(bucket_cap_mb * 1024 * 1024)
    buckets: list[list[int]] = []
    open_bucket: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
    for i, t in enumerate(tensors):
        key = (t.dtype, t.device)
        nbytes = t.numel() * t.element_size()
        indices, used = open_bucket.get(key, (None, 0))
        if indices is None or (used + nbytes > cap_bytes and indices):
            indices, used = [], 0
            buckets.append(indices)
        indices.append(i)
        open_bucket[key] = (indices, used + nbytes)
    return buckets


def all_reduce_coalesced(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    *,
    bucket_cap_mb: float = 25.0,
    scale: float = 1.0,
) -> None:
    """All-reduce (SUM) ``tensors`` in place across ``group``, then multiply by ``scale``
    (``scale=1/world_size`` averages). Tensors may have different shapes and dtypes
    (float32/float16/bfloat16); each bucket holds one dtype. Every rank must pass tensors of the
    same shapes, dtypes and order.
    """
    tensors = list(tensors)
    if not tensors:
        return
    for i, t in enumerate(tensors):
        if t.dtype not in ops.SUPPORTED_DTYPES:
            raise TypeError(f"all_reduce_coalesced: tensors[{i}] has dtype {t.dtype}; use float32/float16/bfloat16")
    pending: list[tuple[dist.Work, torch.Tensor, list[torch.Tensor]]] = []
    for indices in plan_coalesced_buckets(tensors, bucket_cap_mb):
        members = [tensors[i] for i in indices]
        numel = sum(t.numel() for t in members)
        flat = torch.empty(numel, dtype=members[0].dtype, device=members[0].device)
        ops.pack(members, flat)
        # launched now: the next bucket's pack runs while this one is on the wire
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
        pending.append((work, flat, members))
    for work, flat, members in pending:
        work.wait()
        ops.unpack(flat, members, scale)
