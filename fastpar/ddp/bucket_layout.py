"""The reducer's buckets: one layout at a time, changed only between steps and only through
:meth:`BucketLayout._replace_buckets` (which also makes the extension let go of the old buffers); torch's one
rebuild in gradient arrival order; the move into shared memory on the "fastpar" backend; and the one seam that
replaces every bucket's all-reduce (a bucket collective such as ZeRO's, exclusive with a comm hook). A mixin of
:class:`fastpar.ddp.reducer.Reducer`; ``bucket_cap_mb="auto"`` drives it through
:class:`~fastpar.ddp.auto_buckets.AutoBucketsHost` (``layout``, ``apply_layout``, ``rebuild_pending``,
``stop_recording``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .bucket_collective import BucketCollective
from .buckets import assign_buckets, build_buckets, initial_layout
from .errors import StuckBucketDiagnoser, pg_timeout_seconds
from .waiting import BucketWaiter


class BucketLayout:
    """The buckets of :class:`~fastpar.ddp.reducer.Reducer` and how their layout changes."""

    def _share_buckets(self) -> None:
        """Move the buckets into shared memory (the same layout; .grad views move along). Creating them is
        collective, so only where every rank is sure to be: at the end of the first synchronised backward (or at
        torch's rebuild, itself collective). Not at construction nor at a forward: a model unpickled, deep-copied
        or sampled on one rank alone, a rank-local no_sync step, must not wait for the others."""
        self._share_pending = False
        if self.bucket_collective is None:
            self._replace_buckets(
                build_buckets(self.slots, self.layout(), self.grad_views, self.grad_dtype, comm_alloc=self._comm_alloc)
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

    def _rebuild_in_arrival_order_due(self) -> bool:
        """torch's rebuild will come at the next forward (it makes the shared buffers then)."""
        return self._should_rebuild() and bool(self.rebuild_order)

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
            self._replace_buckets(
                build_buckets(self.slots, assignment, self.grad_views, self.grad_dtype, comm_alloc=self._comm_alloc)
            )

    def _replace_buckets(self, buckets: list) -> None:
        """The one place the bucket list changes (between steps). The extension lets go of the old buffers at once:
        kept until the next synchronised backward, they would double the gradient memory through no_sync steps."""
        self.buckets = buckets
        if self._native is not None and self._native_layout is not None:
            self._native.set_layout([])
            self._native_layout = None

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
        if self._backward.started:
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
        self._replace_buckets(buckets)
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
