"""fastpar's gradient reducer, behind the interface of torch's C++ Reducer.

torch's DistributedDataParallel drives it exactly as it drives its own reducer (``prepare_for_forward`` /
``prepare_for_backward`` from forward, ``_rebuild_buckets``, ``_delay_all_reduce`` for a static graph,
the join hooks), and frameworks reach the same methods through ``model.reducer``.

One synchronised backward: each parameter's post-accumulate-grad hook marks its slot ready; a complete
bucket is staged (``gradient_path.stage``) and its collective starts asynchronously -- strictly in bucket
order, so every rank issues the same collectives in the same order. Unused parameters are marked ready
up front: from the autograd graph (``find_unused_parameters``) or from the first iteration
(``static_graph``). Buckets whose collectives are already back are finished from the hooks, in order,
while later ones are still on the wire (``pipeline.FinishQueue``; only once nothing can change their
gradients). After the last launch the end of backward is queued; it runs named steps: wait for each
remaining bucket (a deadline that names missing ranks), finish it into ``.grad``, record statistics, learn.

Where the hooks run (:mod:`fastpar.ddp.hot_path`): with the compiled extension they are C++ hooks, and in the
common mode (:meth:`Reducer._hot_path_in_extension`) marking ready, bucket bookkeeping and launches run in C++
(``fastpar._C.GradReady``), which calls back once per backward (``_native_started``) and once per launch
(``_native_launched``); otherwise, and without the extension, each gradient goes through :meth:`Reducer._on_grad`.

What replaces each bucket's all-reduce -- a comm hook (torch's ``register_comm_hook``) or a
:class:`~fastpar.ddp.bucket_collective.BucketCollective` (ZeRO's reduce-scatter) -- is installed here, by
:meth:`Reducer.register_comm_hook` or :meth:`Reducer.install_bucket_collective`; the two exclude each other
and that rule lives in :meth:`Reducer._refuse_second_replacement`. A collective brings its own buckets and
keeps them (at the rebuild it learns torch's layout instead); its buckets are finished at the end of
backward, not early. ``bucket_cap_mb="auto"`` drives the reducer through :class:`~fastpar.ddp.auto_buckets.
AutoBucketsHost` (``layout``, ``apply_layout``, ``rebuild_pending``, ``stop_recording``).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..comm import shared_buffers
from . import gradient_path, hot_path
from .auto_buckets import AutoBuckets
from .bucket_collective import BucketCollective
from .buckets import ParamSlot, assign_buckets, build_buckets, initial_layout
from .comm_hooks import GradBucket, keeps_no_bucket_state
from .errors import StuckBucketDiagnoser, UnusedParametersError, pg_timeout_seconds
from .pipeline import FinishQueue
from .torch_logger import DEFAULT_SAMPLE_RATE, RuntimeTimer, should_collect_runtime_stats
from .waiting import BucketWaiter, WaitTimer

_queue_callback = torch.autograd.Variable._execution_engine.queue_callback
_current_node = getattr(torch._C, "_current_autograd_node", lambda: None)
_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)
# CPU: gradients copied into their bucket while hot in cache, from this size. The Python hook pays a dispatch per
# copy, worth it from 1 MiB of fp32; the extension's hook copies with no dispatch, so every gradient.
_COPY_ON_ARRIVAL_MIN_NUMEL = {"python": 1 << 18, "extension": 0}
_NOT_TIMED = contextlib.nullcontext()


def _shared_buckets(group, device: torch.device):
    """How buckets get their communication buffers: in memory every rank maps, on fastpar's backend on shared
    memory (its all-reduce then stages nothing: :mod:`fastpar.comm.shared_buffers`); else None (private memory)."""
    if device.type != "cpu" or not shared_buffers.available(group):
        return None
    return functools.partial(shared_buffers.carve, group=group)


class Reducer:
    def __init__(
        self,
        params: Sequence[torch.Tensor],
        names: Sequence[str],
        group: dist.ProcessGroup,
        *,
        caps: list[int],
        initial_caps: list[int],
        grad_views: bool,
        grad_dtype: torch.dtype | None,
        find_unused: bool,
        alias_divides: bool,
        instance_id: int,
        auto_buckets: bool = False,
        private_caps: list[int] | None = None,
    ) -> None:
        self.group, self.world_size = group, group.size()
        self.device = params[0].device
        self.slots = [ParamSlot(i, name, p) for i, (name, p) in enumerate(zip(names, params, strict=True))]
        self.caps = caps  # for the rebuild
        # fastpar's default caps for buckets in private memory, where ``caps`` were chosen for shared ones: a bucket
        # collective (ZeRO) keeps its buckets private, and ZeRO-2's pool holds buffers the size of the largest bucket
        self._private_caps = private_caps
        self.grad_views, self.grad_dtype = grad_views, grad_dtype
        self.find_unused = find_unused
        self.alias_divides = alias_divides  # torch's arithmetic for gradient_as_bucket_view=True: div_ in place
        self.static_graph = False
        self.comm_hook: tuple | None = None  # (hook, state)
        self.bucket_collective: BucketCollective | None = None  # set only by install_bucket_collective
        self._comm_alloc = _shared_buckets(group, self.device)
        self._share_pending = self._comm_alloc is not None  # private until the first forward: _share_buckets
        self.buckets = build_buckets(self.slots, initial_layout(params, initial_caps), grad_views, grad_dtype)
        diagnoser = StuckBucketDiagnoser(group, instance_id)
        self.waiter = BucketWaiter(self.device, pg_timeout_seconds(group, self.device), diagnoser.diagnose)
        self.timer = WaitTimer(self.device)
        with torch.enable_grad():  # the AccumulateGrad nodes, kept alive as torch's reducer keeps them
            for slot in self.slots:
                slot.acc = slot.param.view_as(slot.param).grad_fn.next_functions[0][0]
        self._handles: list = []
        self._native = None  # fastpar._C.GradReady: the hooks in C++ (hot_path.py), else Python hooks
        self._attach_hooks()
        hooks = "python" if self._native is None else "extension"
        self.set_copy_on_arrival(_COPY_ON_ARRIVAL_MIN_NUMEL[hooks] if self.device.type == "cpu" else None)
        # torch Reducer counters and learned state
        self.num_iterations = 0
        self.num_backwards = 0
        self.has_rebuilt = False
        self.rebuild_order: list[int] = []
        self._static_learned = False
        self._static_unused: frozenset[int] = frozenset()  # globally unused, learned in the first iteration
        self._join: tuple | None = None  # (work, divide_by_initial_world_size) from Join
        self._under_join = False  # the running backward is one of join()'s (other ranks may shadow it)
        self.logger = None
        # what torch's logger reads: which parameters were unused (the graph search's, or the static graph's), whether
        # that set stayed the same, the arrival order and the timer of a sampled iteration
        self.unused_parameters: list[int] = []
        self.graph_static = True
        self.grad_ready_order: list[int] = []
        self.buckets_reduced = 0  # launched as they became ready in the last reducing backward (torch's count)
        self.runtime_timer = RuntimeTimer(self.device)
        self.runtime_sample_rate = DEFAULT_SAMPLE_RATE
        self._sampled = False  # this iteration's runtime statistics are recorded
        self._used_map = torch.zeros(len(self.slots), dtype=torch.int32, device=self.device)  # see _get_local_used_map
        self.step = 0
        self.last_stats = {"step": 0, "bytes": 0, "collectives": 0, "wait_s": 0.0, "buckets": len(self.buckets)}
        self.last_stats.update(finished_early=0, hot_path="python")
        # per backward
        self.expect_hooks = False
        self._started = self._finalize_queued = self._end_check_queued = self._searched = False
        self._next = 0
        self._scale, self._divisor = 1.0 / self.world_size, self.world_size
        self._used_work: tuple | None = None
        self._globally_unused: frozenset[int] | None = None
        self._outputs_hook = None
        self._bytes = 0
        self._native_layout: list | None = None  # the bucket list the extension was last given
        self._native_armed = self._native_pulled = False
        self.finishing = FinishQueue()  # buckets finished so far this backward, in order
        self.auto = AutoBuckets(self.device) if auto_buckets else None  # bucket_cap_mb="auto"
        self._recorder = None  # a StepRecorder while "auto" measures this step

    def set_copy_on_arrival(self, min_numel: int | None) -> None:
        """Copy fresh gradients of at least ``min_numel`` elements into their bucket as they arrive (view mode;
        None: never). On CPU a gradient copied while hot in cache, and freed at once, is measurably faster."""
        self._arrival_min = min_numel if self.grad_views else None

    # ---- what torch's DDP and frameworks call (torch's Reducer interface) ----------------------
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
        if self._started:
            return  # a forward inside a running backward (e.g. checkpointing the whole wrapper): keep its state
        self._check_health()
        self.expect_hooks = True
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
                    tensors, functools.partial(_hook, search, None), mode="any"
                )
        if self._hot_path_in_extension():
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
        if self._share_pending:
            self._share_buckets()
        return rebuilt

    def _share_buckets(self) -> None:
        """Move the buckets into shared memory (the same layout; .grad views move along). At the first forward
        with grad, a point every rank passes together (torch rebuilds its buckets there, and a joined rank's join
        hook calls it too), not at construction: a model unpickled or deep-copied on one rank alone must not wait
        for the others."""
        self._share_pending = False
        if self.bucket_collective is None:
            self.buckets = build_buckets(
                self.slots, self.layout(), self.grad_views, self.grad_dtype, comm_alloc=self._comm_alloc
            )

    def _rebuild_in_arrival_order(self) -> bool:
        if not self._should_rebuild() or not self.rebuild_order:
            return False
        self._check_health()
        seen = set(self.rebuild_order)
        order = self.rebuild_order + [i for i in reversed(range(len(self.slots))) if i not in seen]
        order_t = torch.tensor(order, dtype=torch.int64, device=self.device)
        dist.broadcast(order_t, group=self.group, group_src=0)
        self.rebuild_order, self.has_rebuilt = [], True
        self.apply_layout(assign_buckets([s.param for s in self.slots], order_t.tolist(), self.caps))
        return True

    def layout(self) -> list[list[int]]:
        """The buckets as lists of parameter indices, in launch order."""
        return [[s.index for s in b.slots] for b in self.buckets]

    def apply_layout(self, assignment: list[list[int]]) -> None:
        """Re-bucket (between steps; the same ``assignment`` on every rank). Gradients move into the new views.
        An installed bucket collective keeps its buckets and only learns the layout (see the module docstring)."""
        if self.bucket_collective is not None:
            self.bucket_collective.follow_layout(assignment)
        elif assignment != self.layout():
            self._share_pending = False
            self.buckets = build_buckets(
                self.slots, assignment, self.grad_views, self.grad_dtype, comm_alloc=self._comm_alloc
            )

    @property
    def rebuild_pending(self) -> bool:
        """torch's one rebuild (buckets in gradient arrival order) is still to come."""
        return self._should_rebuild()

    def stop_recording(self) -> None:
        """``bucket_cap_mb="auto"`` measures no more steps for now."""
        self._recorder = None

    def install_bucket_collective(self, collective: BucketCollective) -> None:
        """Replace every bucket's all-reduce with ``collective`` (see :mod:`fastpar.ddp.bucket_collective`), before
        training: its buckets (built for the layout that will stay) replace the reducer's, a timeout names its
        operation, and ``bucket_cap_mb="auto"`` stops (the collective keeps its buckets). Refused when a comm hook
        or another collective is installed."""
        if not isinstance(collective, BucketCollective):
            raise TypeError(
                f"fastpar DDP: install_bucket_collective needs a fastpar.ddp.bucket_collective.BucketCollective "
                f"(description, operation, diagnosis_key, build_buckets, start, finish, before_accumulate, follow_layout); got "
                f"{type(collective).__name__}"
            )
        self._refuse_second_replacement(f"install {collective.description}")
        if self._started:
            raise RuntimeError(
                f"fastpar DDP: cannot install {collective.description} during a backward; install it before training"
            )
        reference = self.layout()  # what torch's DDP reduces now
        if self._private_caps is not None:  # its buckets stay in private memory (see _share_buckets)
            self.caps = self._private_caps
        buckets = list(collective.build_buckets(self._steady_layout()))
        if [b.index for b in buckets] != list(range(len(buckets))) or sorted(
            s.index for b in buckets for s in b.slots
        ) != list(range(len(self.slots))):
            raise ValueError(
                f"fastpar DDP: {collective.description} built buckets that do not hold every parameter once, "
                "indexed 0..n-1 in launch order"
            )
        collective.follow_layout(reference)
        self.buckets = buckets
        self.waiter.close()
        diagnoser = StuckBucketDiagnoser(self.group, collective.diagnosis_key, collective.operation)
        self.waiter = BucketWaiter(self.device, pg_timeout_seconds(self.group, self.device), diagnoser.diagnose)
        self.bucket_collective = collective
        if self.auto is not None:
            self.auto.freeze(self, f"{collective.description} keeps the buckets as they are")

    def _steady_layout(self) -> list[list[int]]:
        """The layout to keep for good: today's once torch's rebuild is done (or when none will come), else fastpar's
        caps in registration order -- torch's first layout (one bucket per dtype until the rebuild) would serialise
        a collective that keeps its buckets."""
        if self.has_rebuilt or not self._should_rebuild():
            return self.layout()
        return initial_layout([s.param for s in self.slots], self.caps)

    def _refuse_second_replacement(self, attempt: str) -> None:
        """The one rule: a comm hook and a bucket collective both replace each bucket's all-reduce, so a model has at
        most one of them (and one of each kind). Both orders, and a second collective, raise this error."""
        if self.comm_hook is not None:
            present = "a comm hook (register_comm_hook)"
        elif self.bucket_collective is not None:
            present = self.bucket_collective.description
        else:
            return
        self._fail(
            RuntimeError(
                f"fastpar DDP: cannot {attempt}: this model already has {present}. A comm hook and a bucket collective "
                "(ZeRO's sharded optimizer) each replace every bucket's all-reduce, so a model takes one of them, "
                "once: build one ShardedOptimizer per model and no comm hook with it (for bf16 gradient sync pass "
                "grad_dtype=torch.bfloat16 to the DDP instead of a compression hook)"
            )
        )

    def _push_all_rebuilt_params(self) -> None:
        """A joined rank: rebuild as if every parameter had arrived, in index order (torch's semantics)."""
        self.rebuild_order = list(range(len(self.slots)))
        if self.auto is not None:
            self.auto.freeze(self, "join(): uneven inputs")

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
        if not self.expect_hooks:
            return
        if not self._started:
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
        self._comm_alloc = _shared_buckets(group, self.device)  # buckets move there at the next forward
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

    # ---- the hook: one parameter's gradient has been accumulated --------------------------------
    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        # hot path (once per parameter per backward): the mode checks short-circuit on plain attributes first
        slot = self.slots[index]
        if (
            (self.find_unused or self.static_graph)
            and (self._dynamic_find() or self._static_first())
            and param.grad is not None
        ):
            slot.used = True  # also during no_sync: used in any micro-batch counts (torch's local_used_map)
        if not self.expect_hooks:
            if self.bucket_collective is not None:
                self.bucket_collective.before_accumulate()
            self._accumulate_locally(slot)
            return
        if not self._started:
            self._start_backward()
        elif not self._end_check_queued and not self._finalize_queued and not self._static_first():
            self._queue_end_check()  # a nested (reentrant) backward ended earlier: watch the outer one
        slot.fires += 1
        if self.static_graph and self._static_first():
            return  # the first iteration of a static graph only counts; _delay_all_reduce reduces
        if self.static_graph:
            if slot.fires > slot.expected_fires:
                self._fail(RuntimeError(_graph_changed(slot)), abort=True)
            if slot.fires < slot.expected_fires:
                return  # reentrant checkpointing: the gradient is complete after the last expected hook
        elif slot.fires > 1:
            self._fail(RuntimeError(_received_twice(slot)), abort=True)
        elif slot.ready:  # marked unused from the graph, yet a gradient came: a reentrant checkpoint's parameter
            self._unmark_unused(slot)
        launched = self._next
        self._mark_ready(slot, arrived=True)
        if self._next != launched and self.finishing.finished < launched:
            self._finish_early()  # each time a bucket goes out: finish the earlier ones already back

    def _accumulate_locally(self, slot: ParamSlot) -> None:
        """no_sync: keep accumulating in the bucket view (torch's view semantics leave a fresh gradient alone)."""
        grad = slot.param.grad
        if slot.grad_view is not None and grad is not None and grad is not slot.grad_view and not self.alias_divides:
            with torch.no_grad():
                slot.grad_view.copy_(grad)
            slot.param.grad = slot.grad_view

    def _mark_ready(self, slot: ParamSlot, arrived: bool) -> None:
        slot.ready = True
        bucket = slot.bucket
        if arrived:
            if not self.has_rebuilt and self._recording_order():
                self.rebuild_order.append(slot.index)
            if self._recorder is not None:
                self._recorder.ready(slot.index)
            if self._sampled:
                self.grad_ready_order.append(slot.index)
            grad = slot.param.grad
            if (
                self._arrival_min is not None
                and slot.numel >= self._arrival_min
                and grad is not None
                and grad is not slot.grad_view
            ):
                with self._timed("pack", (slot,)):
                    gradient_path.stage(bucket, [slot], self._bucket_scale())
                slot.staged = True
        bucket.pending -= 1
        if bucket.pending == 0 and bucket.index == self._next:
            self._launch_ready(queue_finalize=True)

    def _unmark_unused(self, slot: ParamSlot) -> None:
        if slot.bucket.launched:
            self._fail(
                RuntimeError(
                    f"fastpar DDP: parameter {slot.name} was not reachable from the forward's outputs, so it was "
                    "reduced as unused, but then received a gradient (reentrant activation checkpointing with "
                    "find_unused_parameters=True). Use torch.utils.checkpoint.checkpoint(..., use_reentrant=False), "
                    "or static_graph=True instead of find_unused_parameters=True"
                ),
                abort=True,
            )
        slot.ready = False
        slot.bucket.pending += 1

    # ---- the hot path in the extension (hot_path.py): the common mode's hooks, bookkeeping and launches in C++ ----
    def _attach_hooks(self) -> None:
        """One hook per parameter: from C++ when the extension serves the device, else the Python hook."""
        me = weakref.ref(self)  # hooks must not keep a dropped wrapper alive
        params = [s.param for s in self.slots]
        self._native = hot_path.attach(
            params,
            self.group,
            functools.partial(_hook, weakref.WeakMethod(self._autograd_hook), None),
            functools.partial(_hook, weakref.WeakMethod(self._native_started), None),
            functools.partial(_hook, weakref.WeakMethod(self._native_launched), None),
            functools.partial(_hook, weakref.WeakMethod(self._native_twice), None),
        )
        self._native_layout = None
        if self._native is None:
            self._handles = [
                p.register_post_accumulate_grad_hook(functools.partial(_grad_hook, me, i)) for i, p in enumerate(params)
            ]

    def _hot_path_in_extension(self) -> bool:
        """The one switch: whether the coming backward runs in the extension's hooks (every other backward runs the
        Python hook, :meth:`_on_grad`, which handles every mode). The common mode only: one all-reduce per bucket,
        no join() shadowing, and no ``bucket_cap_mb="auto"`` measurement (it times each gradient)."""
        return (
            self._native is not None
            and self.comm_hook is None
            and self.bucket_collective is None
            and not self.find_unused
            and not self.static_graph
            and self._join is None
            and self._recorder is None
        )

    def _arm_native(self) -> None:
        if self._native_layout is not self.buckets:
            self._native.set_layout(hot_path.layout(self.buckets))
            self._native_layout = self.buckets
        alias_divisor = self._divisor if self.alias_divides else 0
        self._native.arm(self._scale, alias_divisor, -1 if self._arrival_min is None else self._arrival_min)
        self._native_armed, self._native_pulled = True, False

    def _native_started(self) -> None:
        """The extension's first gradient of a backward (or the first after a nested backward ended)."""
        if not self._started:
            self._start_backward()
        elif not self._end_check_queued and not self._finalize_queued:
            self._queue_end_check()

    def _native_launched(self, first: int, works: list) -> None:
        """The extension launched buckets ``first, first + 1, ...`` (their collectives' ``works``)."""
        for bucket, work in zip(self.buckets[first : first + len(works)], works, strict=True):
            bucket.work, bucket.launched = work, True
            self._bytes += bucket.nbytes
        if first == 0 and self._sampled:
            self.runtime_timer.record("backward_comm_start")
        self._next = first + len(works)
        self.buckets_reduced += len(works)
        if self._next == len(self.buckets) and not self._finalize_queued:
            self._finalize_queued = True
            _queue_callback(self._backward_computed)
        if self.finishing.finished < first:
            self._finish_early()

    def _native_twice(self, index: int) -> None:
        self._pull_native()
        slot = self.slots[index]
        slot.fires = 2
        self._fail(RuntimeError(_received_twice(slot)), abort=True)

    def _take_native_arrivals(self) -> None:
        """The arrival order where the Python hook records it: for torch's rebuild (before it) and a sampled
        iteration's logging."""
        if self._started and ((not self.has_rebuilt and self._recording_order()) or self._sampled):
            order = self._native.arrival_order()
            if not self.has_rebuilt and self._recording_order():
                self.rebuild_order += order
            if self._sampled:
                self.grad_ready_order = order

    def _pull_native(self) -> None:
        """Copy the extension's per-parameter progress into the slots (for errors, which name parameters)."""
        if not self._native_armed:
            return
        arrived, staged = self._native.progress()
        for i in arrived:
            self.slots[i].ready, self.slots[i].fires = True, 1
        for i in staged:
            self.slots[i].staged = True
        self._native_pulled = True

    # ---- launching buckets, in order -------------------------------------------------------------
    def _bucket_scale(self) -> float:
        return 1.0 if self.comm_hook is not None else self._scale  # torch's hooks divide themselves

    def _launch_ready(self, queue_finalize: bool) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            if self._next == 0 and self._sampled:
                self.runtime_timer.record("backward_comm_start")
            self._launch(self.buckets[self._next])
            self._next += 1
            self.buckets_reduced += 1
        if self._next == len(self.buckets) and not self._finalize_queued:
            self._finalize_queued = True
            if self._dynamic_find():
                self._launch_used_map()  # after the buckets, in the same order on every rank
            if queue_finalize:
                _queue_callback(self._backward_computed)

    def _launch(self, bucket) -> None:
        rest = [s for s in bucket.slots if not s.staged]
        keep_stale: frozenset[int] = frozenset()
        if not self.alias_divides and (self.find_unused or self.static_graph):
            keep_stale = frozenset(s.index for s in rest if s.param.grad is s.grad_view and self._locally_unused(s))
        hooked = self.comm_hook is not None
        with self._timed("pack", rest):
            gradient_path.stage(
                bucket,
                rest,
                self._bucket_scale(),
                alias_divisor=self._divisor if self.alias_divides and not hooked else None,
                keep_stale=keep_stale,
            )
        self._bytes += bucket.nbytes
        buffer = self._wire_buffer(bucket)
        if hooked:
            hook, state = self.comm_hook
            bucket.work = hook(state, GradBucket(bucket, buffer, bucket.index == len(self.buckets) - 1))
        elif self.bucket_collective is not None:
            bucket.work = self.bucket_collective.start(bucket)
        else:
            work = dist.all_reduce(buffer, group=self.group, async_op=True)
            bucket.work = work if buffer is bucket.comm_flat else work.get_future()  # the copy comes back in finish
        bucket.launched = True

    def _wire_buffer(self, bucket) -> torch.Tensor:
        """What a bucket's collective reduces: its buffer, or under join() with buckets in shared memory a private
        copy. A joined rank shadows each bucket with private zeros (:meth:`_get_zeros_like_grad_buckets`), and the
        backend reduces a shared buffer by another protocol than private memory: every rank must take the same."""
        if self._under_join and self._comm_alloc is not None:
            return bucket.comm_flat.clone()
        return bucket.comm_flat

    # ---- finishing buckets: early from the hooks (the pipelined path), the rest at the end --------
    def _finish_early(self) -> None:
        """Finish the launched buckets whose collectives are already back, in order; never waits."""
        try:
            self.finishing.poll(self.buckets, self._next, self._pollable, self._finish_next_step, self._unused_known)
        except Exception as exc:  # the collective failed: end this backward cleanly, name the bucket
            self._fail(exc, abort=True)

    def _pollable(self, bucket):
        """The handle whose completion means ``bucket``'s result is there. A comm hook's future on CUDA is done
        once its work is queued, not run: finishing then would make the compute stream wait for the collective
        mid-backward, so such buckets are finished at the end."""
        if self.bucket_collective is not None:
            return None  # ZeRO's exchange may be point-to-point sends, not one pollable work
        if self.device.type == "cuda" and isinstance(bucket.work, torch._C.Future):
            return None
        return bucket.work

    def _finish_next_step(self, bucket) -> None:
        self._finish_bucket(bucket, self.step + 1)  # _finalize counts the step when backward ends

    def _finish_bucket(self, bucket, step: int) -> None:
        result = self.waiter.wait(step, bucket.index, bucket.names, bucket.work)
        finish = gradient_path.finish if self.bucket_collective is None else self.bucket_collective.finish
        with self._timed("finish", bucket.slots):
            finish(bucket, result, self._unused_in(bucket))

    def _timed(self, kind: str, slots: Sequence[ParamSlot]):
        """Times the reducer's own work on ``slots``' gradients while "auto" records this step."""
        if self._recorder is None:
            return _NOT_TIMED
        return self._recorder.timed(kind, sum(s.numel * s.param.element_size() for s in slots))

    def _unused_known(self, bucket) -> bool:
        """Whether :meth:`_unused_in` can answer for ``bucket`` now, without the used-map all-reduce (which
        is launched after the last bucket): finishing early is safe only then."""
        if not (self.find_unused or self.static_graph) or self._globally_unused is not None:
            return True
        if self.static_graph and self._used_work is None:
            return True  # learned in the first iteration
        return all(not self._locally_unused(s) for s in bucket.slots)

    def _launch_used_map(self) -> None:
        used = torch.tensor([int(s.used) for s in self.slots], dtype=torch.int32).to(self.device)
        self._used_map = used
        self._used_work = (used, dist.all_reduce(used, group=self.group, async_op=True))

    # ---- the start and the end of a reducing backward ---------------------------------------------
    def _start_backward(self) -> None:
        self._started = True
        if self.bucket_collective is not None:
            self.bucket_collective.before_accumulate()  # before any gradient of this backward is staged
        self.num_backwards += 1
        self._under_join = self._join is not None  # for this backward's launches (_wire_buffer)
        if self._join is not None:
            work, divide_by_initial = self._join
            self._join = None
            if not divide_by_initial:  # average over the ranks that have not joined yet
                work.wait()
                self._divisor = int(work.result()[0].item())
                self._scale = 1.0 / self._divisor
        if self._static_first():
            return
        if self.static_graph:  # unused since the first iteration: ready at once (torch's semantics)
            for slot in self.slots:
                if slot.expected_fires == 0 and not slot.ready:
                    self._mark_ready(slot, arrived=False)
        if self._dynamic_find() and not self._searched:
            self._search_unused(None)  # no output hook fired (no outputs given): search from here
        self._queue_end_check()

    def _search_unused(self, _grad) -> None:
        """Parameters the running backward will not reach are ready now, so no bucket waits for them."""
        if self._searched or not self.expect_hooks:
            return
        self._searched = True
        if not self._started:
            self._start_backward()
        will_run = torch._C._will_engine_execute_node
        unused = [slot for slot in self.slots if not slot.ready and slot.fires == 0 and not will_run(slot.acc)]
        self._note_unused([slot.index for slot in unused])
        for slot in unused:
            self._mark_ready(slot, arrived=False)

    def _note_unused(self, unused: list[int]) -> None:
        """This iteration's unused parameters, from the graph search. Whether the set changed since the last
        iteration is torch's ``can_set_static_graph`` (logged once, when it first changes)."""
        if self.graph_static and self.num_iterations > 1 and unused != self.unused_parameters:
            self.graph_static = False
            if self.logger is not None:
                self.logger.log_if_graph_static(False)
        self.unused_parameters = unused

    def _queue_end_check(self) -> None:
        self._end_check_queued = True
        _queue_callback(self._end_of_graph_task)

    def _end_of_graph_task(self) -> None:
        """Runs when the graph task that queued it ends. If the reduction is not complete then, gradients are
        missing -- unless this was a reentrant (nested) backward and the outer one goes on."""
        self._end_check_queued = False
        if not self._started or self._finalize_queued:
            return
        if _current_node() is not None:
            if self._native_armed:
                self._native.expect_start()
            return  # a nested backward inside a checkpointed block: the next hook re-arms this check
        self._pull_native()
        missing = [s for s in self.slots if not s.ready]
        if self.static_graph:
            self._fail(RuntimeError(_graph_changed(missing[0])), abort=True)
        if not self.find_unused:
            self._fail(UnusedParametersError([s.name for s in missing], len(self.slots)), abort=True)
        for slot in missing:
            self._mark_ready(slot, arrived=False)  # queues _finalize after this callback

    def _backward_computed(self) -> None:
        """Queued when the last bucket is launched: runs when autograd's graph task ends."""
        if self._sampled:
            self.runtime_timer.record("backward_compute_end")
        self._finalize()

    def _finalize(self) -> None:
        """End of a reducing backward: wait for and finish every bucket, then record and learn."""
        try:
            self.step += 1
            if self._recorder is not None:
                self._recorder.backward_end()
            self.timer.start()
            self.finishing.drain(self.buckets, functools.partial(self._finish_bucket, step=self.step))
            self.timer.stop()
            if self._sampled:
                self.runtime_timer.record("backward_comm_end")
            self._record_stats()
            if self.auto is not None:
                self.auto.step_done(self)
            if self.static_graph and self.rebuild_order and not self.has_rebuilt:  # torch appends the unused
                self.rebuild_order += sorted(s.index for s in self.slots if s.expected_fires == 0)
        except BaseException:
            self._abort_backward()
            raise
        self._end_backward()

    def _unused_in(self, bucket) -> frozenset[int]:
        """Slots of ``bucket`` no rank used (their .grad stays untouched). Waits for the used-map all-reduce
        only when this rank did not use one of them (torch's lazy wait)."""
        if not (self.find_unused or self.static_graph):
            return frozenset()
        if self.static_graph and self._globally_unused is None and self._used_work is None:
            return self._static_unused  # learned in the first iteration
        if all(not self._locally_unused(s) for s in bucket.slots):
            return frozenset()
        if self._globally_unused is None:
            used, work = self._used_work
            work.wait()  # CPU-GPU sync point on CUDA, only when a parameter was unused here
            self._globally_unused = frozenset(torch.nonzero(used == 0).flatten().tolist())
            if self.static_graph:
                self._static_unused = self._globally_unused
        return self._globally_unused

    def _locally_unused(self, slot: ParamSlot) -> bool:
        if self.static_graph and self._static_learned and self._used_work is None:
            return slot.expected_fires == 0
        return not slot.used

    def _record_stats(self) -> None:
        used_bytes = self._used_work[0].numel() * 4 if self._used_work is not None else 0
        self.last_stats = {
            "step": self.step,
            "bytes": self._bytes + used_bytes,
            "collectives": len(self.buckets) + (self._used_work is not None),
            "wait_s": None,  # read lazily from the timer (a CUDA sync on GPU)
            "buckets": len(self.buckets),
            "finished_early": self.finishing.early,  # finished from the hooks, before backward ended
            "hot_path": "extension" if self._native_armed else "python",  # where the hooks ran (hot_path.py)
        }

    def stats(self) -> dict:
        stats = dict(self.last_stats)
        stats["wait_s"] = self.timer.seconds() if self.step else 0.0
        if self.auto is not None:
            stats["auto"] = self.auto.summary()
        return stats

    def _end_backward(self) -> None:
        if self._used_work is not None:
            self._used_work[1].wait()  # never leave a collective in flight
        if self._dynamic_find() or self._static_learned:
            for slot in self.slots:
                slot.used = False
        if not self._native_armed or self._native_pulled:  # the extension's backward left the slots untouched
            for slot in self.slots:
                slot.reset_step()
        if self._native_armed:
            self._take_native_arrivals()
            self._native.disarm()
            self._native_armed = self._native_pulled = False
        for bucket in self.buckets:
            bucket.reset()
        self.expect_hooks = False
        self._started = self._finalize_queued = self._end_check_queued = self._searched = False
        self._next = 0
        self._scale, self._divisor = 1.0 / self.world_size, self.world_size
        self._used_work = self._globally_unused = None
        self._bytes = 0
        self.finishing.reset()
        self._remove_outputs_hook()

    def _abort_backward(self) -> None:
        """An error ends this backward: wait for what was launched, so no collective is left in flight."""
        for bucket in self.buckets:
            if bucket.launched and bucket.work is not None:
                try:
                    self.waiter.wait(self.step, bucket.index, bucket.names, bucket.work)
                except Exception:  # the original error is the one to report
                    pass
        self._end_backward()

    def _check_health(self) -> None:
        """At each entry: an error found in the background (NCCL deadline) or a backward that never finished."""
        self.waiter.raise_if_failed()
        if self._started and not self._finalize_queued and _graph_task_id() == -1:
            self._pull_native()
            missing = [s.name for s in self.slots if not s.ready]
            self._fail(UnusedParametersError(missing, len(self.slots)), abort=True)

    def _fail(self, error: Exception, abort: bool = False):
        """Raise ``error``, recorded in the logging data first (torch's REDUCER_CHECK does the same); ``abort``
        ends the running backward first, so the next step starts clean."""
        if abort:
            self._abort_backward()
        if self.logger is not None:
            self.logger.set_error_and_log(str(error))
        raise error

    # ---- modes ---------------------------------------------------------------------------------
    def _dynamic_find(self) -> bool:
        return self.find_unused and not self.static_graph

    def _static_first(self) -> bool:
        return self.static_graph and not self._static_learned

    def _should_rebuild(self) -> bool:
        return (self.static_graph or not self.find_unused) and not self.has_rebuilt

    def _recording_order(self) -> bool:
        return self._should_rebuild() and not self._static_first()

    def _remove_outputs_hook(self) -> None:
        if self._outputs_hook is not None:
            self._outputs_hook.remove()
            self._outputs_hook = None

    def __del__(self) -> None:
        if hasattr(self, "_native"):
            self._remove_autograd_hooks()
        if hasattr(self, "waiter"):
            self.waiter.close()


def _grad_hook(reducer: weakref.ref, index: int, param: torch.Tensor) -> None:
    bound = reducer()
    if bound is not None:
        bound._on_grad(index, param)


def _hook(method: weakref.WeakMethod, index, *args) -> None:
    bound = method()
    if bound is not None:
        if index is None:
            bound(*args)
        else:
            bound(index, *args)


def _received_twice(slot: ParamSlot) -> str:
    return (
        f"fastpar DDP: parameter {slot.name} received a gradient twice in one synchronised backward (a second "
        "backward over the same forward, or a parameter reused across reentrant checkpoints); run one backward per "
        "forward, wrap the extra backward in model.no_sync(), or pass static_graph=True when the graph is the same "
        "every step"
    )


def _graph_changed(slot: ParamSlot) -> str:
    return (
        f"fastpar DDP: with static_graph=True, parameter {slot.name} received {slot.fires} gradient(s) in this "
        f"backward but {slot.expected_fires} in the first iteration. The training graph changed (a parameter used "
        "in some steps only, or a different number of checkpointed recomputations); static_graph needs the same "
        "graph every step: pass find_unused_parameters=True instead of static_graph=True"
    )
