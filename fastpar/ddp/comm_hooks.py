"""Run torch DDP communication hooks (``register_comm_hook``) on fastpar buckets.

torch's hooks (``default_hooks.allreduce_hook``, ``fp16_compress_hook``, PowerSGD, ...) receive a
``dist.GradBucket``; :class:`GradBucket` offers the same methods over a fastpar bucket, and
:func:`hook_result` turns what the hook's future yields back into the bucket's flat buffer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .buckets import Bucket

__all__ = ["GradBucket", "builtin_hook", "hook_result", "keeps_no_bucket_state"]


class GradBucket:
    """The bucket object a comm hook sees: a flat ``buffer()`` (not divided by world size) and its parameters."""

    def __init__(self, bucket: Bucket, buffer: torch.Tensor, is_last: bool) -> None:
        self._bucket = bucket
        self._buffer = buffer
        self._is_last = is_last

    def index(self) -> int:
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        if buffer.numel() != self._buffer.numel():
            raise ValueError(
                f"GradBucket.set_buffer: bucket {self.index()} holds {self._buffer.numel()} elements, "
                f"the new buffer {buffer.numel()}; pass a tensor of the same size"
            )
        self._buffer = buffer

    def is_last(self) -> bool:
        return self._is_last

    def gradients(self) -> list[torch.Tensor]:
        """Views of ``buffer()`` shaped like each parameter, with the parameter's strides (the layout the
        bucket holds gradients in: a channels_last weight's gradient is channels_last here too)."""
        flat = self._buffer.view(-1)
        return [slot.layout_view(flat) for slot in self._bucket.slots]

    def parameters(self) -> list[torch.Tensor]:
        return list(self._bucket.params)


def hook_result(value) -> torch.Tensor:
    """The tensor a comm hook's future completed with (torch allows a one-element list)."""
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise ValueError(f"a comm hook's future must hold one tensor, got {len(value)}")
        value = value[0]
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"a comm hook's future must hold a tensor, got {type(value).__name__}")
    return value


def keeps_no_bucket_state(hook: Callable) -> bool:
    """Whether ``hook`` is one of torch's default hooks (all-reduce, fp16/bf16 compression), which hold no state
    between steps. Any other hook may key state by bucket index (PowerSGD's error feedback and warm start do)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return hook in (default_hooks.allreduce_hook, default_hooks.fp16_compress_hook, default_hooks.bf16_compress_hook)


def builtin_hook(comm_hook_type) -> Callable:
    """The Python hook equivalent to a ``dist.BuiltinCommHookType``."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    table = {
        dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
        dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook,
    }
    if comm_hook_type not in table:
        raise ValueError(f"unknown built-in comm hook {comm_hook_type}; use ALLREDUCE or FP16_COMPRESS")
    return table[comm_hook_type]
