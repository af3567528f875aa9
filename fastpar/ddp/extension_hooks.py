"""Where DDP's per-gradient hot path runs: in the extension (``fastpar._C.BucketLauncher``) or in Python hooks.

With the compiled extension serving the parameters' device (``fastpar.ext_status()``: the prebuilt or JIT-built
``fastpar._C``), each parameter's AccumulateGrad node gets a C++ post hook, as torch's own reducer registers
them. In the common mode -- one all-reduce per bucket, no comm hook or bucket collective, neither
``find_unused_parameters`` nor ``static_graph``, no ``join()`` shadowing, no ``bucket_cap_mb="auto"`` measurement
-- the hook marks the parameter ready, counts its bucket down and launches complete buckets (pack kernel +
``ProcessGroup::allreduce``) without entering Python; Python hears once per backward, once per launched bucket,
and takes the arrival order at the end. Every other step, the C++ hook calls the reducer's Python hook, which
handles all modes. Without the
extension (the CuPy or pure-torch tiers) the Python hook is registered directly and runs every step.
:meth:`fastpar.ddp.reducer.Reducer._hooks_in_extension` is the one switch between them, per backward.

``FASTPAR_DDP_HOT_PATH=python`` keeps the Python hooks even when the extension is there (to rule it out).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ..ops import loader
from .buckets import Bucket

__all__ = ["attach", "layout"]

_EXTENSION_TIERS = ("compiled", "jit")


def _bucket_launcher_class(device: torch.device):
    """``fastpar._C.BucketLauncher`` when the extension serves tensors on ``device``, else None."""
    if os.environ.get("FASTPAR_DDP_HOT_PATH", "auto") == "python":
        return None
    name, module = loader.kernels_for(device)
    if name not in _EXTENSION_TIERS:
        return None
    return getattr(module, "BucketLauncher", None)  # None: an extension built from older sources


def attach(
    params: Sequence[torch.Tensor],
    group: dist.ProcessGroup,
    on_grad: Callable[[int], None],
    on_start: Callable[[], None],
    on_launched: Callable[[int, list], None],
    on_twice: Callable[[int], None],
    on_launch_failed: Callable[[int, str], None],
):
    """Hooks on every parameter's AccumulateGrad node from C++: a ``BucketLauncher``, or None when the hot path stays
    in Python (then the caller registers Python hooks). The callbacks must not keep the reducer alive."""
    launcher = _bucket_launcher_class(params[0].device)
    if launcher is None:
        return None
    try:
        return launcher(list(params), group, on_grad, on_start, on_launched, on_twice, on_launch_failed)
    except TypeError:  # a process group torch's C++ cannot see (a Python-only stand-in): Python hooks serve it
        return None


def layout(buckets: Sequence[Bucket]) -> list[tuple]:
    """The buckets as ``BucketLauncher.set_layout`` takes them: buffers, and each member's place in them."""
    return [
        (b.comm_flat, b.grad_flat, [(s.index, s.offset, s.grad_view, s.comm_view, s.dense) for s in b.slots])
        for b in buckets
    ]
