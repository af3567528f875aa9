"""Fused bucket kernels: the hot path of gradient bucketing.

Each op runs as one pass over many tensors (one CUDA launch per call; ``at::parallel_for`` on CPU)
through the compiled extension when it is live (``fastpar.ext_status()``), else through the
pure-torch reference in ``fastpar._torch_ops`` with identical results.

Numerics (both paths): elements are converted to fp32, scaled in fp32 and rounded once to the
destination dtype, so ``scale=1/world_size`` averaging gives the same bits everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import _ext, _torch_ops

__all__ = ["pack", "unpack", "norm_and_finite", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = _torch_ops.SUPPORTED_DTYPES


def _as_sequence(tensors: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """Lists and tuples go to C++ as they are: copying one touches every tensor object, and with thousands of
    tensors whose objects are no longer in cache that costs ~15% of a pack."""
    return tensors if isinstance(tensors, (list, tuple)) else list(tensors)


def _impl(device: torch.device):
    """The compiled module when it can run on ``device``, else None (pure torch)."""
    ext = _ext.extension()
    if ext is None:
        return None
    if device.type == "cuda" and not ext.has_cuda():
        return None  # CPU-only build: CUDA tensors take the torch path rather than failing
    if device.type not in ("cpu", "cuda"):
        return None
    return ext


def pack(tensors: Sequence[torch.Tensor], out: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Copy ``tensors``, flattened and in order, into 1-D ``out`` from offset 0, times ``scale``,
    cast to ``out.dtype`` (float32/float16/bfloat16 in any combination). Returns ``out``.

    Non-contiguous inputs are read correctly. ``out`` must be contiguous, on the tensors' device and
    hold at least their total number of elements; elements past that are left untouched.
    """
    impl = _impl(out.device) if isinstance(out, torch.Tensor) else None
    if impl is None:
        return _torch_ops.pack(tensors, out, scale)
    return impl.pack(_as_sequence(tensors), out, float(scale))


def unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor], scale: float = 1.0, accumulate: bool = False) -> None:
    """The reverse of :func:`pack`: write ``flat[offset:offset+n] * scale`` into each tensor, cast to
    that tensor's dtype; with ``accumulate=True`` add into it instead (in fp32, rounded once)."""
    impl = _impl(flat.device) if isinstance(flat, torch.Tensor) else None
    if impl is None:
        return _torch_ops.unpack(flat, tensors, scale, accumulate)
    impl.unpack(flat, _as_sequence(tensors), float(scale), bool(accumulate))


def norm_and_finite(flats: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """L2 norm over all elements of ``flats`` (fp32 0-d tensor) and whether every element is finite
    (bool 0-d tensor), in one pass, on the buffers' device (no host sync: call ``.item()`` to read)."""
    flats = _as_sequence(flats)
    impl = _impl(flats[0].device) if flats and isinstance(flats[0], torch.Tensor) else None
    if impl is None:
        return _torch_ops.norm_and_finite(flats)
    norm, finite = impl.norm_and_finite(flats)
    return norm, finite
