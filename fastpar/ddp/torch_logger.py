"""The logger object torch's DistributedDataParallel keeps in ``self.logger``.

torch's DDP methods call a C++ ``dist.Logger`` built around the C++ Reducer; fastpar's reducer is Python,
so this class offers the same methods (the full list is checked against the installed torch in
``tests/ddp/test_ddp_dropin.py``) and fills ``_get_ddp_logging_data()`` with what fastpar knows.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch.distributed as dist

__all__ = ["DDPLogger"]


class DDPLogger:
    def __init__(self, ddp, reducer) -> None:
        self._ddp_module_name = type(ddp.module).__name__
        self._reducer = reducer
        self._strs: dict[str, str] = {}
        self._ints: dict[str, int] = {}

    # ---- what torch's DDP calls -----------------------------------------------------------------
    def set_construction_data_and_log(
        self, module_name, device_ids, output_device, broadcast_buffers, has_sync_bn, static_graph
    ) -> None:
        reducer = self._reducer
        params = [s.param for s in reducer.slots]
        group = reducer.group
        self._strs.update(
            module_name=module_name,
            device_ids=",".join(str(d) for d in device_ids),
            backend_name=dist.get_backend(group),
            dtypes=", ".join(sorted({str(p.dtype).replace("torch.", "") for p in params})),
            master_addr=os.environ.get("MASTER_ADDR", "N/A"),
            master_port=os.environ.get("MASTER_PORT", "N/A"),
            comm_hook="",
        )
        self._ints.update(
            world_size=group.size(),
            rank=group.rank(),
            output_device=output_device,
            broadcast_buffers=int(broadcast_buffers),
            has_sync_bn=int(has_sync_bn),
            bucket_cap_bytes=reducer.caps[-1],
            find_unused_parameters=int(reducer.find_unused),
            gradient_as_bucket_view=int(reducer.grad_views),
            num_parameter_tensors=len(params),
            total_parameter_size_bytes=sum(p.numel() * p.element_size() for p in params),
            is_multi_device_module=0,
            static_graph=int(static_graph),
            join_uneven_inputs=0,
            has_error=0,
        )

    def set_runtime_stats_and_log(self) -> None:
        pass  # fastpar's statistics live in DistributedDataParallel.comm_stats()

    def set_error_and_log(self, message: str) -> None:
        self._strs["error"] = str(message)
        self._ints["has_error"] = 1

    def _set_comm_hook_name(self, name: str) -> None:
        self._strs["comm_hook"] = str(name)

    def _set_uneven_input_join(self) -> None:
        self._ints["join_uneven_inputs"] = 1

    def _set_static_graph(self) -> None:
        self._ints["static_graph"] = 1

    def _get_ddp_logging_data(self) -> SimpleNamespace:
        reducer = self._reducer
        ints = dict(self._ints)
        ints.update(
            iteration=reducer.num_iterations,
            num_buckets_reduced=len(reducer.buckets),
            has_rebuilt_buckets=int(reducer.has_rebuilt),
            can_set_static_graph=int(reducer.graph_static),
        )
        strs = dict(self._strs)
        strs["bucket_sizes"] = ", ".join(str(b.nbytes) for b in reducer.buckets)
        strs["grad_dtype"] = str(reducer.grad_dtype) if reducer.grad_dtype is not None else ""
        return SimpleNamespace(strs_map=strs, ints_map=ints)
