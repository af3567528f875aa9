"""The one way a gradient moves into a bucket's communication buffer, and back into ``.grad``.

Into the buffer (:func:`stage`): each parameter's gradient times ``scale``, in the parameter's storage
order (buckets.py: the layout contract). A fresh gradient is copied; a gradient that already is its
bucket view is scaled in place (or cast across when the buffer is separate); a missing one contributes
zeros. Consecutive copies go through one ``fastpar.ops.pack`` call, so a bucket of fresh gradients is
one kernel launch; only a gradient whose strides break the contract takes a strided copy.

Out of the buffer (:func:`finish`): the reduced values reach ``.grad`` -- the views already hold them
(or get them from one widening ``unpack``), separate gradients get one ``unpack`` per run. A parameter no
rank used keeps its ``.grad`` untouched, as in torch.

Numerics match torch's reducer: fp32 ``grad * float(1/world_size)`` (``at::mul_out``), or ``div_`` for
a gradient that is its bucket view when the user asked for torch's ``gradient_as_bucket_view=True``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import ops
from .buckets import Bucket, ParamSlot

_KERNEL_DTYPES = frozenset(ops.SUPPORTED_DTYPES)


class _Run:
    """Consecutive regions of one flat buffer, filled from (or emptied into) tensors in one kernel call."""

    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat
        self.start = self.end = 0
        self.tensors: list[torch.Tensor] = []

    def add(self, slot: ParamSlot, tensor: torch.Tensor, flush) -> None:
        if self.tensors and self.end != slot.offset:
            flush()
        if not self.tensors:
            self.start = slot.offset
        self.tensors.append(tensor)
        self.end = slot.offset + slot.numel

    def take(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        region, tensors = self.flat.narrow(0, self.start, self.end - self.start), self.tensors
        self.tensors = []
        return region, tensors


def _kernel_ok(region: torch.Tensor, tensors: Sequence[torch.Tensor]) -> bool:
    return region.dtype in _KERNEL_DTYPES and all(t.dtype in _KERNEL_DTYPES for t in tensors)


def _pack(region: torch.Tensor, sources: list[torch.Tensor], scale: float) -> None:
    if _kernel_ok(region, sources):
        ops.pack(sources, region, scale)
        return
    offset = 0  # float64 and other dtypes the kernels do not cover: torch's own mul, as torch's reducer
    for src in sources:
        torch.mul(src, scale, out=region.narrow(0, offset, src.numel()))
        offset += src.numel()


def _unpack(region: torch.Tensor, targets: list[torch.Tensor]) -> None:
    if _kernel_ok(region, targets):
        ops.unpack(region, targets)
        return
    offset = 0
    for t in targets:
        t.copy_(region.narrow(0, offset, t.numel()))
        offset += t.numel()


@torch.no_grad()
def stage(
    bucket: Bucket,
    slots: Sequence[ParamSlot],
    scale: float,
    *,
    alias_divisor: int | None = None,
    keep_stale: frozenset[int] = frozenset(),
) -> None:
    """Bring the gradients of ``slots`` (members of ``bucket``, in bucket order) into ``bucket.comm_flat``,
    times ``scale``. In view mode every copied ``.grad`` then points at its bucket view.

    ``alias_divisor``: divide gradients that already are their view by it instead (torch's arithmetic
    with ``gradient_as_bucket_view=True``). ``keep_stale``: slot indices whose current view value is saved
    first, to be restored by :func:`finish` if no rank used the parameter (torch's default semantics).
    """
    comm, grads_flat = bucket.acquire_comm_flat(), bucket.grad_flat  # also sets the slots' comm_view
    in_place = comm is grads_flat
    run = _Run(comm)
    scaled = _Run(comm)  # gradients already in place: one mul_ over consecutive views

    def flush_run() -> None:
        if run.tensors:
            region, sources = run.take()
            _pack(region, sources, scale)

    def flush_scaled() -> None:
        if scaled.tensors:
            region, _ = scaled.take()
            if alias_divisor is not None:
                region.div_(alias_divisor)
            elif scale != 1.0:
                region.mul_(scale)

    for slot in slots:
        param = slot.param
        grad = param.grad
        if grad is None:  # locally unused: contributes zeros, .grad stays None unless another rank used it
            slot.region(comm).zero_()
            continue
        if grad is slot.grad_view:
            if slot.index in keep_stale:
                slot.saved = slot.region(grads_flat).clone()
            if in_place:
                scaled.add(slot, grad, flush_scaled)
                continue
            if alias_divisor is not None:  # separate buffer: divide on the way across
                torch.div(slot.region(grads_flat), alias_divisor, out=slot.region(comm))
                continue
            source = slot.region(grads_flat)  # storage order already
        else:
            source = slot.grad_in_storage_order(grad)
            if slot.grad_view is not None:
                param.grad = slot.grad_view  # the bucket holds it from now on (filled below or by finish)
            if source is None:  # strides break the layout contract: let torch map them
                torch.mul(grad, scale, out=slot.comm_view)
                continue
        run.add(slot, source, flush_run)
    flush_run()
    flush_scaled()


@torch.no_grad()
def finish(bucket: Bucket, result: torch.Tensor | None, globally_unused: frozenset[int] | set[int]) -> None:
    """After the collective: leave the reduced gradients in ``.grad``. ``result`` is a comm hook's output
    when it is not the bucket's buffer. Parameters in ``globally_unused`` (slot indices) keep their ``.grad``."""
    comm = bucket.comm_flat
    if result is not None and result.data_ptr() != comm.data_ptr():
        comm.copy_(result.view(-1))
    if bucket.grad_flat is not None:  # view mode
        if comm is not bucket.grad_flat:
            _unpack(comm, [bucket.grad_flat])  # exact widening, one pass
        for slot in bucket.slots:
            if slot.index in globally_unused:
                if slot.saved is not None:
                    slot.region(bucket.grad_flat).copy_(slot.saved)
                continue
            if slot.param.grad is None:
                slot.param.grad = slot.grad_view  # used by another rank only
        return
    run = _Run(comm)

    def flush() -> None:
        if run.tensors:
            region, targets = run.take()
            _unpack(region, targets)

    for slot in bucket.slots:
        if slot.index in globally_unused:
            continue
        grad = slot.param.grad
        if grad is None:  # torch's clone_obey_contract: the parameter's strides when dense
            grad = (
                torch.empty_strided(
                    slot.param.size(), slot.param.stride(), dtype=slot.param.dtype, device=slot.param.device
                )
                if slot.dense
                else torch.empty_like(slot.param, memory_format=torch.contiguous_format)
            )
            slot.param.grad = grad
        target = slot.grad_in_storage_order(grad)
        if target is None:
            grad.copy_(slot.comm_view)
            continue
        run.add(slot, target, flush)
    flush()
