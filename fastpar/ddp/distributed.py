"""``fastpar.DistributedDataParallel``: torch's DDP constructor and behaviour, fastpar's reducer.

It subclasses ``torch.nn.parallel.DistributedDataParallel`` so ``isinstance`` checks in frameworks
and torch.compile hold, but never runs its ``__init__`` (no C++ Reducer): every method of the parent
that would reach ``self.reducer`` is overridden here.
"""

from __future__ import annotations

import itertools
import sys
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.distributed.distributed_c10d import _get_default_group
from torch.distributed.utils import _sync_module_states, _to_kwargs
from torch.nn.parallel import DistributedDataParallel as _TorchDDP

from . import _setup
from .buckets import auto_caps
from .comm_hooks import builtin_hook, check_comm_hook
from .join import FastparJoinHook
from .reducer import Reducer

__all__ = ["DistributedDataParallel"]

_instances = itertools.count()  # same sequence on every rank: names this model's store keys


class DistributedDataParallel(_TorchDDP):
    """Drop-in for ``torch.nn.parallel.DistributedDataParallel`` (same arguments, same numbers).

    Differences: ``gradient_as_bucket_view`` defaults to ``None`` = True (gradients live in the flat
    bucket buffers; pass False for separate ``.grad`` tensors), and fastpar's own keyword-only option
    ``grad_dtype`` (``torch.bfloat16``/``torch.float16``) reduces fp32 gradients in that precision.
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
        torch.nn.Module.__init__(self)  # not _TorchDDP.__init__: that builds the C++ reducer
        Joinable.__init__(self)
        _setup.refuse_unsupported(
            delay_all_reduce_named_params, param_to_hook_all_reduce, mixed_precision, skip_all_reduce_unused_params
        )
        _setup.check_grad_dtype(grad_dtype)
        self._use_python_reducer = False
        self.logger = None
        self._delay_all_reduce_all_params = False
        self._delay_all_reduce_params = []
        self._delay_grad_buffer = None
        self.mixed_precision = None
        if process_group is not None and device_mesh is not None:
            raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
        if device_mesh is not None:
            if device_mesh.ndim != 1:
                raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
            self.device_mesh = device_mesh
            process_group = device_mesh.get_group(mesh_dim=0)
        self.process_group = process_group if process_group is not None else _get_default_group()
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        params, names = _setup.params_to_reduce(module, self.parameters_to_ignore)
        self._module_parameters = params
        self.device_ids, self.output_device, self.device = _setup.resolve_devices(params, device_ids, output_device)
        self.device_type = self.device.type
        self.is_multi_device_module = False
        self.module = module
        self.dim = dim
        self.static_graph = False
        if broadcast_buffers is not None and forward_sync_buffers is not None:
            warnings.warn(
                "Both `broadcast_buffers` and `forward_sync_buffers` were specified; `broadcast_buffers` is ignored.",
                FutureWarning,
                stacklevel=2,
            )
        if forward_sync_buffers is not None:
            self.forward_sync_buffers, init_sync_buffers = forward_sync_buffers, True
        else:
            self.forward_sync_buffers = init_sync_buffers = broadcast_buffers if broadcast_buffers is not None else True
        self.find_unused_parameters = find_unused_parameters
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.gradient_as_bucket_view = True if gradient_as_bucket_view is None else bool(gradient_as_bucket_view)
        self.batched_grad_copy = batched_grad_copy  # fastpar always copies a bucket in one batched call
        self.grad_dtype = grad_dtype
        if check_reduction:
            warnings.warn(
                "The `check_reduction` argument in `DistributedDataParallel` module is deprecated. Please avoid "
                "using it.",
                FutureWarning,
                stacklevel=2,
            )
        self.broadcast_bucket_size = 250 * 1024 * 1024
        caps, self.bucket_bytes_cap = _setup.bucket_caps(bucket_cap_mb, bucket_cap_mb_list)
        self.bucket_bytes_cap_list = caps if bucket_cap_mb_list else []
        self.bucket_bytes_cap_default = bucket_cap_mb is None and not bucket_cap_mb_list
        if self.bucket_bytes_cap_default:
            caps = auto_caps(params, self.process_group.size())  # a user-given cap is always honoured
        self.skip_all_reduce_unused_params = False
        self.use_side_stream_for_tensor_copies = True
        self._assign_modules_buffers()
        if init_sync:
            _setup.verify_shapes_across_ranks(self.process_group, names, params)
            _sync_module_states(
                module=self.module,
                process_group=self.process_group,
                broadcast_bucket_size=self.broadcast_bucket_size,
                src=0,
                params_and_buffers_to_ignore=self.parameters_to_ignore,
                broadcast_buffers=init_sync_buffers,
            )
        if any(isinstance(m, torch.nn.SyncBatchNorm) for m in module.modules()) and self.device_type == "cpu":
            raise ValueError("SyncBatchNorm layers only work with GPU modules")
        rebuild = static_graph or not find_unused_parameters
        self._reducer = Reducer(
            params,
            names,
            self.process_group,
            caps=caps,
            # torch's first layout: one bucket per dtype until the real gradient order is known (it is
            # rebuilt after the first backward), else the caps
            initial_caps=[sys.maxsize] if rebuild and not bucket_cap_mb_list else caps,
            grad_views=self.gradient_as_bucket_view,
            grad_dtype=grad_dtype if grad_dtype not in (None, torch.float32) else None,
            tolerate_unused=find_unused_parameters or static_graph,
            rebuild=rebuild,
            instance_id=next(_instances),
        )
        self._comm_hooks: list[tuple[Callable, object]] = []
        self._has_rebuilt_buckets = False
        self._setup_in_backward_optimizers()
        self._lazy_init_ran = True
        self._accum_grad_hooks = []
        self._ddp_sink_clone = True
        self._static_graph_delay_allreduce_enqueued = False
        if static_graph:
            self._set_static_graph()

    # ---- forward -------------------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        inputs, kwargs = self._pre_forward(*inputs, **kwargs)
        output = self._run_ddp_forward(*inputs, **kwargs)  # marks this DDP active for dynamo's DDPOptimizer
        return self._post_forward(output)

    @torch._disable_dynamo
    def _pre_forward(self, *inputs, **kwargs):
        work = Join.notify_join_context(self)
        if work is not None:
            self._reducer.join_divisor = (work, self._divide_by_initial_world_size)
        if torch.is_grad_enabled() and self._reducer.maybe_rebuild():
            self._has_rebuilt_buckets = True
        if self._check_sync_bufs_pre_fwd():
            self._sync_buffers()
        if self._join_config.enable:
            self._check_global_requires_backward_grad_sync(is_joined_rank=False)
        if self.device_ids:
            device = torch.device(self.device_type, self.device_ids[0])
            moved_inputs, moved_kwargs = _to_kwargs(inputs, kwargs, device, self.use_side_stream_for_tensor_copies)
            return moved_inputs[0], moved_kwargs[0]
        return inputs, kwargs

    @torch._disable_dynamo
    def _post_forward(self, output):
        if torch.is_grad_enabled():
            sync = self.require_backward_grad_sync
            self.require_forward_param_sync = sync
            self._reducer.prepare_for_backward(sync)
        else:
            self.require_forward_param_sync = False
        return output

    # ---- communication hooks, static graph, join ---------------------------------------------
    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """Reduce each bucket with ``hook(state, bucket) -> Future[Tensor]`` (torch's hook contract:
        the bucket's buffer is not divided by the world size; the hook averages)."""
        check_comm_hook(hook)
        if self._comm_hooks:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        if self._reducer.step > 0:
            raise RuntimeError("register_comm_hook must be called before the first backward pass")
        self._comm_hooks.append((hook, state))
        self._reducer.comm_hook = (hook, state)

    def _register_builtin_comm_hook(self, comm_hook_type):
        self.register_comm_hook(self.process_group, builtin_hook(comm_hook_type))

    def _set_static_graph(self):
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.", stacklevel=2)
            return
        self.static_graph = True
        self._reducer.tolerate_unused = True
        if self.find_unused_parameters:
            warnings.warn(
                "You passed find_unused_parameters=true to DistributedDataParallel, `_set_static_graph` will "
                "detect unused parameters automatically, so you do not need to set find_unused_parameters=true.",
                stacklevel=2,
            )

    def join_hook(self, **kwargs) -> JoinHook:
        return FastparJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    # ---- fastpar additions ---------------------------------------------------------------------
    def comm_stats(self) -> dict:
        """Of the last synchronised backward: ``bytes`` reduced, ``collectives`` issued, ``wait_s`` spent
        waiting for communication after backward (not hidden by overlap), ``buckets``, ``step``."""
        return dict(self._reducer.last_stats)

    @property
    def reducer(self):
        raise AttributeError(
            "fastpar.DistributedDataParallel has no C++ reducer; use comm_stats() for statistics and the public "
            "DDP methods (no_sync, register_comm_hook, join) for control"
        )

    # ---- parent methods that would reach the C++ reducer -------------------------------------
    def _get_ddp_logging_data(self):
        return {
            "module_name": type(self.module).__name__,
            "backend_name": dist.get_backend(self.process_group),
            "world_size": self.process_group.size(),
            "bucket_cap_bytes": self.bucket_bytes_cap,
            "find_unused_parameters": int(self.find_unused_parameters),
            "gradient_as_bucket_view": int(self.gradient_as_bucket_view),
            "static_graph": int(self.static_graph),
            "num_buckets": len(self._reducer.buckets),
            "comm_hook": self._comm_hooks[0][0].__qualname__ if self._comm_hooks else "",
            "grad_dtype": str(self.grad_dtype),
        }

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate):
        if sample_rate < 1:
            raise ValueError("DDP runtime logging sample rate should be equal or greater than 1")

    def _remove_autograd_hooks(self):
        self._reducer.remove_hooks()

    def _check_reducer_finalized(self):
        if self._reducer._callback_queued:
            raise RuntimeError("fastpar DDP: the last backward pass has not finished reducing gradients")

    def _register_buffer_comm_hook(self, state, hook, comm_hook_location=None):
        raise NotImplementedError("fastpar DDP does not support buffer comm hooks; buffers are broadcast from rank 0")

    def _register_fused_optim(self, optim, *args, optim_params=None, **kwargs):
        raise NotImplementedError("fastpar DDP does not support fused optimizers in backward; call optimizer.step()")

    def _set_sparse_metadata(self, global_unique_ids):
        raise NotImplementedError("fastpar DDP does not reduce sparse gradients")

    def _update_process_group(self, new_process_group):
        raise NotImplementedError("fastpar DDP cannot change its process group; wrap the module again instead")

    def _match_all_reduce_for_bwd_pass(self):
        self._reducer.shadow_backward(used_map=False)

    def _match_unused_params_allreduce(self):
        self._reducer.shadow_used_map()

    def _setup_in_backward_optimizers(self):
        if any(hasattr(p, "_in_backward_optimizers") for p in self._module_parameters):
            raise NotImplementedError(
                "fastpar DDP does not support _apply_optimizer_in_backward; call optimizer.step()"
            )

    def _ddp_init_helper(self, *args, **kwargs):
        raise NotImplementedError("fastpar DDP builds its own reducer; construct fastpar.DistributedDataParallel")

    def _fire_reducer_autograd_hook(self, idx, *unused):
        raise NotImplementedError("fastpar DDP has no python_reducer mode; its hooks are always registered")

    def __setstate__(self, state):
        raise TypeError("fastpar.DistributedDataParallel cannot be unpickled; wrap a new module instead")

    def __getstate__(self):
        self._check_default_group()
        raise TypeError(
            "fastpar.DistributedDataParallel cannot be pickled or deep-copied; save model.module.state_dict() "
            "(or model.state_dict()) and wrap a new module instead"
        )
