"""The bucket layout and the flat buffers gradients live in: one record per parameter, one rule for
bucket boundaries (shared by DDP and :func:`fastpar.ddp.all_reduce_coalesced`).

The layout contract (torch's): a parameter whose memory is dense gets a bucket view with the
parameter's own strides, so autograd writes its gradient straight into the bucket and the bucket holds
the gradient in the parameter's *storage* order (a channels_last weight stays channels_last). Every
copy into or out of a bucket therefore moves storage order to storage order (:func:`storage_flat`);
a non-dense parameter gets a contiguous view, as autograd gives it a contiguous gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ..costmodel.bucket_caps import (  # the one cap rule, also the planner's
    CPU_BUCKET_BYTES,
    CPU_MAX_BUCKETS,
    DEFAULT_FIRST_BUCKET_BYTES,
    TORCH_BUCKET_BYTES,
    bucket_caps,
)

__all__ = [
    "CPU_BUCKET_BYTES",
    "CPU_MAX_BUCKETS",
    "DEFAULT_FIRST_BUCKET_BYTES",
    "TORCH_BUCKET_BYTES",
    "Bucket",
    "ParamSlot",
    "assign_buckets",
    "build_buckets",
    "default_caps",
    "initial_layout",
    "same_layout",
    "storage_flat",
]


def default_caps(
    tensors: Sequence[torch.Tensor], world_size: int, *, shared_buckets: bool = False, cores: int | None = None
) -> list[int]:
    """Byte caps (first bucket, then the rest) fastpar uses when the user gives no ``bucket_cap_mb``: the rule
    of :func:`fastpar.costmodel.bucket_caps.bucket_caps` (why those sizes: there), for these tensors."""
    if not tensors:
        return [DEFAULT_FIRST_BUCKET_BYTES, TORCH_BUCKET_BYTES]
    total = sum(t.numel() * t.element_size() for t in tensors)
    return bucket_caps(total, tensors[0].device.type, world_size, shared_buckets=shared_buckets, cores=cores)


def assign_buckets(tensors: Sequence[torch.Tensor], order: Sequence[int], caps: Sequence[int]) -> list[list[int]]:
    """Group tensor indices, taken in ``order``, into buckets of one dtype and device each.

    Bucket k of a dtype closes once it holds ``caps[min(k, len(caps) - 1)]`` bytes or more (a small
    ``caps[0]`` gives a small first bucket, as in torch). Buckets come out in the order of their first
    member. torch's own assignment function is used when it exists: the same contents and offsets keep
    the all-reduce's summation order, and so the bits at world size > 2, identical to torch DDP's.
    """
    if not caps or min(caps) <= 0:
        raise ValueError(f"bucket caps must be positive, got {list(caps)}")
    order = list(order)
    torch_assign = getattr(dist, "_compute_bucket_assignment_by_size", None)
    if torch_assign is not None and len(order) == len(tensors):
        # torch takes the tensors in bucketing order; ``order`` only labels them with their indices
        indices, _ = torch_assign([tensors[i] for i in order], list(caps), [False] * len(order), order)
        return [list(bucket) for bucket in indices]
    closed: list[list[int]] = []
    open_buckets: dict[tuple, tuple[list[int], int, int]] = {}  # key -> (members, bytes, how many closed)
    for i in order:
        t = tensors[i]
        key = (t.dtype, t.device)
        members, size, n_closed = open_buckets.get(key, ([], 0, 0))
        members.append(i)
        size += t.numel() * t.element_size()
        if size >= caps[min(n_closed, len(caps) - 1)]:
            closed.append(members)
            open_buckets[key] = ([], 0, n_closed + 1)
        else:
            open_buckets[key] = (members, size, n_closed)
    closed.extend(members for members, _, _ in open_buckets.values() if members)
    position = {i: pos for pos, i in enumerate(order)}
    closed.sort(key=lambda members: position[members[0]])
    return closed


def initial_layout(params: Sequence[torch.Tensor], caps: Sequence[int]) -> list[list[int]]:
    """torch DDP's layout before the first backward: assigned in registration order, then the list of
    buckets reversed (members keep registration order), so offsets match torch's bucket for bucket."""
    torch_assign = getattr(dist, "_compute_bucket_assignment_by_size", None)
    if torch_assign is not None and caps and min(caps) > 0:
        # called as torch's constructor calls it, without indices: buckets of several dtypes then come out sorted
        # by their first member (with indices, as at the rebuild, they do not)
        indices, _ = torch_assign(list(params), list(caps), [False] * len(params))
        return [list(bucket) for bucket in reversed(indices)]
    return list(reversed(assign_buckets(params, range(len(params)), caps)))


def is_dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: the elements fill ``numel`` consecutive storage slots in some order
    (contiguous, channels_last, a transposed matrix, ...)."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((s, d) for s, d in zip(t.stride(), t.shape, strict=True) if d != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and the same storage order (strides of size-1 dimensions do not matter)."""
    return a.shape == b.shape and all(
        sa == sb for sa, sb, d in zip(a.stride(), b.stride(), a.shape, strict=True) if d != 1
    )


def storage_flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of a dense tensor's memory in storage order (no copy), e.g. a channels_last gradient as
    laid out in memory. Copying storage order to storage order keeps a strided gradient's layout."""
    if t.is_contiguous():
        return t.view(-1)
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


class ParamSlot:
    """Everything the reducer keeps for one parameter: where it lives in its bucket, and this step's state."""

    __slots__ = (
        "index",
        "name",
        "param",
        "bucket",
        "pos",
        "offset",
        "numel",
        "dense",
        "grad_view",
        "comm_view",
        "acc",
        # per backward
        "ready",
        "used",
        "staged",
        "fires",
        "expected_fires",
        "saved",
    )

    def __init__(self, index: int, name: str, param: torch.Tensor) -> None:
        self.index, self.name, self.param = index, name, param
        self.bucket: Bucket | None = None
        self.pos = self.offset = 0
        self.numel = param.numel()
        self.dense = is_dense(param)
        self.grad_view: torch.Tensor | None = None  # the .grad autograd accumulates into (view mode)
        self.comm_view: torch.Tensor | None = None  # same layout, in the buffer the collective reduces
        self.acc = None  # the parameter's AccumulateGrad node (unused-parameter search)
        self.ready = self.used = self.staged = False
        self.fires = 0
        self.expected_fires = 1  # static graph: how many times the hook fires per backward (learned)
        self.saved: torch.Tensor | None = None  # a stale .grad restored if no rank uses the parameter

    def layout_view(self, flat: torch.Tensor) -> torch.Tensor:
        """This parameter's region of ``flat`` shaped like the parameter (its strides if dense)."""
        if self.dense and not self.param.is_contiguous():
            return flat.as_strided(self.param.size(), self.param.stride(), flat.storage_offset() + self.offset)
        return flat.narrow(0, self.offset, self.numel).view(self.param.shape)

    def region(self, flat: torch.Tensor) -> torch.Tensor:
        """This parameter's region of ``flat`` as a 1-D slice (storage order)."""
        return flat.narrow(0, self.offset, self.numel)

    def grad_in_storage_order(self, grad: torch.Tensor) -> torch.Tensor | None:
        """``grad`` as a 1-D storage-order view when its layout matches the bucket's (the layout contract),
        else None (the caller copies it through the strided view)."""
        if grad.is_contiguous() and self.param.is_contiguous():  # the common case, decided without strides
            return grad.view(-1)
        if not self.dense:
            return grad.view(-1) if grad.is_contiguous() else None
        if not same_layout(grad, self.param):
            return None
        return storage_flat(grad)

    def reset_step(self) -> None:
        """Forget this backward's progress (``used`` outlives it: no_sync micro-batches count)."""
        self.ready = self.staged = False
        self.fires = 0
        self.saved = None


class Bucket:
    """Parameters reduced by one collective, and their flat buffers.

    ``grad_flat`` (parameter dtype) backs the ``.grad`` views in view mode; ``comm_flat`` is what the
    collective reduces: ``grad_flat`` itself, or a separate buffer when reducing in a lower precision
    (``grad_dtype``) or without views. ``pad_to``: the buffers hold a multiple of this many elements
    (zeros after the last parameter), so ZeRO can cut them into equal shards; DDP leaves it at 1.
    """

    __slots__ = ("index", "slots", "dtype", "numel", "grad_flat", "comm_flat", "pending", "work", "launched")

    def __init__(
        self,
        index: int,
        slots: list[ParamSlot],
        grad_views: bool,
        comm_dtype: torch.dtype | None,
        pad_to: int = 1,
        comm_buffer: torch.Tensor | None = None,
    ) -> None:
        self.index = index
        self.slots = slots
        first = slots[0].param
        self.dtype = first.dtype
        device = first.device
        offset = 0
        for pos, slot in enumerate(slots):
            slot.bucket, slot.pos, slot.offset = self, pos, offset
            offset += slot.numel
        self.numel = -(-offset // pad_to) * pad_to
        comm_dtype = comm_dtype or self.dtype
        shares_buffer = grad_views and comm_dtype == self.dtype
        if comm_buffer is not None:  # zeroed, numel elements of comm_dtype (build_buckets' shared memory)
            self.comm_flat = comm_buffer
        else:
            self.comm_flat = torch.zeros(self.numel, dtype=comm_dtype, device=device)
        if shares_buffer:
            self.grad_flat = self.comm_flat
        else:
            self.grad_flat = torch.zeros(self.numel, dtype=self.dtype, device=device) if grad_views else None
        for slot in slots:
            slot.grad_view = slot.layout_view(self.grad_flat) if grad_views else None
            slot.comm_view = slot.layout_view(self.comm_flat)
        self.pending = len(slots)
        self.work = None
        self.launched = False

    @property
    def params(self) -> list[torch.Tensor]:
        return [s.param for s in self.slots]

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.slots]

    @property
    def nbytes(self) -> int:
        return self.comm_flat.numel() * self.comm_flat.element_size()

    def acquire_comm_flat(self) -> torch.Tensor:
        """``comm_flat``, made ready to stage into: a DDP bucket owns it; a pooled ZeRO-2 bucket borrows one of
        its pool's buffers here when it holds none, which may first wait for an earlier bucket's collective to
        return one (:class:`fastpar.zero.layout.PooledBucket`). Reading ``comm_flat`` itself never allocates."""
        return self.comm_flat

    def may_stage_early(self) -> bool:
        """Whether a gradient may be staged now, on arrival, before the bucket launches: always for a bucket that
        owns its buffer; a pooled ZeRO-2 bucket only while its pool keeps a buffer for the next launch."""
        return True

    def reset(self) -> None:
        self.pending = len(self.slots)
        self.work = None
        self.launched = False


def build_buckets(
    slots: Sequence[ParamSlot],
    assignment: list[list[int]],
    grad_views: bool,
    grad_dtype: torch.dtype | None,
    pad_to: int = 1,
    comm_alloc: Callable[[list[tuple[int, torch.dtype]]], list[torch.Tensor] | None] | None = None,
) -> list[Bucket]:
    """Allocate buckets for ``assignment`` (lists of slot indices). In view mode each current ``.grad`` is
    moved into its new view (at construction and at the rebuild), so nothing a user holds is lost.
    ``pad_to``: see :class:`Bucket`. ``comm_alloc``: given every bucket's (numel, dtype) of what it reduces,
    zeroed flat buffers for them, or None (then each bucket allocates its own) -- DDP's shared-memory buckets
    (:mod:`fastpar.comm.shared_buffers`)."""
    members_of = [[slots[i] for i in members] for members in assignment]
    # only fp32 is narrowed
    narrows = [grad_dtype if members[0].param.dtype == torch.float32 else None for members in members_of]
    comm_buffers = None
    if comm_alloc is not None and assignment:
        comm_buffers = comm_alloc(
            [
                (-(-sum(s.numel for s in members) // pad_to) * pad_to, narrow or members[0].param.dtype)
                for members, narrow in zip(members_of, narrows, strict=True)
            ]
        )
    buckets = []
    for index, members_slots in enumerate(members_of):
        comm_buffer = comm_buffers[index] if comm_buffers is not None else None
        bucket = Bucket(index, members_slots, grad_views, narrows[index], pad_to, comm_buffer)
        if grad_views:
            with torch.no_grad():
                for slot in members_slots:
                    grad = slot.param.grad
                    if grad is not None and grad is not slot.grad_view:
                        slot.grad_view.copy_(grad)
                        slot.param.grad = slot.grad_view
        buckets.append(bucket)
    return buckets
