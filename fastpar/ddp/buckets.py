"""Bucket assignment and the flat buffers gradients live in.

A bucket holds parameters of one dtype and device. Its ``grad_flat`` (parameter dtype) backs the
``.grad`` views in view mode; ``comm_flat`` is what the collective reduces: ``grad_flat`` itself, or
a separate buffer when reducing in a lower precision (``grad_dtype``) or without views.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["Bucket", "assign_buckets", "auto_caps", "build_buckets", "initial_buckets"]

DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024  # torch's dist._DEFAULT_FIRST_BUCKET_BYTES
TORCH_BUCKET_BYTES = 25 * 1024 * 1024  # torch's default bucket_cap_mb
CPU_BUCKET_BYTES = 4 * 1024 * 1024
CPU_MAX_BUCKETS = 64


def auto_caps(params: Sequence[torch.Tensor], world_size: int) -> list[int]:
    """Bucket caps fastpar picks when the user gives no ``bucket_cap_mb``.

    CPU (gloo): ~4 MiB buckets. Measured on 2 ranks x 1 thread (``fastpar bench ddp`` models): against
    torch's 25 MiB, more of the all-reduce runs during backward and at most ~4 MiB is left to reduce after
    it (the MLP: 1.82x the no-communication step instead of 1.97x, same run); 0.5-1 MiB buckets lose again
    to gloo's fixed CPU cost per collective (~0.3 ms each). Huge models keep at most ``CPU_MAX_BUCKETS``
    buckets. Other devices: torch's layout (a 1 MiB first bucket, then 25 MiB).
    Only at world size <= 2, where the layout cannot change results (each element is one a + b,
    commutative in floating point): at larger world sizes the collective's summation order depends on
    the layout, so fastpar keeps torch's and with it torch's bits.
    """
    if params[0].device.type != "cpu" or world_size > 2:
        return [DEFAULT_FIRST_BUCKET_BYTES, TORCH_BUCKET_BYTES]
    total = sum(p.numel() * p.element_size() for p in params)
    return [DEFAULT_FIRST_BUCKET_BYTES, max(CPU_BUCKET_BYTES, -(-total // CPU_MAX_BUCKETS))]


def initial_buckets(params: Sequence[torch.Tensor], caps: Sequence[int]) -> list[list[int]]:
    """torch DDP's layout before the first backward: assigned in registration order, then the list of
    buckets reversed (members keep registration order), so offsets match torch's bucket for bucket."""
    return list(reversed(assign_buckets(params, range(len(params)), caps)))


def assign_buckets(params: Sequence[torch.Tensor], order: Sequence[int], caps: Sequence[int]) -> list[list[int]]:
    """Group parameter indices, taken in ``order``, into buckets of one dtype and device each.

    Bucket k of a dtype closes once it holds ``caps[min(k, len(caps) - 1)]`` bytes or more (so a
    small ``caps[0]`` gives a small first bucket, like torch). Buckets come out in the order of
    their first member, so bucket 0 holds the first gradients to arrive. torch's own assignment
    function does this when it exists: the same contents and offsets keep the all-reduce's summation
    order, and so the bits at world size > 2, identical to torch DDP's.
    """
    if not caps or min(caps) <= 0:
        raise ValueError(f"bucket caps must be positive, got {list(caps)}")
    order = list(order)
    torch_assign = getattr(dist, "_compute_bucket_assignment_by_size", None)
    if torch_assign is not None and len(order) == len(params):
        # torch takes the tensors in bucketing order; ``order`` only labels them with their indices
        indices, _ = torch_assign([params[i] for i in order], list(caps), [False] * len(params), order)
        return [list(bucket) for bucket in indices]
    closed: list[list[int]] = []
    open_buckets: dict[tuple, tuple[list[int], int, int]] = {}  # key -> (members, bytes, how many closed)
    for i in order:
        p = params[i]
        key = (p.dtype, p.device)
        members, size, n_closed = open_buckets.get(key, ([], 0, 0))
        members.append(i)
        size += p.numel() * p.element_size()
        if size >= caps[min(n_closed, len(caps) - 1)]:
            closed.append(members)
            open_buckets[key] = ([], 0, n_closed + 1)
        else:
            open_buckets[key] = (members, size, n_closed)
    closed.extend(members for members, _, _ in open_buckets.values() if members)
    position = {i: pos for pos, i in enumerate(order)}
    closed.sort(key=lambda members: position[members[0]])
    return closed


def _grad_view(flat: torch.Tensor, offset: int, param: torch.Tensor) -> torch.Tensor:
    """A view of ``flat`` shaped (and strided) like ``param``, so autograd accumulates into it in place."""
    n = param.numel()
    if param.is_contiguous() or n <= 1:
        return flat.narrow(0, offset, n).view(param.shape)
    return flat.as_strided(param.size(), param.stride(), offset)  # e.g. channels_last weights


class Bucket:
    """Parameters reduced by one collective, and their flat buffers."""

    __slots__ = (
        "index",
        "members",
        "params",
        "names",
        "numel",
        "grad_flat",
        "comm_flat",
        "views",
        "comm_views",
        "dtype",
    )

    def __init__(
        self,
        index: int,
        members: list[int],
        params: list[torch.Tensor],
        names: list[str],
        grad_views: bool,
        comm_dtype: torch.dtype | None,
    ) -> None:
        self.index = index
        self.members = members  # indices into the reducer's parameter list
        self.params = params
        self.names = names
        self.dtype = params[0].dtype
        self.numel = sum(p.numel() for p in params)
        device = params[0].device
        comm_dtype = comm_dtype or self.dtype
        self.grad_flat = torch.zeros(self.numel, dtype=self.dtype, device=device) if grad_views else None
        if grad_views and comm_dtype == self.dtype:
            self.comm_flat = self.grad_flat
        else:
            self.comm_flat = torch.zeros(self.numel, dtype=comm_dtype, device=device)
        # grads live in grad_flat (view mode) or are read out of comm_flat (no views, same dtype)
        view_source = self.grad_flat if grad_views else self.comm_flat
        self.views: list[torch.Tensor] = []
        self.comm_views: list[torch.Tensor] = []  # same layout as views, into comm_flat (view mode)
        offset = 0
        for p in params:
            self.views.append(_grad_view(view_source, offset, p) if view_source.dtype == p.dtype else None)
            self.comm_views.append(_grad_view(self.comm_flat, offset, p) if grad_views else None)
            offset += p.numel()

    @property
    def nbytes(self) -> int:
        return self.comm_flat.numel() * self.comm_flat.element_size()


def build_buckets(
    params: Sequence[torch.Tensor],
    names: Sequence[str],
    assignment: list[list[int]],
    grad_views: bool,
    comm_dtype: torch.dtype | None,
) -> list[Bucket]:
    """Allocate buckets for ``assignment``. In view mode the current gradients are moved into the new
    views (once, at construction and at the rebuild), so nothing a user holds in ``.grad`` is lost."""
    buckets = []
    for index, members in enumerate(assignment):
        bucket = Bucket(
            index,
            members,
            [params[i] for i in members],
            [names[i] for i in members],
            grad_views,
            comm_dtype if params[members[0]].dtype == torch.float32 else None,  # only fp32 is narrowed
        )
        if grad_views:
            with torch.no_grad():
                for p, view in zip(bucket.params, bucket.views, strict=True):
                    if p.grad is not None:
                        view.copy_(p.grad)
                        p.grad = view
        buckets.append(bucket)
    return buckets
