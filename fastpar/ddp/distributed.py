"""``fastpar.DistributedDataParallel``: torch's DDP, with fastpar's reducer inside.

It subclasses ``torch.nn.parallel.DistributedDataParallel`` and runs torch's own constructor, forward,
``no_sync``, join hooks, pickling and static-graph logic. Only the step where torch builds its C++
Reducer (``_ddp_init_helper``) is replaced: it builds :class:`fastpar.ddp.reducer.Reducer`, which offers
the C++ Reducer's methods, so torch's DDP -- and frameworks that call ``model.reducer`` -- drive it as
they drive torch's. What fastpar must still provide beside the reducer (a logger, the two comm-hook
registrations that go through C++) is overridden here and checked against the installed torch in tests.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel as _TorchDDP

from ..comm import shared_buffers
from . import _setup
from .buckets import default_caps
from .comm_hooks import builtin_hook
from .reducer import Reducer
from .torch_logger import DDPLogger

__all__ = ["DistributedDataParallel"]

_instances = itertools.count()  # same sequence on every rank: names this model's store keys


@dataclass(frozen=True)
class _Options:
    """fastpar's choices made at construction, read when the reducer is (re)built (also after unpickling)."""

    grad_dtype: torch.dtype | None
    alias_divides: bool  # the user asked for gradient_as_bucket_view=True: torch's in-place div_ arithmetic
    caps_given: bool  # bucket_cap_mb or bucket_cap_mb_list was passed
    auto_buckets: bool = False  # bucket_cap_mb="auto": fastpar measures and chooses the layout


class DistributedDataParallel(_TorchDDP):
    """Drop-in for ``torch.nn.parallel.DistributedDataParallel``: same arguments, same numbers.

    Differences: ``gradient_as_bucket_view`` defaults to ``None``, which keeps gradients in the flat bucket
    buffers (no copies) with the arithmetic of torch's default ``False``; pass ``False`` for separate
    ``.grad`` tensors, ``True`` for exactly torch's ``True``. fastpar's keyword-only ``grad_dtype``
    (``torch.bfloat16``/``torch.float16``) reduces fp32 gradients in that precision. ``bucket_cap_mb="auto"``
    lets fastpar choose the bucket layout from measurements of the first steps (``fastpar.ddp.auto_buckets``;
    at world size > 2 the results then differ from torch's in the last bits); registering a comm hook other than
    torch's stateless default hooks stops it with the layout then in use (PowerSGD keeps state per bucket index).
    ``comm_stats()`` reports the last step's communication.
    """

    def __init__(
        self,
        module,
        device_ids=None,
        output_device=None,
        dim=0,
        broadcast_buffers=None,
        init_sync=True,
        process_group=None,
        bucket_cap_mb=None,
        find_unused_parameters=False,
        check_reduction=False,
        gradient_as_bucket_view=None,
        static_graph=False,
        delay_all_reduce_named_params=None,
        param_to_hook_all_reduce=None,
        mixed_precision=None,
        device_mesh=None,
        skip_all_reduce_unused_params=False,
        bucket_cap_mb_list=None,
        batched_grad_copy=False,
        forward_sync_buffers=None,
        *,
        grad_dtype: torch.dtype | None = None,
    ):
        _setup.refuse_unsupported(mixed_precision, skip_all_reduce_unused_params)
        _setup.check_grad_dtype(grad_dtype)
        auto_buckets = _setup.is_auto_cap(bucket_cap_mb, bucket_cap_mb_list)
        if auto_buckets:
            bucket_cap_mb = None  # torch's constructor sees its default; fastpar starts from its own caps
        # read by _ddp_init_helper, which torch's constructor calls; plain attributes may precede Module.__init__
        self.__dict__["_fastpar"] = _Options(
            grad_dtype=grad_dtype if grad_dtype not in (None, torch.float32) else None,
            alias_divides=gradient_as_bucket_view is not None and bool(gradient_as_bucket_view),
            caps_given=bucket_cap_mb is not None or bool(bucket_cap_mb_list),
            auto_buckets=auto_buckets,
        )
        if init_sync:  # before torch's own check, for a message that names the parameter
            _setup.verify_shapes_across_ranks(
                _setup.resolve_group(process_group, device_mesh), module, delay_all_reduce_named_params
            )
        kwargs = _setup.parent_kwargs(
            device_ids=device_ids,
            output_device=output_device,
            dim=dim,
            broadcast_buffers=broadcast_buffers,
            init_sync=init_sync,
            process_group=process_group,
            bucket_cap_mb=bucket_cap_mb,
            find_unused_parameters=find_unused_parameters,
            check_reduction=check_reduction,
            gradient_as_bucket_view=True if gradient_as_bucket_view is None else bool(gradient_as_bucket_view),
            static_graph=static_graph,
            delay_all_reduce_named_params=delay_all_reduce_named_params,
            param_to_hook_all_reduce=param_to_hook_all_reduce,
            device_mesh=device_mesh,
            bucket_cap_mb_list=bucket_cap_mb_list,
            batched_grad_copy=batched_grad_copy,
            forward_sync_buffers=forward_sync_buffers,
        )
        super().__init__(module, **kwargs)

    # ---- the one step torch's constructor (and unpickling) delegates: build the reducer -----------
    def _ddp_init_helper(self, parameters, expect_sparse_gradient, param_to_name_mapping, static_graph):
        options: _Options = self._fastpar
        names = _setup.check_parameters(self.module, parameters, expect_sparse_gradient)
        world_size = self.process_group.size()
        caps, initial_caps = _setup.bucket_caps(self, parameters, static_graph, world_size)
        private_caps = None  # the caps for buckets that stay in private memory, where they differ from ``caps``
        if not options.caps_given:  # fastpar's layout where it cannot change the bits
            on_cpu = bool(parameters) and parameters[0].device.type == "cpu"
            shared = on_cpu and shared_buffers.available(self.process_group)
            default = default_caps(parameters, world_size, shared_buckets=shared)
            initial_caps = initial_caps if initial_caps != caps else default
            caps = default
            private = default_caps(parameters, world_size) if shared else default
            private_caps = private if private != default else None
        self.reducer = Reducer(
            parameters,
            names,
            self.process_group,
            caps=caps,
            initial_caps=initial_caps,
            grad_views=self.gradient_as_bucket_view,
            grad_dtype=options.grad_dtype,
            find_unused=self.find_unused_parameters,
            alias_divides=options.alias_divides,
            instance_id=next(_instances),
            auto_buckets=options.auto_buckets,
            private_caps=private_caps,
        )
        self.logger = DDPLogger(self, self.reducer)
        self.reducer.set_logger(self.logger)
        has_sync_bn = any(isinstance(m, torch.nn.SyncBatchNorm) for m in self.module.modules())
        self.logger.set_construction_data_and_log(
            type(self.module).__name__,
            [] if self.device_ids is None else self.device_ids,
            -1 if self.output_device is None else self.output_device,
            self.forward_sync_buffers if hasattr(self, "forward_sync_buffers") else self.broadcast_buffers,
            has_sync_bn,
            static_graph,
        )
        self._passing_sync_batchnorm_handle(self.module)

    # ---- static graph: the first reducing backward learns the graph --------------------------------
    def _post_forward(self, output):
        # torch queues the static graph's first reduction from the backward of the first forward only. When that
        # backward runs under no_sync() (gradient accumulation), nothing is reduced and nothing learned: re-arm
        # it for each forward until a reducing backward has learned the graph.
        if self.static_graph and self.reducer._static_first():
            self._static_graph_delay_allreduce_enqueued = False
        return super()._post_forward(output)

    # ---- comm hooks: torch registers them through C++, which needs its own Reducer ---------------
    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """Reduce each bucket with ``hook(state, bucket) -> Future[Tensor]`` (torch's hook contract: the
        bucket's buffer is not divided by the world size; the hook averages)."""
        self._check_comm_hook(hook)
        self.logger._set_comm_hook_name(hook.__qualname__)
        self.reducer.register_comm_hook(state, hook)
        self._comm_hooks.append((hook, state))

    def _register_builtin_comm_hook(self, comm_hook_type) -> None:
        self.logger._set_comm_hook_name(str(comm_hook_type))
        self.reducer.register_comm_hook(self.process_group, builtin_hook(comm_hook_type))

    # ---- fastpar additions ------------------------------------------------------------------------
    def comm_stats(self) -> dict:
        """Of the last synchronised backward: ``bytes`` reduced, ``collectives`` issued, ``wait_s`` spent
        waiting for communication after backward (not hidden by overlap; on GPU the time the compute stream
        stalled, read from CUDA events), ``buckets``, ``step``, ``finished_early`` (buckets finished during backward)
        and ``hot_path``: ``"extension"`` when the per-gradient hooks ran in fastpar's C++ extension, else
        ``"python"`` (see :mod:`fastpar.ddp.extension_hooks`)."""
        return self.reducer.stats()
