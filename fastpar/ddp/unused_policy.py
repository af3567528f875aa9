"""Which parameters a backward will not reach, and what that means for the buckets: ``find_unused_parameters``
(searched in the autograd graph up front), ``static_graph`` (learned in the first iteration), and the used-map
all-reduce that tells every rank which parameters no rank used (their ``.grad`` stays untouched, as in torch).
Also when torch's one rebuild (buckets in arrival order) applies. A mixin of :class:`fastpar.ddp.reducer.Reducer`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .buckets import ParamSlot


class UnusedParameterPolicy:
    """Unused parameters, static graphs and torch's rebuild rule, for :class:`~fastpar.ddp.reducer.Reducer`."""

    def _search_unused(self, _grad) -> None:
        """Parameters the running backward will not reach are ready now, so no bucket waits for them."""
        if self._searched or not self._backward.expecting:
            return
        self._searched = True
        if not self._backward.started:
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

    def _dynamic_find(self) -> bool:
        return self.find_unused and not self.static_graph

    def _static_first(self) -> bool:
        return self.static_graph and not self._static_learned

    def _should_rebuild(self) -> bool:
        return (self.static_graph or not self.find_unused) and not self.has_rebuilt

    def _recording_order(self) -> bool:
        return self._should_rebuild() and not self._static_first()

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

    def _remove_outputs_hook(self) -> None:
        if self._outputs_hook is not None:
            self._outputs_hook.remove()
            self._outputs_hook = None
