"""Fused bucket kernels: the hot path of gradient bucketing.

Each op runs as one pass over many tensors (one CUDA launch per call; ``at::parallel_for`` on CPU)
through the kernels that are live for the tensors' device (``fastpar.ext_status()``): the compiled
extension, the CuPy/NVRTC tier on CUDA, else the pure-torch reference in ``fastpar.ops.reference``, all
with identical results. :func:`last_implementation` says which one served the last call on a device.

Numerics (both paths): elements are converted to fp32, scaled in fp32 and rounded once to the
destination dtype, so ``scale=1/world_size`` averaging gives the same bits everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import loader, reference

__all__ = ["pack", "unpack", "norm_and_finite", "last_implementation", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = reference.SUPPORTED_DTYPES
_last_served: dict[torch.device, str] = {}


def _as_sequence(tensors: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """Lists and tuples go to C++ as they are: copying one touches every tensor object, and with thousands of
    tensors whose objects are no longer in cache that costs ~15% of a pack."""
    return tensors if isinstance(tensors, (list, tuple)) else list(tensors)


def _impl(device: torch.device):
    """The kernels for ``device`` (None: pure torch), recording which implementation serves the call."""
    name, impl = loader.kernels_for(device)
    _last_served[device] = name
    return impl


def last_implementation(device: str | torch.device) -> str | None:
    """Which implementation served the most recent call of a ``fastpar.ops`` function on ``device``:
    ``"compiled"``, ``"jit"``, ``"cupy"`` or ``"torch"`` (the pure-torch reference); None before any call.

    A fallback is silent by design (results are identical), so this is how a test or a user proves that a
    kernel tier ran: ``ops.pack(...); assert ops.last_implementation("cuda") == "cupy"``."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _last_served.get(device)


def pack(tensors: Sequence[torch.Tensor], out: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Copy ``tensors``, flattened and in order, into 1-D ``out`` from offset 0, times ``scale``,
    cast to ``out.dtype`` (float32/float16/bfloat16 in any combination). Returns ``out``.

    Non-contiguous inputs are read correctly. ``out`` must be contiguous, on the tensors' device and
    hold at least their total number of elements; elements past that are left untouched.
    """
    impl = _impl(out.device) if isinstance(out, torch.Tensor) else None
    if impl is None:
        return reference.pack(tensors, out, scale)
    return impl.pack(_as_sequence(tensors), out, float(scale))


def unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor], scale: float = 1.0, accumulate: bool = False) -> None:
    """The reverse of :func:`pack`: write ``flat[offset:offset+n] * scale`` into each tensor, cast to
    that tensor's dtype; with ``accumulate=True`` add into it instead (in fp32, rounded once)."""
    impl = _impl(flat.device) if isinstance(flat, torch.Tensor) else None
    if impl is None:
        return reference.unpack(flat, tensors, scale, accumulate)
    impl.unpack(flat, _as_sequence(tensors), float(scale), bool(accumulate))


def norm_and_finite(flats: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """L2 norm over all elements of ``flats`` (fp32 0-d tensor) and whether every element is finite
    (bool 0-d tensor), in one pass, on the buffers' device (no host sync: call ``.item()`` to read)."""
    flats = _as_sequence(flats)
    impl = _impl(flats[0].device) if flats and isinstance(flats[0], torch.Tensor) else None
    if impl is None:
        return reference.norm_and_finite(flats)
    norm, finite = impl.norm_and_finite(flats)
    return norm, finite
