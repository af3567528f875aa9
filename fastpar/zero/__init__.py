"""Sharded data parallelism on fastpar's DDP buckets: ``ShardedOptimizer`` (ZeRO-1: optimizer state / world size;
ZeRO-2 with ``shard_gradients=True``: gradients too) and ``ShardedGradScaler`` (loss scaling on its gradient shards).

It plugs into the reducer through the bucket collective seam (``fastpar.ddp``): each bucket is reduce-scattered
instead of all-reduced, each rank steps its shard, and the parameters are all-gathered back.
"""

from __future__ import annotations

from .arrival import RankArrivalError
from .grad_scaler import ShardedGradScaler
from .optimizer import ShardedOptimizer
from .torch_clip import ZeroClipError

__all__ = ["RankArrivalError", "ShardedGradScaler", "ShardedOptimizer", "ZeroClipError"]
