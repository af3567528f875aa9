"""ZeRO's bucket layout: buckets of one parameter group each, padded to a multiple of the world size, so
every rank's shard is one contiguous slice of each flat buffer.

Per bucket there are three flat buffers of the same layout (buckets.py: each parameter in its storage
order): ``grad_flat`` (gradients, what is reduce-scattered, or ``comm_flat`` when reducing in bf16),
and ``param_flat``, which the model's parameters become views of -- so the all-gather of the updated
shards writes straight into the parameters. A rank owns ``[rank * S, (rank + 1) * S)`` of each: its
optimizer steps ``param_flat``'s slice with ``grad_flat``'s slice as the gradient.

Where a bucket's elements would sit in the bucket torch's DDP reduces (the *reference* layout) is kept
per bucket, because at 3+ ranks gloo's summation order depends on it (gloo_order.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..ddp.buckets import Bucket, ParamSlot, build_buckets
from .gloo_order import SumRange, shard_sum_ranges

__all__ = ["ShardedBucket", "build_sharded_buckets", "reference_positions"]


class ShardedBucket:
    """One ZeRO bucket: the reducer's (padded) bucket, this rank's shard of it, and its parameter buffer."""

    def __init__(self, bucket: Bucket, group_index: int, rank: int, world_size: int) -> None:
        self.bucket = bucket
        self.group_index = group_index  # the optimizer's param group every parameter here belongs to
        self.rank, self.world_size = rank, world_size
        self.shard_numel = bucket.numel // world_size
        last = bucket.slots[-1]
        self.padding = bucket.numel - (last.offset + last.numel)  # elements after the last parameter
        self.start = rank * self.shard_numel
        self.end = self.start + self.shard_numel
        self.param_flat = _relocate_parameters(bucket)
        # what this rank's optimizer steps: a view of its slice of the parameters, and of the gradients
        self.shard_param = torch.nn.Parameter(self.param_flat.narrow(0, self.start, self.shard_numel))
        self.grad_shard = bucket.grad_flat.narrow(0, self.start, self.shard_numel)
        self.sum_ranges: list[SumRange] = []
        self.scratch: torch.Tensor | None = None  # the peers' contributions (point-to-point exchange)
        self.gather = None  # the in-flight all-gather of updated shards
        self.unused: list[int] = []  # slot indices without a gradient since zero_grad (clipping skips them)
        # per slot index, the shared optimizer state (``step``) once its parameters' histories differ (partial_step.py)
        self.shared_by_slot: dict[int, dict | None] | None = None

    @property
    def index(self) -> int:
        return self.bucket.index

    @property
    def slots(self) -> list[ParamSlot]:
        return self.bucket.slots

    def region(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s shard of one of this bucket's flat buffers."""
        return flat.narrow(0, rank * self.shard_numel, self.shard_numel)

    def shard_pieces(self) -> list[tuple[ParamSlot, int, int]]:
        """``(slot, start, end)`` for each parameter with elements in this rank's shard, in shard coordinates."""
        pieces = []
        for slot in self.slots:
            a, b = max(slot.offset, self.start), min(slot.offset + slot.numel, self.end)
            if a < b:
                pieces.append((slot, a - self.start, b - self.start))
        return pieces

    def follow_reference(self, reference: Mapping[int, tuple[int, int]]) -> None:
        """Learn where each element sits in torch's layout: ``reference[slot index] = (offset, bucket numel)``."""
        pieces: list[tuple[int, int, int, int]] = []  # (start, length, reference start, reference numel)
        for slot in self.slots:
            ref_offset, ref_numel = reference[slot.index]
            if pieces:
                start, length, ref_start, numel = pieces[-1]
                if start + length == slot.offset and ref_start + length == ref_offset and numel == ref_numel:
                    pieces[-1] = (start, length + slot.numel, ref_start, numel)
                    continue
            pieces.append((slot.offset, slot.numel, ref_offset, ref_numel))
        itemsize = self.bucket.comm_flat.element_size()
        self.sum_ranges = shard_sum_ranges(pieces, (self.start, self.end), self.world_size, itemsize)


@torch.no_grad()
def _relocate_parameters(bucket: Bucket) -> torch.Tensor:
    """A flat buffer holding the bucket's parameters, which become views of it (their values unchanged)."""
    flat = torch.zeros(bucket.numel, dtype=bucket.dtype, device=bucket.grad_flat.device)
    for slot in bucket.slots:
        view = slot.layout_view(flat)
        view.copy_(slot.param.detach())
        slot.param.data = view
    return flat


def reference_positions(assignment: Sequence[Sequence[int]], slots: Sequence[ParamSlot]) -> dict[int, tuple[int, int]]:
    """``{slot index: (offset, bucket numel)}`` in the layout ``assignment`` (lists of slot indices)."""
    where: dict[int, tuple[int, int]] = {}
    for members in assignment:
        total = sum(slots[i].numel for i in members)
        offset = 0
        for i in members:
            where[i] = (offset, total)
            offset += slots[i].numel
    return where


def build_sharded_buckets(
    slots: Sequence[ParamSlot],
    assignment: Sequence[Sequence[int]],
    group_of: Mapping[int, int],
    grad_dtype: torch.dtype | None,
    rank: int,
    world_size: int,
) -> list[ShardedBucket]:
    """ZeRO buckets from a layout: each bucket of ``assignment`` split by parameter group (``group_of[slot
    index]``; members keep their order), padded, with the parameters moved into ``param_flat``. Gradients
    always live in bucket views (every ``.grad`` present now is moved there)."""
    split: list[list[int]] = []
    groups: list[int] = []
    for members in assignment:
        by_group: dict[int, list[int]] = {}
        for i in members:
            by_group.setdefault(group_of[i], []).append(i)
        split.extend(by_group.values())
        groups.extend(by_group)
    buckets = build_buckets(slots, split, True, grad_dtype, pad_to=world_size)
    return [ShardedBucket(b, g, rank, world_size) for b, g in zip(buckets, groups, strict=True)]
