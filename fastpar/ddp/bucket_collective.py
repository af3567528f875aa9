"""The seam between the reducer and whatever replaces a bucket's all-reduce: :class:`BucketCollective`.

This is THE interface for a strategy that reduces gradient buckets otherwise than DDP's all-reduce
(``fastpar.zero``'s reduce-scatter is one). It is installed with one reducer method,
:meth:`fastpar.ddp.reducer.Reducer.install_bucket_collective`, which owns everything that goes with it:
the rule that a comm hook and a bucket collective exclude each other (both replace the all-reduce), the
buckets the collective provides (it owns their buffers: a sharded strategy pads them, keeps parameter
buffers beside them, or keeps only a shard of them), the waiter that names the collective when a rank
never arrives, and the freezing of ``bucket_cap_mb="auto"`` (a collective keeps its buckets).

What the reducer does with an installed collective, each synchronised backward:

1. stage each bucket's gradients into ``bucket.comm_flat`` (scaled by ``1 / world size``, as for DDP),
2. ``work = collective.start(bucket)`` -- strictly in bucket order, the same on every rank,
3. at the end of backward: wait for ``work`` (a ``Work``, a ``Future`` or anything with ``wait(timeout)``
   and ``is_completed()``), then ``collective.finish(bucket, result, globally_unused)``.

Before a backward adds onto existing gradients (a second backward before the optimizer step, synchronised
or under ``no_sync``), ``collective.before_accumulate()``.

At torch's bucket rebuild the reducer keeps the collective's buckets and calls ``follow_layout`` with the
layout torch's DDP would reduce from then on (at 3+ ranks the summation order depends on it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from .buckets import Bucket

__all__ = ["BucketCollective"]


@runtime_checkable
class BucketCollective(Protocol):
    """What replaces each gradient bucket's all-reduce; installed with ``Reducer.install_bucket_collective``."""

    description: str
    """Names the collective in errors, as the object of "this model already has ...", e.g. ``"a ShardedOptimizer
    (its optimizer is sharded: ZeRO reduce-scatters the gradients)"``."""

    operation: str
    """What a timeout says was waited for, followed by the bucket index: ``"reduce-scatter of gradient bucket"``."""

    diagnosis_key: str
    """Store-key prefix for diagnosing a rank that never arrived; unique per collective instance, the same on
    every rank."""

    def build_buckets(self, layout: Sequence[Sequence[int]]) -> Sequence[Bucket]:
        """The buckets the reducer launches from now on, built for ``layout`` (lists of slot indices). Called once,
        at installation. The collective owns their buffers; bucket ``i`` must have ``index == i``."""
        ...

    def start(self, bucket: Bucket) -> object:
        """Start reducing ``bucket.comm_flat`` (staged and scaled by the reducer); returns the handle to wait for."""
        ...

    def finish(self, bucket: Bucket, result: torch.Tensor | None, globally_unused: frozenset[int]) -> None:
        """After the wait: leave the reduced gradients where the optimizer reads them. ``result``: what the wait
        returned (None for an in-place ``Work``); ``globally_unused``: slot indices no rank used this backward."""
        ...

    def before_accumulate(self) -> None:
        """A backward is about to add gradients onto ``.grad`` (called at the start of each synchronised backward
        and at each gradient under ``no_sync``, before the reducer reads it). A collective whose ``finish`` took
        the reduced gradients out of ``.grad`` puts them back here, so the gradients accumulate as in DDP."""
        ...

    def follow_layout(self, assignment: Sequence[Sequence[int]]) -> None:
        """torch's DDP reduces buckets ``assignment`` from now on (its rebuild); the collective keeps its buckets."""
        ...
