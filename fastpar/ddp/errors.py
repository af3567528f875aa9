"""Errors that say what went wrong and what to do, instead of hangs and riddles.

A bucket whose collective does not finish within the process group's timeout is diagnosed through
the process group's store: every rank that times out posts where it is waiting, waits a short grace
period for the others, and the error names the ranks that never arrived at the same bucket.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .buckets import ParamSlot

__all__ = ["UnusedParametersError", "BucketTimeoutError", "pg_timeout_seconds", "StuckBucketDiagnoser"]


class UnusedParametersError(RuntimeError):
    """Parameters that require grad got no gradient in a synchronised backward pass."""

    def __init__(self, names: Sequence[str], total: int) -> None:
        shown = ", ".join(names[:20]) + (f", ... ({len(names) - 20} more)" if len(names) > 20 else "")
        super().__init__(
            f"fastpar DDP: {len(names)} of {total} parameters received no gradient in this backward pass: {shown}. "
            "Their buckets cannot be reduced. Either pass find_unused_parameters=True to DistributedDataParallel "
            "(if which parameters are used changes between steps), or set requires_grad=False on parameters "
            "that are never used, or make the loss depend on every output of forward()."
        )
        self.names = list(names)


class BucketTimeoutError(RuntimeError):
    """A bucket's collective did not complete: some rank never reached it."""


def pg_timeout_seconds(group: dist.ProcessGroup, device: torch.device) -> float:
    """The collective timeout of ``group`` for tensors on ``device`` (torch's default if unknown)."""
    try:
        backend = group._get_backend(torch.device(device.type))
        timeout = backend.options._timeout
        if isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0:
            return timeout.total_seconds()
    except (AttributeError, RuntimeError, ValueError):
        pass
    return dist.distributed_c10d.default_pg_timeout.total_seconds()


class StuckBucketDiagnoser:
    """Finds which ranks are missing from a bucket's collective, through the process group's store."""

    def __init__(
        self, group: dist.ProcessGroup, instance_id: int | str, collective: str = "all-reduce of gradient bucket"
    ) -> None:
        self.group = group
        self.collective = collective  # what the message says was waited for, e.g. "reduce-scatter of gradient bucket"
        self.rank = group.rank()
        self.world_size = group.size()
        self.prefix = f"fastpar_ddp/{instance_id}"

    def _store(self):
        return dist.distributed_c10d._get_process_group_store(self.group)

    def diagnose(
        self, step: int, bucket_index: int, names: Sequence[str], grace_s: float, cause: BaseException
    ) -> BucketTimeoutError:
        """Post this rank's position, wait up to ``grace_s`` for the others, and build the error. A lost connection
        (the peer's process or node is gone) waits for nobody: the others' positions are read once."""
        lost = peer_connection_lost(cause)
        grace_s = 0.0 if lost else grace_s
        where = f"step {step} bucket {bucket_index}"
        peers: dict[int, str | None] = {}
        store_problem = ""
        try:
            store = self._store()
            store.set(f"{self.prefix}/at/{self.rank}", where)
            deadline = time.monotonic() + grace_s
            others = [r for r in range(self.world_size) if r != self.rank]
            while True:
                for r in others:
                    if peers.get(r) != where and store.check([f"{self.prefix}/at/{r}"]):
                        peers[r] = store.get(f"{self.prefix}/at/{r}").decode()
                if all(peers.get(r) == where for r in others) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        except Exception as exc:  # the store lives on rank 0: it may be gone too
            store_problem = f" (the rendezvous store could not be read: {exc})"
        missing = [r for r in range(self.world_size) if r != self.rank and peers.get(r) != where]
        detail = "; ".join(
            f"rank {r} " + (f"is waiting at {peers[r]}" if peers.get(r) else "reported nothing") for r in missing
        )
        shown = ", ".join(names[:10]) + (f", ... ({len(names) - 10} more)" if len(names) > 10 else "")
        if lost:
            who = (
                "the connection to a peer was lost, so a rank's process or its node died (the underlying error names "
                f"its address; ranks not at this bucket: {missing or 'none'}){store_problem}"
            )
        elif missing:
            who = f"rank(s) {missing} never reached it ({detail}){store_problem}"
        else:
            who = f"every rank reached it, so the transport itself failed{store_problem}"
        return BucketTimeoutError(
            f"fastpar DDP: rank {self.rank} waited for the {self.collective} {bucket_index} "
            f"(step {step}; parameters {shown}) and it did not complete: {who}. A rank that skips backward(), "
            "runs a different number of steps, or runs forward under no_sync() while others do not, leaves its "
            "peers waiting; use model.join() for uneven inputs. Underlying error: "
            f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
        )


_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused")


def peer_connection_lost(cause: BaseException) -> bool:
    """Whether ``cause`` (a backend's error) says a peer's connection went away, as gloo reports a dead process."""
    return any(text in str(cause) for text in _LOST)


def received_twice(slot: ParamSlot) -> str:
    return (
        f"fastpar DDP: parameter {slot.name} received a gradient twice in one synchronised backward (a second "
        "backward over the same forward, or a parameter reused across reentrant checkpoints); run one backward per "
        "forward, wrap the extra backward in model.no_sync(), or pass static_graph=True when the graph is the same "
        "every step"
    )


def graph_changed(slot: ParamSlot) -> str:
    return (
        f"fastpar DDP: with static_graph=True, parameter {slot.name} received {slot.fires} gradient(s) in this "
        f"backward but {slot.expected_fires} in the first iteration. The training graph changed (a parameter used "
        "in some steps only, or a different number of checkpointed recomputations); static_graph needs the same "
        "graph every step: pass find_unused_parameters=True instead of static_graph=True"
    )


def launch_failed(bucket, cause: str) -> RuntimeError:
    names = ", ".join(bucket.names[:3]) + (", ..." if len(bucket.names) > 3 else "")
    return RuntimeError(
        f"fastpar DDP: the collective of bucket {bucket.index} ({names}) could not be launched: {cause}. The buckets "
        "launched before it were waited for and this backward was ended; fix the cause above and run the step again"
    )
