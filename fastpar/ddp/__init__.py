"""Gradient synchronisation: a drop-in ``DistributedDataParallel``, ZeRO-1 (``ShardedOptimizer``) and coalesced
collectives."""

from __future__ import annotations

from .coalesced import CoalescedAllReduce, all_reduce_coalesced
from .distributed import DistributedDataParallel
from .errors import BucketTimeoutError, UnusedParametersError
from .sharded_optimizer import ShardedOptimizer

DDP = DistributedDataParallel

__all__ = [
    "DDP",
    "BucketTimeoutError",
    "CoalescedAllReduce",
    "DistributedDataParallel",
    "ShardedOptimizer",
    "UnusedParametersError",
    "all_reduce_coalesced",
]
