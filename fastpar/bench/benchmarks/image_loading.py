"""What the image-loader benchmarks (``fastpar bench data``, local folder and object store) share: the CPU time
they charge, the check every batch passes, and the pause that keeps one pipeline's look-ahead out of the
next one's timing."""

from __future__ import annotations

import resource

import torch

from ..harness import WrongResultError

SETTLE_S = 0.5  # pause between timed epochs (background prefetch of ~2 batches takes well under this)


def cpu_seconds() -> float:
    """CPU time of this process plus its finished (reaped) children, e.g. DataLoader workers."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def check_batch(images: torch.Tensor, labels: torch.Tensor, backend: str, size: int) -> None:
    if images.dtype != torch.float32 or tuple(images.shape[1:]) != (3, size, size) or len(labels) != len(images):
        raise WrongResultError(
            f"{backend} loader yielded images {tuple(images.shape)} {images.dtype} with {len(labels)} labels; "
            f"expected (B, 3, {size}, {size}) float32 with B labels"
        )
