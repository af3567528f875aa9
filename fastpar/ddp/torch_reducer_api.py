"""torch's C++ Reducer interface, as torch's DistributedDataParallel and frameworks call it (``model.reducer``).

Each method does what torch's reducer does at that call, in terms of the reducer's own state; the ones fastpar does
not support raise a message naming what to use instead. A mixin of :class:`fastpar.ddp.reducer.Reducer`.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..comm import shared_buffers
from ._weak_hooks import call_weakly
from .backward_state import BackwardState
from .comm_hooks import GradBucket, keeps_no_bucket_state
from .errors import (
    pg_timeout_seconds,
)
from .torch_logger import should_collect_runtime_stats
from .waiting import BucketWaiter


class TorchReducerApi:
    """torch's Reducer methods, on the state of :class:`~fastpar.ddp.reducer.Reducer`."""

    @torch._disable_dynamo  # called from DDP.forward: opaque to torch.compile, as torch's C++ reducer
    def prepare_for_forward(self) -> None:
        self._check_health()
        self.num_iterations += 1
        self._sampled = should_collect_runtime_stats(self.num_iterations, self.runtime_sample_rate)
        if self._sampled:
            self.runtime_timer.record("forward_start")
        if self.auto is not None:
            self._recorder = self.auto.forward_started()

    @torch._disable_dynamo  # called from DDP.forward: opaque to torch.compile, as torch's C++ reducer
    def prepare_for_backward(self, outputs: Sequence[torch.Tensor] = ()) -> None:
        """The coming backward reduces gradients. ``outputs``: the forward's tensors, searched for unused
        parameters when ``find_unused_parameters`` is set (torch passes them; ``[]`` otherwise)."""
        if self._backward.started:
            return  # a forward inside a running backward (e.g. checkpointing the whole wrapper): keep its state
        self._check_health()
        self._backward.to(BackwardState.ARMED)
        self.buckets_reduced = 0
        if self._sampled:
            self.runtime_timer.record("backward_compute_start")
            self.grad_ready_order = []
        self._remove_outputs_hook()
        if self._dynamic_find():
            tensors = [t for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:  # fires in the backward that starts from these outputs, before any parameter's hook
                search = weakref.WeakMethod(self._search_unused)
                self._outputs_hook = torch.autograd.graph.register_multi_grad_hook(
                    tensors, functools.partial(call_weakly, search, None), mode="any"
                )
        if self._hooks_in_extension():
            self._arm_native()

    @torch._disable_dynamo  # called from DDP.forward: opaque to torch.compile, as torch's C++ reducer
    def _rebuild_buckets(self) -> bool:
        """Once, before the forward after the first reducing backward: re-bucket in the order gradients
        arrived on rank 0 (broadcast, so every rank agrees). True when it rebuilt. With
        ``bucket_cap_mb="auto"`` also where its decisions are taken (every rank at the same forward)."""
        rebuilt = self._rebuild_in_arrival_order()
        if self.auto is not None and self.auto.due:
            self._check_health()
            self.auto.decide(self)
        if self._share_pending and rebuilt:  # torch's rebuild is collective: the buffers are made with it
            self._share_buckets()
        return rebuilt

    def _set_static_graph(self) -> None:
        if self.num_iterations or self.num_backwards:
            self._fail(
                RuntimeError(
                    "fastpar DDP: set_static_graph() should be called before training loop starts and after "
                    "DistributedDataParallel is constructed; pass static_graph=True to DistributedDataParallel"
                )
            )
        self.static_graph = True

    def _delay_all_reduce(self) -> None:
        """Static graph, end of the first iteration (queued by torch's DDP on the outermost backward):
        learn how often each hook fires and which parameters are unused, then reduce everything at once."""
        if not self._backward.expecting:
            return
        if not self._backward.started:
            self._start_backward()
        if self._sampled:
            self.runtime_timer.record("backward_compute_end")
        self._launch_used_map()
        self.unused_parameters = [s.index for s in self.slots if s.fires == 0]
        for slot in self.slots:
            slot.expected_fires = slot.fires  # 0: unused on this rank from now on
            slot.ready = True
        for bucket in self.buckets:
            bucket.pending = 0
        self._static_learned = True
        self._launch_ready(queue_finalize=False)
        self.buckets_reduced = 0  # torch reduces them all at once here, uncounted
        self._finalize()

    @torch._disable_dynamo  # called from DDP.forward: opaque to torch.compile, as torch's C++ reducer
    def _set_forward_pass_work_handle(self, work, divide_by_initial_world_size: bool) -> None:
        self._join = (work, divide_by_initial_world_size)
        if self.auto is not None:  # joined ranks stop counting steps: keep the layout as it is
            self.auto.freeze(self, "join(): uneven inputs")

    def _get_local_used_map(self) -> torch.Tensor:
        """What a joined rank contributes to the used-map all-reduce of a shadowed step: the map of this rank's last
        reducing backward, as all-reduced then (torch's ``local_used_map_dev_``; the shadow all-reduce updates it in
        place, as torch's does). Parameters any rank used then count as used, so they get a zero gradient."""
        return self._used_map

    def _get_zeros_like_grad_buckets(self) -> list[GradBucket]:
        if self.bucket_collective is not None:
            raise NotImplementedError(
                "fastpar DDP: model.join() (uneven inputs) cannot shadow ZeRO's reduce-scatter; give every rank the "
                "same number of batches (fastpar.data loaders do), or use a plain optimizer with join()"
            )
        last = len(self.buckets) - 1
        return [GradBucket(b, torch.zeros_like(b.comm_flat), b.index == last) for b in self.buckets]

    def _run_comm_hook(self, bucket: GradBucket):
        if self.comm_hook is not None:
            hook, state = self.comm_hook
            return hook(state, bucket)
        return self._run_allreduce_hook(bucket)

    def _run_allreduce_hook(self, bucket: GradBucket):
        return dist.all_reduce(bucket.buffer(), group=self.group, async_op=True).get_future()

    def register_comm_hook(self, state, hook) -> None:
        if self.comm_hook is not None:  # torch's own message
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        self._refuse_second_replacement("register a comm hook")
        self.comm_hook = (hook, state)
        if self.auto is not None and not keeps_no_bucket_state(hook):
            self.auto.freeze(self, "a comm hook was registered: it may keep state per bucket index (PowerSGD)")

    def _check_reducer_finalized(self) -> None:
        self._check_health()

    def _remove_autograd_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._native is not None:
            self._native.remove_hooks()
            self._native = self._native_layout = None
        self._remove_outputs_hook()

    def _reset_state(self) -> None:
        self._end_backward()
        self.has_rebuilt, self.rebuild_order = False, []

    def _update_process_group(self, group: dist.ProcessGroup) -> None:
        self._reset_state()
        self.group, self.world_size = group, group.size()
        self._comm_alloc = shared_buffers.bucket_allocator(group, self.device)  # see Reducer._share_buckets
        self._share_pending = self._comm_alloc is not None
        if self._native is not None:  # its collectives go to the new group
            self._native.remove_hooks()
            self._attach_hooks()
        self.waiter = BucketWaiter(self.device, pg_timeout_seconds(group, self.device), self.waiter._diagnose)

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        self.runtime_sample_rate = sample_rate

    def set_logger(self, logger) -> None:
        self.logger = logger

    def _autograd_hook(self, index: int) -> None:
        self._on_grad(index, self.slots[index].param)

    def _set_mixed_precision_param_dtype(self, dtype) -> None:
        raise NotImplementedError("fastpar DDP does not support torch's mixed_precision config; use grad_dtype")

    def _set_optimizer_in_backward(self) -> None:
        raise NotImplementedError("fastpar DDP does not support optimizers in backward; call optimizer.step()")

    def _install_post_backward_futures(self, futures) -> None:
        raise NotImplementedError("fastpar DDP does not support optimizers in backward; call optimizer.step()")

    def _set_sparse_metadata(self, global_unique_ids) -> None:
        raise NotImplementedError("fastpar DDP does not reduce sparse gradients")

    def _push_all_rebuilt_params(self) -> None:
        """A joined rank: rebuild as if every parameter had arrived, in index order (torch's semantics)."""
        self.rebuild_order = list(range(len(self.slots)))
        if self.auto is not None:
            self.auto.freeze(self, "join(): uneven inputs")
