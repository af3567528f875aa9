"""No parameter is read while its all-gather is in flight.

After ``step()`` each bucket's updated shards travel to every rank asynchronously, writing straight into
the parameters (views of the bucket's ``param_flat``). A forward pre-hook on each module waits for the
buckets of the module's own parameters, so the gathers of later layers overlap the forward of earlier
ones. Parameters read outside their module's forward (``x @ self.lin.weight`` in a parent's forward; a
tied weight used through the other module) are found in the first forward after the optimizer is built
-- which waits for every bucket at its start -- as the parameters none of whose modules ran; later
forwards wait for their buckets at the start. At the end of every forward all gathers are waited for,
and ``state_dict()`` / ``load_state_dict()`` of any module wait for its buckets first.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence

import torch

__all__ = ["ParameterGate"]


class ParameterGate:
    def __init__(self, root: torch.nn.Module, bucket_of: dict[int, int], wait: Callable[[Sequence[int]], None]) -> None:
        """``bucket_of``: id(parameter) -> ZeRO bucket index; ``wait(indices)``: wait for those buckets' gathers."""
        self._wait = wait
        self._all = sorted(set(bucket_of.values()))
        self._owned: dict[int, list[int]] = {}  # id(module) -> buckets of its direct parameters
        self._owners: dict[int, list[int]] = {}  # id(parameter) -> ids of the modules holding it directly
        self._external: list[int] | None = None  # learned in the first forward; None: wait for all at the start
        self._called: set[int] | None = None  # modules that ran during the observed forward
        self._handles = []
        me = weakref.ref(self)
        for module in root.modules():
            own = [p for p in module._parameters.values() if p is not None and id(p) in bucket_of]
            if not own:
                continue
            self._owned[id(module)] = sorted({bucket_of[id(p)] for p in own})
            for p in own:
                self._owners.setdefault(id(p), []).append(id(module))
            call = functools.partial(_module_hook, me, id(module))
            self._handles += [
                module.register_forward_pre_hook(call, prepend=True),
                module.register_state_dict_pre_hook(call),
                module.register_load_state_dict_pre_hook(call),
            ]
        self._bucket_of = bucket_of
        self._handles += [
            root.register_forward_pre_hook(functools.partial(_root_pre_hook, me), prepend=True),
            root.register_forward_hook(functools.partial(_root_post_hook, me)),
        ]

    @property
    def external_buckets(self) -> list[int] | None:
        """Buckets waited for at the start of every forward (None until the first forward was observed)."""
        return self._external

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _enter_module(self, module_id: int) -> None:
        if self._called is not None:
            self._called.add(module_id)
        self._wait(self._owned[module_id])

    def _enter_root(self) -> None:
        if self._external is None:
            if self._called is None:
                self._called = set()
            self._wait(self._all)
        else:
            self._wait(self._external)

    def _leave_root(self) -> None:
        if self._external is None and self._called is not None:
            ran = self._called
            unread = {pid for pid, owners in self._owners.items() if not any(m in ran for m in owners)}
            self._external = sorted({self._bucket_of[pid] for pid in unread})
            self._called = None
        self._wait(self._all)


def _module_hook(gate_ref: weakref.ref, module_id: int, *_args, **_kwargs) -> None:
    gate = gate_ref()
    if gate is not None:
        gate._enter_module(module_id)


def _root_pre_hook(gate_ref: weakref.ref, *_args) -> None:
    gate = gate_ref()
    if gate is not None:
        gate._enter_root()


def _root_post_hook(gate_ref: weakref.ref, *_args) -> None:
    gate = gate_ref()
    if gate is not None:
        gate._leave_root()
