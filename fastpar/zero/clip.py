"""The global gradient norm from ZeRO's shards, for clipping -- with torch's bits, or in one fused pass.

``exact=True`` (the default) computes what ``torch.nn.utils.clip_grad_norm_`` computes: each parameter's
norm with torch's own kernel (``torch._foreach_norm``, fp32) over the reduced gradient shaped and strided
like the parameter, then the norm of those norms. A parameter inside one rank's shard is measured there;
one cut by a shard boundary (at most ``world_size - 1`` per bucket) is first sent, piece by piece, to
the rank holding its first piece. Every rank fills its parameters' entries of one vector of norms and one
all-reduce completes it (each entry comes from one rank: ``x + 0`` is exact). Why not just add up
partial squared norms: torch rounds each parameter's norm to fp32 first, and with Adam a last-bit change
of the clip coefficient can flip the sign of updates whose gradient is rounding noise (conv biases
before BatchNorm) -- a difference of the learning rate, not of the last bit.

``exact=False``: one ``fastpar.ops.norm_and_finite`` pass over this rank's shards (double accumulation)
and one all-reduce of the squared norm; equal to torch's norm within ~1e-7 relative, not bit for bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import ops
from ..comm.p2p_posting import WorkSet
from ..ddp.buckets import ParamSlot
from .layout import ShardedBucket

__all__ = ["ShardNorms"]


def _shaped(slot: ParamSlot, flat: torch.Tensor) -> torch.Tensor:
    """``flat`` (the parameter's elements in storage order) shaped and strided like the parameter's gradient:
    the parameter's strides when it is dense, else contiguous (the bucket's layout contract)."""
    param = slot.param
    if slot.dense and not param.is_contiguous():
        return flat.as_strided(param.size(), param.stride(), flat.storage_offset())
    return flat.view(param.shape)


def _reduced(zb: ShardedBucket, a: int, b: int) -> torch.Tensor:
    """Elements ``[a, b)`` (bucket coordinates, inside this rank's shard) of the reduced gradient."""
    return zb.grad_shard.narrow(0, a - zb.start, b - a)


class ShardNorms:
    """Per-parameter gradient norms of the reduced gradients, which exist only as shards."""

    def __init__(self, sharded: list[ShardedBucket], group: dist.ProcessGroup, num_params: int, tag_base: int) -> None:
        """``tag_base``: the pieces of parameter i travel with tag ``tag_base + i``."""
        self.sharded, self.group, self.num_params, self.tag_base = sharded, group, num_params, tag_base
        self.rank = group.rank()
        self.local: list[tuple[ShardedBucket, ParamSlot]] = []  # whole in this rank's shard
        self.assembled: list[tuple[ShardedBucket, ParamSlot, list[tuple[int, int, int]]]] = []  # (rank, a, b)
        self.sends: list[tuple[ShardedBucket, ParamSlot, int, int, int]] = []  # (..., a, b, to rank)
        for zb in sharded:
            for slot in zb.slots:
                pieces = [
                    (q, max(slot.offset, q * zb.shard_numel), min(slot.offset + slot.numel, (q + 1) * zb.shard_numel))
                    for q in range(zb.world_size)
                ]
                pieces = [(q, a, b) for q, a, b in pieces if a < b]
                owner = pieces[0][0]
                if len(pieces) == 1:
                    if owner == self.rank:
                        self.local.append((zb, slot))
                elif owner == self.rank:
                    self.assembled.append((zb, slot, pieces))
                else:
                    self.sends += [(zb, slot, a, b, owner) for q, a, b in pieces if q == self.rank]

    @torch.no_grad()
    def parameter_norms(self) -> torch.Tensor:
        """fp32 norms of every reduced parameter's gradient, in parameter order, on every rank."""
        device = self.sharded[0].param_flat.device
        works, gathered = [], []
        for zb, slot, a, b, owner in self.sends:
            works.append(
                dist.isend(
                    _reduced(zb, a, b),
                    group=self.group,
                    group_dst=owner,
                    tag=self.tag_base + slot.index,
                )
            )
        for zb, slot, pieces in self.assembled:
            whole = torch.empty(slot.numel, dtype=zb.bucket.dtype, device=device)
            for q, a, b in pieces:
                part = whole.narrow(0, a - slot.offset, b - a)
                if q == self.rank:
                    part.copy_(_reduced(zb, a, b))
                else:
                    works.append(dist.irecv(part, group=self.group, group_src=q, tag=self.tag_base + slot.index))
            gathered.append((slot, whole))
        WorkSet(works).wait()
        mine = [(slot, _shaped(slot, _reduced(zb, slot.offset, slot.offset + slot.numel))) for zb, slot in self.local]
        mine += [(slot, _shaped(slot, whole)) for slot, whole in gathered]
        norms = torch.zeros(self.num_params, dtype=torch.float32, device=device)
        if mine:
            values = torch._foreach_norm([grad for _, grad in mine], 2)
            norms[torch.tensor([slot.index for slot, _ in mine], device=device)] = torch.stack(values).float()
        dist.all_reduce(norms, group=self.group)  # every entry comes from one rank: x + 0 is exact
        return norms

    @torch.no_grad()
    def fused_total(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(total norm, all finite) from one ``norm_and_finite`` pass over the shards and one all-reduce."""
        grads = [zb.grad_shard for zb in self.sharded]
        norm, finite = ops.norm_and_finite(grads)
        sums = torch.stack([norm.double().square(), (~finite).double()])
        dist.all_reduce(sums, group=self.group)
        return sums[0].sqrt().float(), sums[1] == 0
