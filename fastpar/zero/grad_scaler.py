"""Loss scaling for :class:`fastpar.ShardedOptimizer`: :class:`ShardedGradScaler`, a ``torch.amp.GradScaler``
that unscales and checks the gradient shards.

``torch.amp.GradScaler`` finds the gradients through ``optimizer.param_groups``' ``.grad``; under ZeRO those are
None after a synchronised backward (the reduced gradient exists only as shards), so it records no inf check
and ``step()`` fails ("No inf checks were recorded for this optimizer"). This subclass -- the same relation as
torch's FSDP ``ShardedGradScaler`` to ``GradScaler`` -- unscales this rank's shards with torch's own kernel and
all-reduces the "found inf" flag over the optimizer's group, so every rank skips the same steps and keeps the
same scale. With any other optimizer it is a plain ``GradScaler``. Usage is torch's::

    scaler = fastpar.ShardedGradScaler("cuda")
    scaler.scale(loss).backward()
    scaler.unscale_(opt); opt.clip_grad_norm_(1.0)   # optional
    scaler.step(opt); scaler.update()
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for :class:`fastpar.ShardedOptimizer` (and any other optimizer, as torch's)."""

    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        if not hasattr(optimizer, "shard_grads"):  # not a ShardedOptimizer (not imported: it imports this module)
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        by_device: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
        for grad in optimizer.shard_grads():
            if not allow_fp16 and grad.dtype == torch.float16:
                raise ValueError("Attempting to unscale FP16 gradients.")  # torch's message and rule
            by_device[grad.device][grad.dtype].append(grad)
        with torch.no_grad():
            for device, per_dtype in by_device.items():
                device_found = found_inf if device == found_inf.device else torch.zeros_like(found_inf, device=device)
                device_inv = inv_scale.to(device)
                for grads in per_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, device_found, device_inv)
                if device_found is not found_inf:
                    found_inf.add_(device_found.to(found_inf.device))
            agreed = found_inf.to(optimizer.device)  # the process group's device (NCCL: the GPU)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=optimizer.process_group)  # skip on every rank alike
            found_inf.copy_(agreed)
        return {found_inf.device: found_inf}
