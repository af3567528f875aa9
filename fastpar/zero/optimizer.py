"""``fastpar.ShardedOptimizer``: ZeRO on fastpar's DDP buckets -- stage 1 shards the optimizer state, stage 2
(``shard_gradients=True``) the gradients too.

::

    model = fastpar.DistributedDataParallel(module)
    opt = fastpar.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-3, weight_decay=0.01)
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()     # each bucket is reduce-scattered as soon as it is ready
        opt.clip_grad_norm_(1.0)            # optional: the global norm from the shards
        opt.step()                          # one step per bucket shard, then an async all-gather

Every trainable parameter lives in a bucket padded to a multiple of the world size; rank r owns slice r
of every bucket. Backward reduce-scatters each bucket the moment it is complete (instead of DDP's
all-reduce); ``step()`` runs the wrapped torch optimizer on this rank's flat slice of each bucket -- one
tensor per bucket, so AdamW's moments exist only for 1/N of the parameters -- and starts the all-gather
of the updated slices, which the next forward waits for module by module (hooks.py). Stage 1 keeps a
full-size gradient buffer per bucket (the ``.grad`` views); stage 2 keeps only this rank's reduced shard
per bucket, and stages gradients into a small pool of full-size buffers lent to the buckets in flight
(sharded_gradients.py, gradient_pool.py).

The arithmetic is the per-parameter optimizer's, elementwise: parameters after any number of steps are
bit-identical to torch's DDP with the unsharded optimizer (on gloo the reduce-scatter adds in the
all-reduce's order, fastpar/comm/gloo_order.py), at both stages, except where noted in the guide (clipping's fused
norm, fused kernels). After a synchronised backward the parameters' ``.grad`` are None: the reduced
gradient exists only as shards (:meth:`clip_grad_norm_`; ``torch.nn.utils.clip_grad_norm_`` over the
model's parameters is routed to it, torch_clip.py; for loss scaling
:class:`~fastpar.zero.grad_scaler.ShardedGradScaler`). torch's gradient semantics hold nonetheless: another backward before ``zero_grad`` adds onto the reduced gradient (collectives.py,
sharded_gradients.py), and a parameter no rank used since ``zero_grad`` has no gradient and is not
stepped (partial_step.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import torch

from ..ddp.errors import pg_timeout_seconds
from .arrival import arrival_timeout_s, check_in
from .checks import (
    check_elementwise,
    check_parameter_coverage,
    describe_group,
    refuse_closure_optimizer,
    refuse_incompatible_model,
)
from .clip import ShardNorms
from .collectives import ZeroCollective
from .hooks import ParameterGate
from .memory import held_tensors, measure_memory
from .partial_step import step_shard
from .sharded_gradients import ShardedGradientCollective
from .state import gather_full_state, shard_state
from .torch_clip import register as register_torch_clip

__all__ = ["ShardedOptimizer"]

_instances = itertools.count()  # the same sequence on every rank: names this optimizer's store keys and p2p tags
_TAGS_PER_INSTANCE = 1 << 20  # point-to-point tags: [0, 2^19) bucket exchanges, [2^19, 2^20) norm pieces
_PLACEHOLDER = "fastpar_zero_placeholder"


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO: ``optimizer_class`` (any elementwise torch optimizer) over ``model``'s parameters, its state sharded
    across the ranks of the model's process group (stage 1), and with ``shard_gradients=True`` its gradients
    too (stage 2).

    ``model``: a :class:`fastpar.DistributedDataParallel`. ``params``: parameters or param groups as for
    ``optimizer_class`` (default ``model.parameters()``); groups may differ in hyperparameters -- each
    bucket holds one group's parameters. ``defaults``: ``optimizer_class``'s keyword arguments.
    ``overlap``: gather the updated parameters while the next forward runs (False: wait in ``step()``).
    ``exchange``: ``"auto"`` (point-to-point on gloo and the fastpar backend, collectives on NCCL), ``"p2p"`` or ``"collective"``.
    ``shard_gradients``: ZeRO-2. After a bucket's reduce-scatter this rank keeps only its shard of the reduced
    gradient (1/N of the bucket); full-size buffers exist only for the buckets in flight: a pool of
    ``fastpar.zero.gradient_pool.POOL_CAPACITY`` (3) buffers per dtype whose total stays within
    ``min(2 x the bucket cap, half of G (N - 1) / N)`` (the buckets are split to fit them; a parameter larger than
    a buffer is reduced from its own gradient's memory), whatever the order gradients arrive in.
    What ``p.grad`` holds:

    - after a synchronised backward: None for every parameter in a bucket, at both stages -- the reduced gradient
      is in :meth:`shard_grads` (at stage 2 autograd's full-size ``.grad`` is dropped when its bucket launches,
      during backward);
    - after a backward under ``model.no_sync()``: this rank's local, unreduced gradient, full size (as in DDP);
    - while another synchronised backward runs before ``zero_grad``: views of a temporary full-size buffer
      holding the gathered reduced gradient, released bucket by bucket as that backward launches them.

    Gradients are never bucket views at stage 2, so ``fastpar.DistributedDataParallel(...,
    gradient_as_bucket_view=True)`` is refused with it. :meth:`memory_report` measures what this rank holds.

    Build it before training (it moves the parameters into flat buffers) and call ``step()``,
    ``zero_grad()``, ``state_dict()`` and ``load_state_dict()`` on every rank.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer_class: type[torch.optim.Optimizer],
        params: Iterable | None = None,
        *,
        overlap: bool = True,
        exchange: str = "auto",
        shard_gradients: bool = False,
        **defaults: Any,
    ) -> None:
        refuse_incompatible_model(model, shard_gradients)
        refuse_closure_optimizer(optimizer_class)
        reducer = model.reducer
        template = optimizer_class(model.parameters() if params is None else params, **defaults)
        super().__init__(template.param_groups, template.defaults)
        del template
        self.model, self.optimizer_class, self.overlap = model, optimizer_class, overlap
        self.shard_gradients = shard_gradients
        self._ctor_kwargs = defaults
        self._group = reducer.group
        self._rank = self._group.rank()
        names = {id(p): n for n, p in model.module.named_parameters()}
        self._index_of = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        group_of = check_parameter_coverage(
            [g["params"] for g in self.param_groups], {id(s.param): s.name for s in reducer.slots}, names
        )
        self._elementwise_keys: set[str] = set()
        for index, group in enumerate(self.param_groups):
            label = describe_group(index, [names.get(id(p), "?") for p in group["params"]])
            self._elementwise_keys |= check_elementwise(
                optimizer_class, _hyperparameters(group), defaults, label, reducer.device
            )
        self._install(reducer, {s.index: group_of[id(s.param)] for s in reducer.slots}, exchange)

    @classmethod
    def from_optimizer(
        cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer, **kwargs: Any
    ) -> ShardedOptimizer:
        """The sharded form of a plain ``optimizer`` over ``model``'s parameters: same class, groups,
        hyperparameters and state (``kwargs``: ``overlap``, ``exchange``, ``shard_gradients``)."""
        groups = [dict(g) for g in optimizer.param_groups]
        sharded = cls(model, type(optimizer), groups, **kwargs)
        if optimizer.state:
            sharded.load_state_dict(optimizer.state_dict())
        return sharded

    # ---- plugging into the reducer -----------------------------------------------------------------
    def _install(self, reducer, group_of_slot: dict[int, int], exchange: str) -> None:
        instance = next(_instances)
        self._instance, self._state_dict_calls = instance, itertools.count()
        tags = (1 << 30) + (instance % 1000) * _TAGS_PER_INSTANCE
        kind = ShardedGradientCollective if self.shard_gradients else ZeroCollective
        collective = kind(reducer, group_of_slot, exchange, tags, instance)
        reducer.install_bucket_collective(collective)  # refuses a comm hook or a second optimizer; builds the buckets
        self._collective, self._sharded = collective, collective.sharded
        self._inner = [
            self.optimizer_class(
                [{**_hyperparameters(self.param_groups[zb.group_index]), "params": [zb.shard_param]}],
                **self._ctor_kwargs,
            )
            for zb in self._sharded
        ]
        bucket_of = {id(slot.param): zb.index for zb in self._sharded for slot in zb.slots}
        self._gate = ParameterGate(self.model.module, bucket_of, self._wait_buckets)
        self._norms = ShardNorms(self._sharded, self._group, len(reducer.slots), tags + _TAGS_PER_INSTANCE // 2)
        self._sharded_param_ids = frozenset(id(slot.param) for zb in self._sharded for slot in zb.slots)
        register_torch_clip(self)  # torch.nn.utils.clip_grad_norm_ on these parameters: exact, or refused

    # ---- the training step ------------------------------------------------------------------------
    # torch.amp.GradScaler.step hands the step to the optimizer (``step(grad_scaler=...)``): a plain GradScaler
    # finds no .grad under ZeRO, so the shards are unscaled and checked here instead.
    _step_supports_amp_scaling = True

    def step(self, closure=None, grad_scaler=None):
        """One step of the wrapped optimizer on this rank's shard of every bucket, in the order the forward
        uses them, each followed by the asynchronous all-gather of the updated shard. ``grad_scaler``: passed by
        ``torch.amp.GradScaler.step``, which then needs no :class:`fastpar.ShardedGradScaler`."""
        if grad_scaler is not None:
            return self._scaled_step(grad_scaler, closure)
        return self._step(closure)

    def _scaled_step(self, scaler, closure):
        from torch.amp.grad_scaler import OptState

        from .grad_scaler import ShardedGradScaler

        state = scaler._per_optimizer_states[id(self)]
        if state["stage"] is OptState.READY:  # unscale the shards and agree on "found inf" over the group
            found_inf = torch.full((), 0.0, dtype=torch.float32, device=scaler._scale.device)
            inv_scale = scaler._scale.double().reciprocal().float()
            state["found_inf_per_device"] = ShardedGradScaler._unscale_grads_(scaler, self, inv_scale, found_inf, False)
            state["stage"] = OptState.UNSCALED
        if not state["found_inf_per_device"]:
            raise RuntimeError(
                "fastpar ZeRO: scaler.unscale_(optimizer) on a plain torch.amp.GradScaler found no gradients (under "
                "ShardedOptimizer they exist only as shards), so they are still scaled. Use "
                "fastpar.ShardedGradScaler, whose unscale_ unscales the shards, and ShardedOptimizer.clip_grad_norm_"
            )
        if sum(v.item() for v in state["found_inf_per_device"].values()):  # CPU-GPU sync point, as torch's
            return None
        return self._step(closure)

    @torch.no_grad()
    def _step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for zb, inner in zip(reversed(self._sharded), reversed(self._inner), strict=True):
            inner.param_groups[0].update(_hyperparameters(self.param_groups[zb.group_index]))  # LR schedules
            self._collective.wait_gather(zb)  # the last gather still reads this shard
            step_shard(zb, inner, self._collective.with_grad, self._elementwise_keys)  # no .grad: not stepped
            self._collective.start_gather(zb)
        if not self.overlap:
            self._collective.wait_all()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._collective.zero_grad(set_to_none)
        for zb in self._sharded:
            if set_to_none:
                zb.shard_param.grad = None
            elif zb.shard_param.grad is not None:
                zb.shard_param.grad.zero_()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.detach_().zero_()

    @property
    def stage(self) -> int:
        """The ZeRO stage: 1 (optimizer state sharded) or 2 (gradients too: ``shard_gradients=True``)."""
        return 2 if self.shard_gradients else 1

    @property
    def process_group(self):
        """The model's process group: every rank of it holds one shard of each bucket."""
        return self._group

    @property
    def device(self) -> torch.device:
        return self.model.reducer.device

    def shard_grads(self) -> list[torch.Tensor]:
        """This rank's gradient shards (what the next ``step()`` uses), one flat tensor per bucket that has one.
        Scale them in place to change the gradients (e.g. loss-scale unscaling: :class:`ShardedGradScaler`)."""
        return [zb.shard_param.grad for zb in self._sharded if zb.shard_param.grad is not None]

    def wait_for_params(self) -> None:
        """Wait until every updated parameter has arrived. Forward, ``state_dict()`` and ``load_state_dict()``
        do it themselves; call it before reading parameters anywhere else between ``step()`` and forward."""
        self._collective.wait_all()

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False, *, exact: bool = True
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` for the reduced gradients, which exist
        as shards; returns the total norm (inf/nan when a gradient is not finite; ``error_if_nonfinite=True``
        raises naming the parameters). ``exact=True``: torch's per-parameter norms, so the same bits as torch;
        ``exact=False``: one fused pass and one all-reduce of the squared norm (zero_clip.py says why both)."""
        if norm_type != 2.0:
            raise ValueError(
                f"ShardedOptimizer.clip_grad_norm_ computes the L2 norm; norm_type={norm_type} is not supported"
            )
        if exact:
            norms = self._norms.parameter_norms()
            unused = [i for zb in self._sharded for i in zb.unused]  # the same on every rank
            measured = norms
            if unused:  # torch's clip_grad_norm_ skips parameters without .grad: their 0 would change the bits
                used = torch.ones(len(norms), dtype=torch.bool)
                used[unused] = False
                measured = norms[used.to(norms.device)]
            total = torch.linalg.vector_norm(measured, 2)
            finite = torch.isfinite(total)
        else:
            total, finite = self._norms.fused_total()
        if error_if_nonfinite and not bool(finite):  # CPU-GPU sync point, only when asked to check
            norms = norms if exact else self._norms.parameter_norms()
            bad = [self.model.reducer.slots[i].name for i in torch.nonzero(~torch.isfinite(norms)).flatten().tolist()]
            raise RuntimeError(
                f"fastpar ZeRO: the total gradient norm is non-finite, so it cannot be clipped; parameters with "
                f"inf/nan gradients: {', '.join(bad[:10])}{' ...' if len(bad) > 10 else ''}. Lower the learning rate, "
                "or pass error_if_nonfinite=False to scale the gradients by the non-finite norm anyway (as torch does)"
            )
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        grads = [zb.shard_param.grad for zb in self._sharded if zb.shard_param.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coef)
        return total

    # ---- checkpoints ------------------------------------------------------------------------------
    def state_dict(self, to: int = 0) -> dict[str, Any]:
        """Collective (every rank calls it): the full state in a plain ``optimizer_class``'s format on rank
        ``to``, loadable by the plain optimizer or by a ShardedOptimizer on any number of ranks. The other
        ranks get the same ``param_groups`` and no state (a placeholder that ``load_state_dict`` refuses).
        Called on some ranks only, it raises :class:`~fastpar.zero.arrival.RankArrivalError` naming the others
        after ``$FASTPAR_ZERO_ARRIVAL_TIMEOUT_S`` (60 s) instead of waiting in the gather forever."""
        check_in(
            self._group,
            f"zero{self._instance}/state_dict/{next(self._state_dict_calls)}",
            arrival_timeout_s(pg_timeout_seconds(self._group, self.device)),
            "ShardedOptimizer.state_dict()",
            "Call opt.state_dict() on every rank (it gathers the shards onto rank `to`), then save on that rank "
            "only: sd = opt.state_dict(); if rank == 0: torch.save(sd, path)",
        )
        self.wait_for_params()
        full = gather_full_state(self._sharded, self._inner, self._elementwise_keys, self._index_of, self._group, to)
        groups = []
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = [self._index_of[id(p)] for p in group["params"]]
            groups.append(packed)
        if full is None:
            return {"state": {}, "param_groups": groups, _PLACEHOLDER: f"the full state was gathered on rank {to}"}
        return {"state": dict(sorted(full.items())), "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state (from :meth:`state_dict`, or from a plain optimizer of the same class over the same
        model) on every rank: each rank keeps its shard of it."""
        if _PLACEHOLDER in state_dict:
            raise ValueError(
                f"this state_dict holds no optimizer state ({state_dict[_PLACEHOLDER]}); load the one rank 0 saved "
                "(ShardedOptimizer.state_dict() returns the full state on that rank only)"
            )
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, self.param_groups, strict=False)
        ):
            raise ValueError(
                "loaded state dict has a different number of parameter groups or parameters per group than this "
                f"optimizer ({[len(s['params']) for s in saved_groups]} vs "
                f"{[len(g['params']) for g in self.param_groups]}); load the state of this model's optimizer"
            )
        self.wait_for_params()
        by_position = {}
        for saved, group in zip(saved_groups, self.param_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
            for saved_index, p in zip(saved["params"], group["params"], strict=True):
                if saved_index in state_dict["state"]:
                    by_position[self._index_of[id(p)]] = state_dict["state"][saved_index]
        for zb, inner in zip(self._sharded, self._inner, strict=True):
            shard, zb.shared_by_slot = shard_state(zb, by_position, self._elementwise_keys, self._index_of)
            inner_group = {**_hyperparameters(self.param_groups[zb.group_index]), "params": [0]}
            inner.load_state_dict({"state": {0: shard} if shard else {}, "param_groups": [inner_group]})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_sharded", None) is not None:
            raise NotImplementedError(
                "ShardedOptimizer lays its buckets out once, at construction; pass every param group to the "
                "constructor (params=[{...}, {...}])"
            )
        super().add_param_group(param_group)

    # ---- statistics and internals -----------------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (its shards' state)."""
        return sum(
            v.numel() * v.element_size()
            for inner in self._inner
            for s in inner.state.values()
            for v in s.values()
            if torch.is_tensor(v)
        )

    def memory_report(self) -> dict[str, int]:
        """This rank's bytes, measured from the tensors it holds now (each storage counted once, in the first
        category that holds it): ``"parameters"`` (the model's parameters), ``"gradients"`` (stage 1: the
        gradient buckets; stage 2: the gradient shards, the pool's full-size buffers and any temporary
        accumulation buffers; both: the point-to-point scratch and any ``.grad`` still held),
        ``"optimizer_state"`` (the wrapped optimizer's state tensors), ``"gradient_pool"`` (the part of
        ``"gradients"`` in the stage-2 pool; 0 at stage 1) and ``"total"``."""
        return measure_memory(self)

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors :meth:`memory_report` counts, by the same categories (a tensor may appear in two): what
        a memory tracker must know of before a step (``fastpar.shard.peak_memory``)."""
        return held_tensors(self)

    def _wait_buckets(self, indices) -> None:
        for i in indices:
            self._collective.wait_gather(self._sharded[i])


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}
