"""Pure-torch implementations of ``fastpar.ops``: the fallback when ``_C`` is unavailable and the
reference the compiled kernels are tested against.

Arithmetic contract shared with the C++/CUDA kernels (so results are bit-identical):
every element is converted to fp32, multiplied by ``float(scale)`` in fp32, then rounded once
(round-to-nearest-even) to the destination dtype; ``accumulate`` adds in fp32 and rounds once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_dtype(op: str, what: str, t: torch.Tensor) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{op}: {what} has dtype {t.dtype}; supported dtypes are float32, float16 and bfloat16")


def _check_tensor(op: str, what: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {what} must be a torch.Tensor, got {type(t).__name__}")


def _check_flat(op: str, name: str, flat: torch.Tensor) -> None:
    _check_tensor(op, name, flat)
    _check_dtype(op, name, flat)
    if flat.dim() != 1:
        raise ValueError(f"{op}: {name} must be 1-D, got shape {tuple(flat.shape)}; pass buffer.view(-1)")
    if not flat.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous; pass {name}.contiguous() and copy back")


def _check_list(op: str, flat: torch.Tensor, tensors: Sequence[torch.Tensor], name: str) -> int:
    total = 0
    for i, t in enumerate(tensors):
        _check_tensor(op, f"tensors[{i}]", t)
        _check_dtype(op, f"tensors[{i}]", t)
        if t.device != flat.device:
            raise ValueError(
                f"{op}: tensors[{i}] is on {t.device} but {name} is on {flat.device}; move them to one device"
            )
        total += t.numel()
    if total > flat.numel():
        raise ValueError(
            f"{op}: {name} has {flat.numel()} elements but the tensors hold {total}; "
            f"allocate {name} with at least {total} elements"
        )
    return total


def pack(tensors: Sequence[torch.Tensor], out: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    _check_flat("pack", "out", out)
    _check_list("pack", out, tensors, "out")
    offset = 0
    for t in tensors:
        n = t.numel()
        if n:
            out[offset : offset + n].copy_((t.reshape(-1).float() * float(scale)).to(out.dtype))
        offset += n
    return out


def unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor], scale: float = 1.0, accumulate: bool = False) -> None:
    _check_flat("unpack", "flat", flat)
    _check_list("unpack", flat, tensors, "flat")
    offset = 0
    for t in tensors:
        n = t.numel()
        if n:
            value = flat[offset : offset + n].float() * float(scale)
            if accumulate:
                value = t.reshape(-1).float() + value
            t.copy_(value.to(t.dtype).view(t.shape))
        offset += n


def _check_flats(flats: Sequence[torch.Tensor]) -> torch.device:
    """Validates the buffers of a norm; returns their device (CPU when there are none)."""
    device = torch.device("cpu")
    for i, f in enumerate(flats):
        _check_tensor("norm_and_finite", f"flats[{i}]", f)
        _check_dtype("norm_and_finite", f"flats[{i}]", f)
        if i == 0:
            device = f.device
        elif f.device != device:
            raise ValueError(
                f"norm_and_finite: flats[{i}] is on {f.device} but flats[0] is on {device}; move them to one device"
            )
    return device


def norm_and_finite(flats: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    device = _check_flats(flats)
    sq = torch.zeros((), dtype=torch.float64, device=device)
    finite = torch.ones((), dtype=torch.bool, device=device)
    for f in flats:
        if f.numel():
            x = f.reshape(-1).double()
            sq += x.square().sum()
            finite &= torch.isfinite(f).all()
    return sq.sqrt().float(), finite
