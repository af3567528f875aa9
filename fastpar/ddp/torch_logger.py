"""The logger object torch's DistributedDataParallel keeps in ``self.logger``, and the timer it reads.

torch's DDP methods call a C++ ``dist.Logger`` built around the C++ Reducer; fastpar's reducer is Python,
so this class offers the same methods (the full list is checked against the installed torch in
``tests/ddp/test_ddp_dropin.py``) and fills ``_get_ddp_logging_data()`` as torch's does (compared with torch's in
``tests/ddp/test_ddp_logging.py``): construction data and environment, and at sampled iterations (the first 10,
then every ``sample_rate``-th) the previous iteration's runtime statistics from :class:`RuntimeTimer`.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

__all__ = ["DDPLogger", "RuntimeTimer", "should_collect_runtime_stats"]

DEFAULT_SAMPLE_RATE = 100  # torch's kDDPRuntimeLoggingSampleRate
_ALWAYS_SAMPLED = 10  # the first iterations are always sampled
# c10's type names, which torch's logger writes in "dtypes"
_TYPE_NAMES = {
    torch.float32: "float",
    torch.float64: "double",
    torch.float16: "c10::Half",
    torch.bfloat16: "c10::BFloat16",
    torch.complex64: "c10::complex<float>",
    torch.complex128: "c10::complex<double>",
}
# (average, last duration, start event, end event), as torch's Logger::set_runtime_stats_and_log
_DURATIONS = (
    ("avg_forward_compute_time", "forward_compute_time", "forward_start", "backward_compute_start"),
    ("avg_backward_compute_time", "backward_compute_time", "backward_compute_start", "backward_compute_end"),
    ("avg_backward_comm_time", "backward_comm_time", "backward_comm_start", "backward_comm_end"),
    (
        "avg_backward_compute_comm_overlap_time",
        "backward_compute_comm_overlap_time",
        "backward_comm_start",
        "backward_compute_end",
    ),
)
_TIMESTAMPS = {
    "forward_compute_time_start": "forward_start",
    "backward_compute_time_start": "backward_compute_start",
    "backward_compute_time_end": "backward_compute_end",
    "backward_comm_time_start": "backward_comm_start",
    "backward_comm_time_end": "backward_comm_end",
}


def should_collect_runtime_stats(iteration: int, sample_rate: int) -> bool:
    """Whether synchronised iteration ``iteration`` (1-based) is timed: the first 10, then every ``sample_rate``-th."""
    return iteration > 0 and (iteration <= _ALWAYS_SAMPLED or iteration % sample_rate == 0)


class RuntimeTimer:
    """torch's reducer Timer: when each event of a sampled iteration happened ("forward_start",
    "backward_compute_start", "backward_compute_end", "backward_comm_start", "backward_comm_end"). Host timestamps
    are nanoseconds since the epoch (torch's ``c10::getTime``); on CUDA, durations come from CUDA events on the
    current stream."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self.host_ns: dict[str, int] = {}
        self._cuda_events: dict[str, torch.cuda.Event] = {}

    def record(self, event: str) -> None:
        self.host_ns[event] = time.time_ns()
        if self._cuda:
            if event not in self._cuda_events:
                self._cuda_events[event] = torch.cuda.Event(enable_timing=True)
            self._cuda_events[event].record()

    def difference_ns(self, start: str, end: str) -> int | None:
        """Nanoseconds from ``start`` to ``end``: None when ``start`` was never recorded; 0 when ``end`` came first
        (on CPU, as torch's: the static graph's first reduction starts communicating after its compute ended); on
        CUDA None then."""
        if self._cuda:
            first, last = self._cuda_events.get(start), self._cuda_events.get(end)
            if first is None or last is None:
                return None
            first.synchronize()  # CPU-GPU sync point: at a sampled forward only, as torch's
            last.synchronize()
            ms = first.elapsed_time(last)
            return None if ms < 0 else int(ms * 1e6)
        first = self.host_ns.get(start)
        if first is None:
            return None
        return max(0, self.host_ns.get(end, -1) - first)


class DDPLogger:
    def __init__(self, ddp, reducer) -> None:
        self._ddp_module_name = type(ddp.module).__name__
        self._reducer = reducer
        self._strs: dict[str, str] = {}
        self._ints: dict[str, int] = {}
        self._samples = 0  # sampled iterations so far (torch's num_iterations_stats_recorded_)
        self._graph_logged = False

    # ---- what torch's DDP calls -----------------------------------------------------------------
    def set_construction_data_and_log(
        self, module_name, device_ids, output_device, broadcast_buffers, has_sync_bn, static_graph
    ) -> None:
        reducer = self._reducer
        params = [s.param for s in reducer.slots]
        group = reducer.group
        backend = dist.get_backend(group)
        self._strs.update(
            module_name=module_name,
            device_ids=",".join(str(d) for d in device_ids),
            backend_name=backend,
            dtypes=", ".join(sorted({_TYPE_NAMES.get(p.dtype, str(p.dtype).replace("torch.", "")) for p in params})),
            bucket_sizes=", ".join(str(b.nbytes) for b in reducer.buckets),
            master_addr=os.environ.get("MASTER_ADDR", "N/A"),
            master_port=os.environ.get("MASTER_PORT", "N/A"),
            torch_distributed_debug=os.environ.get("TORCH_DISTRIBUTED_DEBUG", "N/A"),
            cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES", "N/A"),
        )
        if reducer.grad_dtype is not None:  # fastpar's own option
            self._strs["grad_dtype"] = str(reducer.grad_dtype)
        self._ints.update(
            world_size=group.size(),
            rank=group.rank(),
            iteration=0,
            output_device=output_device,
            broadcast_buffers=int(broadcast_buffers),
            has_sync_bn=int(has_sync_bn),
            bucket_cap_bytes=reducer.caps[-1],
            find_unused_parameters=int(reducer.find_unused),
            gradient_as_bucket_view=int(reducer.grad_views),
            num_parameter_tensors=len(params),
            total_parameter_size_bytes=sum(p.numel() * p.element_size() for p in params),
            is_multi_device_module=0,
        )
        if backend == "gloo":
            self._strs["gloo_socket_ifname"] = os.environ.get("GLOO_SOCKET_IFNAME", "N/A")
            self._strs["gloo_device_transport"] = os.environ.get("GLOO_DEVICE_TRANSPORT", "N/A")
            threads = _gloo_threads(group)
            if threads is not None:
                self._ints["gloo_num_threads"] = threads
        elif backend == "nccl":
            for key, var in (
                ("nccl_socket_ifname", "NCCL_SOCKET_IFNAME"),
                ("nccl_blocking_wait", "TORCH_NCCL_BLOCKING_WAIT"),
                ("nccl_async_error_handling", "TORCH_NCCL_ASYNC_ERROR_HANDLING"),
                ("nccl_debug", "NCCL_DEBUG"),
                ("nccl_nthreads", "NCCL_NTHREADS"),
                ("nccl_ib_timeout", "NCCL_IB_TIMEOUT"),
            ):
                self._strs[key] = os.environ.get(var, "N/A")

    def set_runtime_stats_and_log(self) -> None:
        """At the start of a synchronised forward: if the previous iteration was sampled, its statistics."""
        reducer = self._reducer
        if not should_collect_runtime_stats(reducer.num_iterations, reducer.runtime_sample_rate):
            return
        self._samples += 1
        ints, strs = self._ints, self._strs
        ints["iteration"] = reducer.num_iterations
        ints["num_buckets_reduced"] = reducer.buckets_reduced
        ints["unused_parameter_size"] = sum(
            reducer.slots[i].numel * reducer.slots[i].param.element_size() for i in reducer.unused_parameters
        )
        if ints.setdefault("has_rebuilt_buckets", 0) != int(reducer.has_rebuilt):  # set once, after the rebuild
            ints["has_rebuilt_buckets"] = int(reducer.has_rebuilt)
            if reducer.has_rebuilt:
                strs["rebuilt_bucket_sizes"] = ", ".join(str(b.nbytes) for b in reducer.buckets)
                strs["rebuilt_per_bucket_param_indices"] = ", ".join(
                    " ".join(str(i) for i in bucket) for bucket in reducer.layout()
                )
        if reducer.grad_ready_order:  # of the previous backward: this runs in the next forward
            strs["prev_iteration_grad_ready_order_indices"] = ", ".join(str(i) for i in reducer.grad_ready_order)
        timer = reducer.runtime_timer
        for average, duration, start, end in _DURATIONS:
            ints[duration] = 0
            measured = timer.difference_ns(start, end)
            if measured is not None:  # torch's integer running mean over the sampled iterations
                ints[duration] = measured
                ints[average] = (measured + ints.get(average, 0) * (self._samples - 1)) // self._samples
        for key, event in _TIMESTAMPS.items():
            ints[key] = timer.host_ns.get(event, 0)

    def log_if_graph_static(self, is_static: bool) -> None:
        """Once: whether the set of unused parameters stayed the same (torch logs False when it first changes, and
        True at teardown, which no one reads; "can_set_static_graph" is absent until then)."""
        if not self._graph_logged:
            self._graph_logged = True
            self._ints["can_set_static_graph"] = int(is_static)
            self._ints["iteration"] = self._reducer.num_iterations

    def set_error_and_log(self, message: str) -> None:
        self._strs["error"] = str(message)
        self._ints["has_error"] = 1
        self._ints["iteration"] = self._reducer.num_iterations

    def _set_comm_hook_name(self, name: str) -> None:
        self._strs["comm_hook"] = str(name)

    def _set_uneven_input_join(self) -> None:
        self._ints["join_uneven_inputs"] = 1

    def _set_static_graph(self) -> None:
        self._ints["static_graph"] = 1

    def _get_ddp_logging_data(self) -> SimpleNamespace:
        return SimpleNamespace(strs_map=dict(self._strs), ints_map=dict(self._ints))


def _gloo_threads(group: dist.ProcessGroup) -> int | None:
    try:
        return int(group._get_backend(torch.device("cpu")).options._threads)
    except (AttributeError, RuntimeError, TypeError):  # not a plain gloo group on this torch
        return None
