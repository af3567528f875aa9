"""ZeRO's bucket layout: buckets of one parameter group each, padded to a multiple of the world size, so
every rank's shard is one contiguous slice of each flat buffer.

Per bucket there are flat buffers of the same layout (buckets.py: each parameter in its storage order):
``param_flat``, which the model's parameters become views of -- so the all-gather of the updated shards
writes straight into the parameters -- and the gradients. A rank owns ``[rank * S, (rank + 1) * S)`` of
each: its optimizer steps ``param_flat``'s slice with ``grad_shard`` as the gradient.

- Stage 1: the bucket keeps a full-size ``grad_flat`` (the ``.grad`` views; what is reduce-scattered, or
  ``comm_flat`` when reducing in bf16), and ``grad_shard`` is this rank's slice of it.
- Stage 2 (``shard_gradients``): ``grad_shard`` is the bucket's only persistent gradient memory (1/N of
  it); ``comm_flat`` exists only while the bucket is in flight, lent by a pool (gradient_pool.py).

Where a bucket's elements would sit in the bucket torch's DDP reduces (the *reference* layout) is kept
per bucket, because at 3+ ranks gloo's summation order depends on it (fastpar/comm/gloo_order.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..comm.gloo_order import SumRange, shard_sum_ranges
from ..costmodel.zero_staging import split_to_fit
from ..ddp.buckets import Bucket, ParamSlot, build_buckets

__all__ = ["ShardedBucket", "build_sharded_buckets", "reference_positions"]


class ShardedBucket:
    """One ZeRO bucket: the reducer's (padded) bucket, this rank's shard of it, and its parameter buffer."""

    def __init__(
        self, bucket: Bucket, group_index: int, rank: int, world_size: int, shard_gradients: bool = False
    ) -> None:
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
        self.comm_dtype = bucket.comm_flat.dtype  # what the exchange moves (bf16 when reducing in bf16)
        if shard_gradients:  # the reduced shard outlives the bucket's (pooled) full-size buffer
            self.grad_shard = torch.zeros(self.shard_numel, dtype=bucket.dtype, device=self.param_flat.device)
        else:
            self.grad_shard = bucket.grad_flat.narrow(0, self.start, self.shard_numel)
        self.buffer = None  # stage 2: the pool's buffer this bucket holds while in flight
        self.sum_ranges: list[SumRange] = []
        self.scratch: torch.Tensor | None = None  # the peers' contributions (point-to-point exchange)
        # stage 2, a padded large parameter reduced in its gradient's memory: the last rank's region, padded
        self.tail: torch.Tensor | None = None
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
        itemsize = torch.empty((), dtype=self.comm_dtype).element_size()
        self.sum_ranges = shard_sum_ranges(pieces, (self.start, self.end), self.world_size, itemsize)


class PooledBucket(Bucket):
    """A stage-2 bucket without a buffer of its own: when a backward first asks for one (``acquire_comm_flat()``:
    the reducer, about to stage a gradient into it, on arrival or at launch) ``lend(bucket)`` lends it one of the
    pool's; once the reduced shard is copied out it is given back. Between, ``comm_flat`` is ``placeholder``: the
    bucket's size and dtype on the meta device -- no memory, and a write into it fails instead of landing
    anywhere. Reading ``comm_flat`` (a memory count, a dtype) never borrows."""

    __slots__ = ("lend", "placeholder", "early")

    def __init__(self, index: int, slots: list[ParamSlot], comm_dtype: torch.dtype | None, pad_to: int) -> None:
        self.lend = self.placeholder = self.early = None
        super().__init__(index, slots, False, comm_dtype, pad_to)  # allocates a comm_flat, dropped at once
        self.placeholder = torch.empty(self.numel, dtype=self.comm_flat.dtype, device="meta")
        self.comm_flat = self.placeholder
        for slot in slots:
            slot.comm_view = None

    def acquire_comm_flat(self) -> torch.Tensor:
        if self.comm_flat is self.placeholder and self.lend is not None:
            self.lend(self)  # sets comm_flat (and the slots' comm_view)
        return self.comm_flat

    def may_stage_early(self) -> bool:
        return self.comm_flat is not self.placeholder or self.early is None or self.early(self)

    @property
    def nbytes(self) -> int:
        """What the collective moves (the DDP logger reports it between steps: without lending a buffer)."""
        return self.numel * self.placeholder.element_size()


@torch.no_grad()
def _relocate_parameters(bucket: Bucket) -> torch.Tensor:
    """A flat buffer holding the bucket's parameters, which become views of it (their values unchanged)."""
    flat = torch.zeros(bucket.numel, dtype=bucket.dtype, device=bucket.slots[0].param.device)
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
    shard_gradients: bool = False,
    max_numel: int | None = None,
) -> list[ShardedBucket]:
    """ZeRO buckets from a layout: each bucket of ``assignment`` split by parameter group (``group_of[slot
    index]``; members keep their order), padded, with the parameters moved into ``param_flat``. Stage 1:
    gradients live in bucket views (every ``.grad`` present now is moved there). Stage 2: :class:`PooledBucket`
    (no full-size gradient buffer of its own), split further into runs of at most ``max_numel`` elements (one
    larger parameter alone) so that they fit the pool's buffers."""
    split: list[list[int]] = []
    groups: list[int] = []
    for members in assignment:
        by_group: dict[int, list[int]] = {}
        for i in members:
            by_group.setdefault(group_of[i], []).append(i)
        for group, grouped in by_group.items():
            sizes = [slots[i].numel for i in grouped]
            for run in split_to_fit(sizes, max_numel) if max_numel is not None else [range(len(grouped))]:
                split.append([grouped[k] for k in run])
                groups.append(group)
    if not shard_gradients:
        buckets = build_buckets(slots, split, True, grad_dtype, pad_to=world_size)
    else:
        buckets = []
        for index, members in enumerate(split):
            members_slots = [slots[i] for i in members]
            narrow = grad_dtype if members_slots[0].param.dtype == torch.float32 else None  # build_buckets' rule
            buckets.append(PooledBucket(index, members_slots, narrow, world_size))
    return [ShardedBucket(b, g, rank, world_size, shard_gradients) for b, g in zip(buckets, groups, strict=True)]
