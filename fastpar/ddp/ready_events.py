"""Per-gradient ready events: a bucket's launch reads gradients that other streams produced only after them.

autograd runs a node's backward -- and the hook after a parameter's AccumulateGrad -- on the stream its forward
ran on, so the members of one bucket may come from several streams (a module run under ``torch.cuda.stream``, a
model spanning devices). The hook that completes a bucket packs every member from *its* current stream. Each
gradient's hook therefore records an event on its own stream (after anything it queued there, such as a copy on
arrival), and the launch makes its stream wait for every member's event whose stream is another one, and tells
the caching allocator that its stream uses the gradient (a fresh ``.grad`` is freed as soon as it is replaced by
its bucket view). The extension's hooks do the same in C++ (``ReadyEvents`` in ``csrc/ddp/bucket_launcher.cpp``).

On the CPU there are no streams: :func:`for_device` returns None and the reducer skips all of this.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .buckets import ParamSlot

__all__ = ["ReadyEvents", "for_device"]


class _TorchStreams:
    """The device's stream API, as :class:`ReadyEvents` uses it (a test passes a stand-in with the same methods)."""

    def __init__(self, device: torch.device) -> None:
        self._module = getattr(torch, device.type)
        self._device = device

    def current_stream(self):
        return self._module.current_stream(self._device)

    def new_event(self):
        return self._module.Event()

    @staticmethod
    def used_on(tensor: torch.Tensor, stream) -> None:
        tensor.record_stream(stream)


class ReadyEvents:
    """One event per parameter, recorded when its gradient is ready, waited for before its bucket is packed."""

    def __init__(self, count: int, streams) -> None:
        self._streams = streams
        self._events: list = [None] * count
        self._recorded_on: list = [None] * count

    def record(self, slot: ParamSlot) -> None:
        """In ``slot``'s hook: its gradient (and whatever the hook queued) is complete on the current stream."""
        stream = self._streams.current_stream()
        event = self._events[slot.index]
        if event is None:
            event = self._events[slot.index] = self._streams.new_event()
        event.record(stream)
        self._recorded_on[slot.index] = stream

    def wait_before_pack(self, slots: Sequence[ParamSlot]) -> None:
        """Before the current stream reads ``slots``' gradients: order it after each one's producer."""
        current = self._streams.current_stream()
        for slot in slots:
            stream = self._recorded_on[slot.index]
            if stream is None or stream == current:
                continue  # unused (nothing to wait for), or produced on this stream: already in order
            current.wait_event(self._events[slot.index])
            grad = slot.param.grad
            if grad is not None and grad is not slot.grad_view:
                self._streams.used_on(
                    grad, current
                )  # freed once .grad becomes its view, while the pack may still read it

    def clear(self) -> None:
        """A new backward: nothing recorded yet."""
        self._recorded_on = [None] * len(self._recorded_on)


def for_device(device: torch.device, count: int) -> ReadyEvents | None:
    """Ready events for ``count`` parameters on ``device``; None where work is not ordered by streams (the CPU)."""
    if device.type != "cuda":
        return None
    return ReadyEvents(count, _TorchStreams(device))
