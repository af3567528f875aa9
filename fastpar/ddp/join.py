"""Uneven inputs: ``model.join()`` (torch's Join protocol). A rank that ran out of data shadows each
step's collectives — the bucket rebuild, buffer broadcast, the "sync this step?" vote, every bucket's
all-reduce with zeros and the used-parameter map — in the order a training rank issues them."""

from __future__ import annotations

from torch.distributed.algorithms.join import JoinHook

__all__ = ["FastparJoinHook"]


class FastparJoinHook(JoinHook):
    """Shadows a training step's collectives on a rank that ran out of inputs (torch's Join protocol)."""

    def __init__(self, ddp, divide_by_initial_world_size: bool) -> None:
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        ddp = self.ddp
        ddp._reducer.maybe_rebuild()
        ddp._check_and_sync_module_buffers()
        should_sync = ddp._check_global_requires_backward_grad_sync(is_joined_rank=True)
        ddp.require_forward_param_sync = should_sync
        if should_sync:
            ddp._reducer.shadow_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.ddp._sync_final_model(is_last_joiner)
