"""Moving gradients between ``.grad`` and bucket buffers: one ``fastpar.ops`` call per bucket on the
common paths, per-tensor copies only for the rare mixed cases (a few stale or missing grads)."""

from __future__ import annotations

import torch

from .. import ops
from .buckets import Bucket

_OPS_DTYPES = set(ops.SUPPORTED_DTYPES)


def pack(tensors: list[torch.Tensor], out: torch.Tensor, scale: float) -> None:
    if out.dtype in _OPS_DTYPES and all(t.dtype in _OPS_DTYPES for t in tensors):
        ops.pack(tensors, out, scale)
        return
    offset = 0  # float64 and other dtypes the kernels do not cover
    for t in tensors:
        out.narrow(0, offset, t.numel()).copy_(t.reshape(-1) * scale if scale != 1.0 else t.reshape(-1))
        offset += t.numel()


def unpack(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    if flat.dtype in _OPS_DTYPES and all(t.dtype in _OPS_DTYPES for t in tensors):
        ops.unpack(flat, tensors)
        return
    offset = 0
    for t in tensors:
        t.copy_(flat.narrow(0, offset, t.numel()).view(t.shape))
        offset += t.numel()


@torch.no_grad()
def fill_views_bucket(bucket: Bucket, scale: float, unused: frozenset | set = frozenset()) -> None:
    """View mode: make ``comm_flat`` hold this rank's gradients times ``scale``, and point every
    arrived ``.grad`` at its bucket view. ``unused`` (positions in the bucket) got no gradient this
    step: they contribute their current ``.grad`` (or zero) and keep ``.grad`` as it is for now."""
    params, views = bucket.params, bucket.views
    grads = [p.grad for p in params]
    separate_comm = bucket.comm_flat is not bucket.grad_flat
    if not unused and all(g is not None and g is not v for g, v in zip(grads, views, strict=True)):
        # fresh gradients (after zero_grad(set_to_none=True)): one pack straight into the comm buffer
        pack(grads, bucket.comm_flat, scale)
        for p, v in zip(params, views, strict=True):
            p.grad = v  # with a separate comm buffer, the view is filled by the unpack after the reduce
        return
    for _k, (p, g, v) in enumerate(zip(params, grads, views, strict=True)):
        if g is v:
            continue
        if g is None:
            v.zero_()  # locally unused: contributes zero, .grad stays None unless used elsewhere
        else:
            v.copy_(g)
            p.grad = v
    if separate_comm:
        pack([bucket.grad_flat], bucket.comm_flat, scale)
    elif scale != 1.0:
        bucket.grad_flat.mul_(scale)


@torch.no_grad()
def fill_rest_of_bucket(bucket: Bucket, scale: float, prescaled: bytearray) -> None:
    """View mode, when some gradients were already copied (scaled) into ``comm_flat`` on arrival:
    bring in the others — accumulated views, fresh tensors, or zero for locally unused ones."""
    separate_comm = bucket.comm_flat is not bucket.grad_flat
    for i, p, v, cv in zip(bucket.members, bucket.params, bucket.views, bucket.comm_views, strict=True):
        if prescaled[i]:
            continue
        g = p.grad
        if g is None:
            cv.zero_()  # locally unused: contributes zero
        elif g is v and not separate_comm:
            if scale != 1.0:
                v.mul_(scale)
        else:
            torch.mul(g, scale, out=cv)
            if g is not v:
                p.grad = v  # with a separate comm buffer, filled by the unpack after the reduce


@torch.no_grad()
def fill_packed_bucket(bucket: Bucket, scale: float) -> None:
    """No-view mode: pack the separate ``.grad`` tensors (zero for missing ones) into ``comm_flat``."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
    pack(grads, bucket.comm_flat, scale)


@torch.no_grad()
def finish_bucket(bucket: Bucket, globally_unused: set[int]) -> None:
    """After the reduce: leave the averaged gradient in ``.grad``. Parameters no rank used keep their
    ``.grad`` (None stays None), as torch does."""
    if bucket.grad_flat is not None:  # view mode
        if bucket.comm_flat is not bucket.grad_flat:
            unpack(bucket.comm_flat, [bucket.grad_flat])  # exact widening, one pass
        for k, (p, v) in enumerate(zip(bucket.params, bucket.views, strict=True)):
            if p.grad is None and k not in globally_unused:
                p.grad = v  # used by another rank only
        return
    if not globally_unused and all(p.grad is not None for p in bucket.params):
        unpack(bucket.comm_flat, [p.grad for p in bucket.params])
        return
    offset = 0
    for k, p in enumerate(bucket.params):
        n = p.numel()
        if k not in globally_unused:
            if p.grad is None:
                p.grad = torch.empty_like(p)
            unpack(bucket.comm_flat.narrow(0, offset, n), [p.grad])
        offset += n
