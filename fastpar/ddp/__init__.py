"""Gradient synchronisation: a drop-in ``DistributedDataParallel`` (buckets, the reducer, comm hooks, the bucket
collective seam that ``fastpar.zero`` plugs into) and coalesced collectives."""

from __future__ import annotations

from .coalesced import CoalescedAllReduce, all_reduce_coalesced
from .distributed import DistributedDataParallel
from .errors import BucketTimeoutError, UnusedParametersError

DDP = DistributedDataParallel

__all__ = [
    "DDP",
    "BucketTimeoutError",
    "CoalescedAllReduce",
    "DistributedDataParallel",
    "UnusedParametersError",
    "all_reduce_coalesced",
]
