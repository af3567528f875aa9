"""fastpar's gradient reducer, behind the interface of torch's C++ Reducer.

torch's DistributedDataParallel drives it exactly as it drives its own reducer (``prepare_for_forward`` /
``prepare_for_backward`` from forward, ``_rebuild_buckets``, ``_delay_all_reduce`` for a static graph,
the join hooks), and frameworks reach the same methods through ``model.reducer``.

One synchronised backward: each parameter's post-accumulate-grad hook marks its slot ready; a complete
bucket is staged (``gradient_path.stage``) and its collective starts asynchronously -- strictly in bucket
order, so every rank issues the same collectives in the same order. Unused parameters are marked ready
up front: from the autograd graph (``find_unused_parameters``) or from the first iteration
(``static_graph``). Buckets whose collectives are already back are finished from the hooks, in order,
while later ones are still on the wire (``finish_queue.FinishQueue``; only once nothing can change their
gradients). After the last launch the end of backward is queued; it runs named steps: wait for each
remaining bucket (a deadline that names missing ranks), finish it into ``.grad``, record statistics, learn.
Where a backward stands is one value, :class:`~fastpar.ddp.backward_state.BackwardState` (IDLE, ARMED, REDUCING,
FINISHING; the diagram and the allowed transitions are in :mod:`fastpar.ddp.backward_state`).

The module holds the core (hooks, launching, finishing, the start and end of a backward); its jobs around it are
mixins, one module each: the bucket layout and its changes (:mod:`~fastpar.ddp.bucket_layout`), torch's Reducer
API and stubs (:mod:`~fastpar.ddp.torch_reducer_api`), the bridge to
the extension's hooks (:mod:`~fastpar.ddp.extension_bridge`), the unused-parameter / static-graph policy
(:mod:`~fastpar.ddp.unused_policy`) and the statistics (:mod:`~fastpar.ddp.reducer_stats`). Gradients produced on
other streams are waited for per gradient (:mod:`~fastpar.ddp.ready_events`).

Where the hooks run (:mod:`fastpar.ddp.extension_hooks`): with the compiled extension they are C++ hooks, and in the
common mode (:meth:`Reducer._hooks_in_extension`) marking ready, bucket bookkeeping and launches run in C++
(``fastpar._C.BucketLauncher``), which calls back once per backward (``_native_started``) and once per launch
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
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..comm import shared_buffers
from . import gradient_path, ready_events
from .auto_buckets import AutoBuckets
from .backward_state import BackwardState, BackwardTracker
from .bucket_collective import BucketCollective
from .bucket_layout import BucketLayout
from .buckets import ParamSlot, build_buckets, initial_layout
from .comm_hooks import GradBucket
from .errors import (
    StuckBucketDiagnoser,
    UnusedParametersError,
    graph_changed,
    launch_failed,
    pg_timeout_seconds,
    received_twice,
)
from .extension_bridge import ExtensionBridge
from .finish_queue import FinishQueue
from .reducer_stats import ReducerStats
from .torch_logger import DEFAULT_SAMPLE_RATE, RuntimeTimer
from .torch_reducer_api import TorchReducerApi
from .unused_policy import UnusedParameterPolicy
from .waiting import BucketWaiter, WaitTimer

_queue_callback = torch.autograd.Variable._execution_engine.queue_callback
_current_node = getattr(torch._C, "_current_autograd_node", lambda: None)
_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)
# CPU: gradients copied into their bucket while hot in cache, from this size. The Python hook pays a dispatch per
# copy, worth it from 1 MiB of fp32; the extension's hook copies with no dispatch, so every gradient.
_COPY_ON_ARRIVAL_MIN_NUMEL = {"python": 1 << 18, "extension": 0}
_NOT_MARKED = contextlib.nullcontext()


class Reducer(BucketLayout, TorchReducerApi, ExtensionBridge, UnusedParameterPolicy, ReducerStats):
    """The core: hooks, the backward's state, launching and finishing buckets. torch's API, the bridge to the
    extension, the unused-parameter policy and the statistics are its mixins (one module each)."""

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
        self._comm_alloc = shared_buffers.bucket_allocator(group, self.device)
        self._share_pending = self._comm_alloc is not None  # private until the first forward: _share_buckets
        self.buckets = build_buckets(self.slots, initial_layout(params, initial_caps), grad_views, grad_dtype)
        diagnoser = StuckBucketDiagnoser(group, instance_id)
        self.waiter = BucketWaiter(self.device, pg_timeout_seconds(group, self.device), diagnoser.diagnose)
        self.timer = WaitTimer(self.device)
        with torch.enable_grad():  # the AccumulateGrad nodes, kept alive as torch's reducer keeps them
            for slot in self.slots:
                slot.acc = slot.param.view_as(slot.param).grad_fn.next_functions[0][0]
        self._ready_events = ready_events.for_device(self.device, len(self.slots))  # None on the CPU
        self._handles: list = []
        self._native = None  # fastpar._C.BucketLauncher: the hooks in C++ (extension_hooks.py), else Python hooks
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
        self._backward = BackwardTracker()  # the running backward's state (backward_state.py has the diagram)
        self._end_check_queued = self._searched = False
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

    @property
    def expect_hooks(self) -> bool:
        """A synchronised backward is expected or running (torch's ``expect_autograd_hooks_``)."""
        return self._backward.expecting

    def set_copy_on_arrival(self, min_numel: int | None) -> None:
        """Copy fresh gradients of at least ``min_numel`` elements into their bucket as they arrive (view mode;
        None: never). On CPU a gradient copied while hot in cache, and freed at once, is measurably faster."""
        self._arrival_min = min_numel if self.grad_views else None

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
        if not self._backward.expecting:
            if self.bucket_collective is not None:
                self.bucket_collective.before_accumulate()
            self._accumulate_locally(slot)
            return
        if not self._backward.started:
            self._start_backward()
        elif not self._end_check_queued and not self._backward.finishing and not self._static_first():
            self._queue_end_check()  # a nested (reentrant) backward ended earlier: watch the outer one
        slot.fires += 1
        if self.static_graph and self._static_first():
            if self._ready_events is not None:
                self._ready_events.record(slot)
            return  # the first iteration of a static graph only counts; _delay_all_reduce reduces
        if self.static_graph:
            if slot.fires > slot.expected_fires:
                self._fail(RuntimeError(graph_changed(slot)), abort=True)
            if slot.fires < slot.expected_fires:
                return  # reentrant checkpointing: the gradient is complete after the last expected hook
        elif slot.fires > 1:
            self._fail(RuntimeError(received_twice(slot)), abort=True)
        elif slot.ready:  # marked unused from the graph, yet a gradient came: a reentrant checkpoint's parameter
            self._unmark_unused(slot)
        launched = self._next
        self._mark_ready(slot, arrived=True)
        if self._next != launched and self.finishing.finished < launched:
            self._finish_early()  # each time a bucket goes out: finish the earlier ones already back

    @property
    def next_bucket(self) -> int:
        """The index of the bucket to launch next in this backward (buckets launch strictly in order)."""
        return self._next

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
                and bucket.may_stage_early()
            ):
                with self._timed("pack", (slot,)):
                    gradient_path.stage(bucket, [slot], self._bucket_scale())
                slot.staged = True
            if self._ready_events is not None:
                self._ready_events.record(slot)  # after the copy on arrival this hook queued
        bucket.pending -= 1
        if bucket.pending == 0 and bucket.index == self._next:
            self._launch_ready(queue_finalize=True)

    # ---- launching buckets, in order -------------------------------------------------------------
    def _bucket_scale(self) -> float:
        return 1.0 if self.comm_hook is not None else self._scale  # torch's hooks divide themselves

    def _launch_ready(self, queue_finalize: bool) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            if self._next == 0 and self._sampled:
                self.runtime_timer.record("backward_comm_start")
            try:
                self._launch(self.buckets[self._next])
            except Exception as exc:  # wait for the buckets already out, end the backward, report this cause
                self._fail(launch_failed(self.buckets[self._next], str(exc)), abort=True)
            self._next += 1
            self.buckets_reduced += 1
        if self._next == len(self.buckets) and not self._backward.finishing:
            self._backward.to(BackwardState.FINISHING)
            if self._dynamic_find():
                self._launch_used_map()  # after the buckets, in the same order on every rank
            if queue_finalize:
                _queue_callback(self._backward_computed)

    def _launch(self, bucket) -> None:
        if self._ready_events is not None:
            self._ready_events.wait_before_pack(bucket.slots)
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
            with self._marked_as_bucket():
                bucket.work = hook(state, GradBucket(bucket, buffer, bucket.index == len(self.buckets) - 1))
        elif self.bucket_collective is not None:
            bucket.work = self.bucket_collective.start(bucket)
        else:
            with self._marked_as_bucket():
                work = dist.all_reduce(buffer, group=self.group, async_op=True)
            bucket.work = work if buffer is bucket.comm_flat else work.get_future()  # the copy comes back in finish
        bucket.launched = True

    def _marked_as_bucket(self):
        """Marks the collective issued inside as this bucket's: a buffer in shared memory takes the shared protocol
        (:func:`fastpar.comm.shared_buffers.bucket_collective`); nothing else does."""
        return _NOT_MARKED if self._comm_alloc is None else shared_buffers.bucket_collective()

    def _wire_buffer(self, bucket) -> torch.Tensor:
        """What a bucket's collective reduces: its buffer, or under join() with buckets in shared memory a private
        copy. A joined rank shadows each bucket with private zeros (:meth:`_get_zeros_like_grad_buckets`), and the
        backend reduces a shared buffer by another protocol than private memory: every rank must take the same."""
        comm = bucket.acquire_comm_flat()
        if self._under_join and self._comm_alloc is not None:
            return comm.clone()
        return comm

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

    # ---- the start and the end of a reducing backward ---------------------------------------------
    def _start_backward(self) -> None:
        self._backward.to(BackwardState.REDUCING)
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

    def _queue_end_check(self) -> None:
        self._end_check_queued = True
        _queue_callback(self._end_of_graph_task)

    def _end_of_graph_task(self) -> None:
        """Runs when the graph task that queued it ends. If the reduction is not complete then, gradients are
        missing -- unless this was a reentrant (nested) backward and the outer one goes on."""
        self._end_check_queued = False
        if not self._backward.started or self._backward.finishing:
            return
        if _current_node() is not None:
            if self._native_armed:
                self._native.expect_start()
            return  # a nested backward inside a checkpointed block: the next hook re-arms this check
        self._pull_native()
        missing = [s for s in self.slots if not s.ready]
        if self.static_graph:
            self._fail(RuntimeError(graph_changed(missing[0])), abort=True)
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
        if self._share_pending and not self._under_join and not self._rebuild_in_arrival_order_due():
            self._share_buckets()  # every rank ends this backward (a joined one shadows it: later, at a rebuild)

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
        self._backward.to(BackwardState.IDLE)
        self._end_check_queued = self._searched = False
        self._next = 0
        self._scale, self._divisor = 1.0 / self.world_size, self.world_size
        self._used_work = self._globally_unused = None
        self._bytes = 0
        self.finishing.reset()
        if self._ready_events is not None:
            self._ready_events.clear()
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
        if self._backward.started and not self._backward.finishing and _graph_task_id() == -1:
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

    def __del__(self) -> None:
        if hasattr(self, "_native"):
            self._remove_autograd_hooks()
        if hasattr(self, "waiter"):
            self.waiter.close()
