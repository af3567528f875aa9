"""The gradient reducer: per-parameter hooks, in-order async bucket launch, end-of-backward finalize.

Flow of a synchronised backward pass (``prepare_for_backward`` was called by the forward):
each post-accumulate-grad hook counts its bucket down; a bucket whose last gradient arrived is
filled (scaled by 1/world_size) and its all-reduce starts asynchronously — always in bucket order,
so every rank issues the same collectives in the same order. The first hook queues ``_finalize``
on the autograd engine; it runs when backward ends, waits for every bucket and leaves the
averaged gradients in ``.grad``. Outside a synchronised pass (``no_sync``) hooks only keep
``.grad`` in the bucket views, so accumulation happens in place.
"""

from __future__ import annotations

import functools
import time
import weakref

import torch
import torch.distributed as dist

from .. import ops
from . import _moves
from .buckets import Bucket, assign_buckets, build_buckets, initial_buckets
from .comm_hooks import GradBucket, hook_result
from .errors import StuckBucketDiagnoser, UnusedParametersError, pg_timeout_seconds

_queue_callback = torch.autograd.Variable._execution_engine.queue_callback
_COPY_ON_ARRIVAL_MIN_NUMEL = 1 << 18  # 1 MiB of fp32: below, per-tensor dispatch costs more than it saves


class Reducer:
    def __init__(
        self, params, names, group, *, caps, initial_caps, grad_views, grad_dtype, tolerate_unused, rebuild, instance_id
    ):
        self.params, self.names, self.group, self.caps = params, names, group, caps
        self.grad_views, self.grad_dtype = grad_views, grad_dtype
        self.tolerate_unused = tolerate_unused  # find_unused_parameters or static_graph
        self.device = params[0].device
        self.world_size = group.size()
        self.timeout_s = pg_timeout_seconds(group, self.device)
        self.diagnoser = StuckBucketDiagnoser(group, instance_id)
        self.comm_hook = None  # (hook, state)
        self.join_divisor: tuple | None = None  # (work, divide_by_initial_world_size) from Join
        # CPU: copy each large fresh gradient into its bucket as it arrives (measured faster: it is still
        # in cache and its memory is reused at once); small ones, and all on GPU: one pack per bucket
        self.set_copy_on_arrival(_COPY_ON_ARRIVAL_MIN_NUMEL if self.device.type == "cpu" else None)
        self._install(initial_buckets(params, initial_caps))
        self._arrival: list[int] | None = [] if rebuild else None
        self._rebuild_due = False
        # hooks hold the reducer weakly: dropping the DDP wrapper removes them (see __del__)
        on_grad = weakref.WeakMethod(self._on_grad)
        self._handles = [
            p.register_post_accumulate_grad_hook(functools.partial(_forward_hook, on_grad, i))
            for i, p in enumerate(params)
        ]
        self.step = 0
        self.last_stats = {"step": 0, "bytes": 0, "collectives": 0, "wait_s": 0.0, "buckets": len(self.buckets)}
        self._sync = False
        self._reset()

    # ---- setup -------------------------------------------------------------------------------
    def _install(self, assignment: list[list[int]]) -> None:
        self.buckets: list[Bucket] = build_buckets(
            self.params, self.names, assignment, self.grad_views, self.grad_dtype
        )
        self._bucket_of = [0] * len(self.params)
        self._view_of: list = [None] * len(self.params)
        for b in self.buckets:
            for i, v in zip(b.members, b.views, strict=True):
                self._bucket_of[i] = b.index
                self._view_of[i] = v
        self._sizes = [len(b.members) for b in self.buckets]
        self._comm_view_of: list = [None] * len(self.params)
        self._casts = bytearray(len(self.params))  # view mode, reduced in a narrower dtype (grad_dtype)
        for b in self.buckets:
            for i, p, cv in zip(b.members, b.params, b.comm_views, strict=True):
                self._comm_view_of[i] = cv
                self._casts[i] = cv is not None and cv.dtype != p.dtype
        self._comm_flat_of = [cv.view(-1) if c and cv.is_contiguous() else None for cv, c in
                              zip(self._comm_view_of, self._casts, strict=True)]  # fmt: skip
        # grad_dtype with a strided view: fresh fp32 gradients are scaled into this scratch, then rounded into
        # the bucket (as ops.pack: scale in fp32, round once)
        largest = max(
            (p.numel() for i, p in enumerate(self.params) if self._casts[i] and self._comm_flat_of[i] is None),
            default=0,
        )
        self._scratch = torch.empty(largest, dtype=torch.float32, device=self.device)

    def set_copy_on_arrival(self, min_numel: int | None) -> None:
        """Copy fresh gradients of at least ``min_numel`` elements on arrival (None: never; view mode only)."""
        self.copy_on_arrival = self.grad_views and min_numel is not None
        self._large = [min_numel is not None and p.numel() >= min_numel for p in self.params]

    def _reset(self) -> None:
        self._ready = bytearray(len(self.params))
        self._prescaled = bytearray(len(self.params))  # copied into comm_flat on arrival
        self._prescaled_n = [0] * len(self.buckets)
        self._used = bytearray(len(self.params))
        self._pending = list(self._sizes)
        self._next = 0
        self._works: list = [None] * len(self.buckets)
        self._callback_queued = False
        self._scale = 1.0 / self.world_size
        self._bytes = 0

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __del__(self) -> None:
        self.remove_hooks()

    def maybe_rebuild(self) -> bool:
        """Once, before the forward after the first synchronised backward: re-bucket in the order the
        gradients arrived on rank 0 (broadcast, so every rank gets the same buckets)."""
        if not self._rebuild_due:
            return False
        self._rebuild_due = False
        seen = set(self._arrival)
        order = self._arrival + [i for i in reversed(range(len(self.params))) if i not in seen]
        self._arrival = None
        order_t = torch.tensor(order, dtype=torch.int64, device=self.device)
        dist.broadcast(order_t, group=self.group, group_src=0)
        assignment = assign_buckets(self.params, order_t.tolist(), self.caps)
        if assignment != [b.members for b in self.buckets]:
            self._install(assignment)
            self._reset()
        return True

    # ---- per step ----------------------------------------------------------------------------
    def prepare_for_backward(self, sync: bool) -> None:
        """Called by forward: whether the coming backward reduces (torch decides this at forward time)."""
        if self._callback_queued:
            return  # a backward is running (forward inside backward, e.g. checkpointing): keep its state
        self._sync = sync

    def _on_grad(self, i: int, param: torch.Tensor) -> None:
        # hot path: runs once per parameter per backward
        if not self._sync:
            self._accumulate_locally(i, param)
            return
        if self._ready[i]:
            raise RuntimeError(
                f"fastpar DDP: parameter {self.names[i]} received a gradient twice in one synchronised backward "
                "(a second backward over the same forward, or reentrant use); run one backward per forward "
                "or wrap the extra backward in model.no_sync()"
            )
        self._ready[i] = 1
        self._used[i] = 1
        if not self._callback_queued:
            self._callback_queued = True
            _queue_callback(self._finalize)
            if self.join_divisor is not None:
                self._apply_join_divisor()
        if self._arrival is not None:
            self._arrival.append(i)
        b = self._bucket_of[i]
        if self.copy_on_arrival and self._large[i]:
            view = self._view_of[i]
            grad = param.grad
            if grad is not view:
                # CPU: copy now, while the fresh gradient is hot, and free it at once (allocator reuse)
                scale = 1.0 if self.comm_hook is not None else self._scale
                with torch.no_grad():
                    if self._casts[i] and self._comm_flat_of[i] is not None:
                        ops.pack((grad,), self._comm_flat_of[i], scale)  # scale in fp32, round once, one pass
                    elif self._casts[i]:  # a strided (e.g. channels_last) view: through an fp32 scratch
                        scratch = self._scratch.narrow(0, 0, grad.numel()).view(grad.shape)
                        torch.mul(grad, scale, out=scratch)
                        self._comm_view_of[i].copy_(scratch)
                    else:
                        torch.mul(grad, scale, out=self._comm_view_of[i])
                param.grad = view
                self._prescaled[i] = 1
                self._prescaled_n[b] += 1
        self._pending[b] -= 1
        if b == self._next and self._pending[b] == 0:
            self._launch_in_order()

    def _accumulate_locally(self, i: int, param: torch.Tensor) -> None:
        self._used[i] = 1  # torch counts use during no_sync too
        view = self._view_of[i] if self.grad_views else None
        if view is not None and param.grad is not view:
            with torch.no_grad():
                view.copy_(param.grad)
            param.grad = view

    def _launch_in_order(self, unused: dict | None = None) -> None:
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            self._launch(self.buckets[self._next], (unused or {}).get(self._next, ()))
            self._next += 1

    def _launch(self, bucket: Bucket, unused) -> None:
        scale = 1.0 if self.comm_hook is not None else self._scale  # torch's hooks divide themselves
        prescaled = self._prescaled_n[bucket.index]
        if prescaled == len(bucket.members):
            pass  # every gradient was copied into comm_flat on arrival
        elif prescaled:
            _moves.fill_rest_of_bucket(bucket, scale, self._prescaled)
        elif self.grad_views:
            _moves.fill_views_bucket(bucket, scale, set(unused))
        else:
            _moves.fill_packed_bucket(bucket, scale)
        self._works[bucket.index] = self._start_collective(bucket, bucket.comm_flat)

    def _start_collective(self, bucket: Bucket, flat: torch.Tensor):
        self._bytes += flat.numel() * flat.element_size()
        if self.comm_hook is not None:
            hook, state = self.comm_hook
            return hook(state, GradBucket(bucket, flat, bucket.index == len(self.buckets) - 1))
        return dist.all_reduce(flat, group=self.group, async_op=True)

    def _apply_join_divisor(self) -> None:
        work, divide_by_initial = self.join_divisor
        self.join_divisor = None
        if not divide_by_initial:  # average over the ranks that have not joined yet
            work.wait()
            self._scale = 1.0 / float(work.result()[0].item())

    def _wait(self, bucket: Bucket, work) -> torch.Tensor | None:
        try:
            if isinstance(work, torch._C.Future):  # from a comm hook
                return hook_result(work.wait())
            if self.device.type == "cpu":
                work.wait(timeout=_timedelta(self.timeout_s))
            else:
                work.wait()  # NCCL: stream-ordered; its watchdog enforces the timeout
            return None
        except RuntimeError as exc:  # DistBackendError and gloo timeouts
            grace = min(10.0, max(2.0, 0.2 * self.timeout_s))
            raise self.diagnoser.diagnose(self.step, bucket.index, bucket.names, grace, exc) from exc

    def _finalize(self) -> None:
        """End of a synchronised backward (queued autograd callback)."""
        try:
            self.step += 1
            unused_local: dict[int, list[int]] = {}
            if self._next < len(self.buckets):
                missing = [i for i in range(len(self.params)) if not self._ready[i]]
                if not self.tolerate_unused:
                    self._drain()
                    raise UnusedParametersError([self.names[i] for i in missing], len(self.params))
                for i in missing:
                    b = self._bucket_of[i]
                    unused_local.setdefault(b, []).append(self.buckets[b].members.index(i))
                    self._pending[b] = 0
                self._launch_in_order(unused_local)
            used_work = used = None
            if self.tolerate_unused:  # after the buckets, in the same order on every rank
                used = torch.frombuffer(bytearray(self._used), dtype=torch.uint8).to(self.device, torch.int32)
                used_work = dist.all_reduce(used, group=self.group, async_op=True)
            wait_s = 0.0
            if used is None:
                # bucket by bucket: unpacking bucket k overlaps the all-reduce of the buckets after it
                for bucket, work in zip(self.buckets, self._works, strict=True):
                    start = time.perf_counter()
                    result = self._wait(bucket, work)
                    wait_s += time.perf_counter() - start
                    _finish(bucket, result, set())
            else:  # which parameters no rank used decides what .grad becomes: wait for everything first
                start = time.perf_counter()
                results = [self._wait(b, w) for b, w in zip(self.buckets, self._works, strict=True)]
                used_work.wait()
                wait_s = time.perf_counter() - start
                globally_unused = set(torch.nonzero(used == 0).flatten().tolist())
                for bucket, result in zip(self.buckets, results, strict=True):
                    _finish(bucket, result, {k for k, i in enumerate(bucket.members) if i in globally_unused})
            self.last_stats = {
                "step": self.step,
                "bytes": self._bytes + (used.numel() * 4 if used is not None else 0),
                "collectives": len(self.buckets) + (used is not None),
                "wait_s": wait_s,
                "buckets": len(self.buckets),
            }
            if self._arrival is not None:
                self._rebuild_due = True
        finally:
            self._sync = False
            self._reset()

    def _drain(self) -> None:
        """Wait for the buckets already launched, so a raised error leaves no collective in flight."""
        for bucket, work in zip(self.buckets, self._works, strict=True):
            if work is not None:
                self._wait(bucket, work)

    # ---- join: shadow the collectives of a backward on a rank that ran out of data -------------
    def shadow_backward(self, used_map: bool | None = None) -> None:
        """Issue the collectives of a synchronised backward with zero gradients (this rank joined)."""
        works = [self._start_collective(b, torch.zeros_like(b.comm_flat)) for b in self.buckets]
        for work in works:
            work.wait()
        if self.tolerate_unused if used_map is None else used_map:
            self.shadow_used_map()

    def shadow_used_map(self) -> None:
        zeros = torch.zeros(len(self.params), dtype=torch.int32, device=self.device)
        dist.all_reduce(zeros, group=self.group)


def _finish(bucket: Bucket, result: torch.Tensor | None, globally_unused: set[int]) -> None:
    """Bring a reduced bucket (a comm hook's ``result`` if any) back into ``.grad``."""
    if result is not None and result.data_ptr() != bucket.comm_flat.data_ptr():
        bucket.comm_flat.copy_(result.view(-1))
    _moves.finish_bucket(bucket, globally_unused)


def _forward_hook(on_grad: weakref.WeakMethod, i: int, param: torch.Tensor) -> None:
    method = on_grad()
    if method is not None:
        method(i, param)


def _timedelta(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)
