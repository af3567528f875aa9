"""The reducer's side of the extension's hooks (``fastpar._C.BucketLauncher``, :mod:`fastpar.ddp.extension_hooks`).

In the common mode the C++ hooks mark gradients ready, count buckets down and launch them; Python hears once per
backward (:meth:`ExtensionBridge._native_started`), once per launch (:meth:`ExtensionBridge._native_launched`), on
an error, and pulls the per-parameter progress when an error needs names. A mixin of
:class:`fastpar.ddp.reducer.Reducer`.
"""

from __future__ import annotations

import functools
import weakref

import torch

from . import extension_hooks
from ._weak_hooks import call_weakly, grad_hook
from .backward_state import BackwardState
from .errors import (
    launch_failed,
    received_twice,
)

_queue_callback = torch.autograd.Variable._execution_engine.queue_callback


class ExtensionBridge:
    """The extension's callbacks and the switch between C++ and Python hooks, for :class:`~fastpar.ddp.reducer.Reducer`."""

    def _attach_hooks(self) -> None:
        """One hook per parameter: from C++ when the extension serves the device, else the Python hook."""
        me = weakref.ref(self)  # hooks must not keep a dropped wrapper alive
        params = [s.param for s in self.slots]
        self._native = extension_hooks.attach(
            params,
            self.group,
            functools.partial(call_weakly, weakref.WeakMethod(self._autograd_hook), None),
            functools.partial(call_weakly, weakref.WeakMethod(self._native_started), None),
            functools.partial(call_weakly, weakref.WeakMethod(self._native_launched), None),
            functools.partial(call_weakly, weakref.WeakMethod(self._native_twice), None),
            functools.partial(call_weakly, weakref.WeakMethod(self._native_launch_failed), None),
        )
        self._native_layout = None
        if self._native is None:
            self._handles = [
                p.register_post_accumulate_grad_hook(functools.partial(grad_hook, me, i)) for i, p in enumerate(params)
            ]

    def _hooks_in_extension(self) -> bool:
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
            self._native.set_layout(extension_hooks.layout(self.buckets))
            self._native_layout = self.buckets
        alias_divisor = self._divisor if self.alias_divides else 0
        self._native.arm(self._scale, alias_divisor, -1 if self._arrival_min is None else self._arrival_min)
        self._native_armed, self._native_pulled = True, False

    def _native_started(self) -> None:
        """The extension's first gradient of a backward (or the first after a nested backward ended)."""
        if not self._backward.started:
            self._start_backward()
        elif not self._end_check_queued and not self._backward.finishing:
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
        if self._next == len(self.buckets) and not self._backward.finishing:
            self._backward.to(BackwardState.FINISHING)
            _queue_callback(self._backward_computed)
        if self.finishing.finished < first:
            self._finish_early()

    def _native_launch_failed(self, index: int, message: str) -> None:
        """The extension could not launch bucket ``index`` (the ones before it went out and were handed over)."""
        self._pull_native()
        self._fail(launch_failed(self.buckets[index], message), abort=True)

    def _native_twice(self, index: int) -> None:
        self._pull_native()
        slot = self.slots[index]
        slot.fires = 2
        self._fail(RuntimeError(received_twice(slot)), abort=True)

    def _take_native_arrivals(self) -> None:
        """The arrival order where the Python hook records it: for torch's rebuild (before it) and a sampled
        iteration's logging."""
        if self._backward.started and ((not self.has_rebuilt and self._recording_order()) or self._sampled):
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
