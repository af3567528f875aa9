"""The mixed-precision policy of a fully sharded model: which dtype the units compute in, which dtype the
gradients are reduced in, and which dtype the model's outputs come back in.

The policy is torch's :class:`~torch.distributed.fsdp.MixedPrecisionPolicy`; fastpar names the usual ones
and checks them against the device before anything is sharded:

- ``None``: everything in the parameters' dtype (fp32 training).
- ``"bf16"``: parameters all-gathered and computed in bfloat16, gradients reduced in float32 (a sum of N
  bf16 gradients loses bits that fp32 keeps, for twice the reduce-scatter bytes), the model's output in
  float32 so the loss is computed in full precision (the output dtype is applied on the root unit only;
  between units activations stay bfloat16). The sharded parameters and the optimizer stay float32.
- ``"fp16"``: the same with float16, for GPUs; it needs loss scaling (``torch.amp.GradScaler``). On CPU it
  is refused: CPU kernels in float16 are slow and partly missing; use ``"bf16"``.
- a ``MixedPrecisionPolicy``: used as given (after the same device check).
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

PrecisionSpec = str | MixedPrecisionPolicy | None

_NAMED = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def precision_policy(mixed_precision: PrecisionSpec, device: torch.device) -> MixedPrecisionPolicy:
    """The :class:`MixedPrecisionPolicy` for ``mixed_precision`` on ``device``; ``ValueError`` says what to change
    when the device can't run it."""
    if mixed_precision is None or mixed_precision in ("fp32", "float32", "no"):
        policy = MixedPrecisionPolicy()
    elif isinstance(mixed_precision, MixedPrecisionPolicy):
        policy = mixed_precision
    elif isinstance(mixed_precision, str) and mixed_precision.lower() in _NAMED:
        low = _NAMED[mixed_precision.lower()]
        policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32, output_dtype=torch.float32)
    else:
        raise ValueError(
            f"mixed_precision={mixed_precision!r}: give None, 'bf16', 'fp16' or a "
            f"torch.distributed.fsdp.MixedPrecisionPolicy"
        )
    _check_device(policy, torch.device(device))
    return policy


def _check_device(policy: MixedPrecisionPolicy, device: torch.device) -> None:
    dtypes = {policy.param_dtype, policy.reduce_dtype, policy.output_dtype} - {None}
    if device.type == "cpu" and torch.float16 in dtypes:
        raise ValueError(
            "mixed_precision with float16 on CPU: CPU kernels in float16 are slow and some are missing, and "
            "float16 needs loss scaling; use mixed_precision='bf16' on CPU (fp16 is for GPUs)"
        )
    if device.type == "cuda" and torch.bfloat16 in dtypes and not torch.cuda.is_bf16_supported():
        name = torch.cuda.get_device_name(device)
        raise ValueError(
            f"mixed_precision with bfloat16 on {name}, which has no bfloat16 support: use mixed_precision='fp16' "
            f"(with torch.amp.GradScaler) or None"
        )


def describe_precision(policy: MixedPrecisionPolicy) -> dict[str, str]:
    """The policy as text: compute (parameter) dtype, gradient reduce dtype, output dtype."""

    def name(dtype: torch.dtype | None) -> str:
        return "parameter dtype" if dtype is None else str(dtype).removeprefix("torch.")

    return {
        "param_dtype": name(policy.param_dtype),
        "reduce_dtype": name(policy.reduce_dtype),
        "output_dtype": name(policy.output_dtype),
    }
