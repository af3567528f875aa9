"""Construction-time checks for fastpar's DDP: what it refuses (with what to do instead), the cross-rank
parameter check that names the first differing parameter, and the bucket caps torch would use."""

from __future__ import annotations

import inspect
import sys

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_group
from torch.nn.parallel import DistributedDataParallel as _TorchDDP

from .buckets import DEFAULT_FIRST_BUCKET_BYTES

GRAD_DTYPES = (None, torch.float32, torch.float16, torch.bfloat16)
_PARENT_PARAMS = inspect.signature(_TorchDDP.__init__).parameters


def refuse_unsupported(mixed_precision, skip_all_reduce_unused_params) -> None:
    if mixed_precision is not None:
        raise NotImplementedError(
            "fastpar DDP does not support torch's prototype mixed_precision config; keep parameters in fp32 and "
            "pass grad_dtype=torch.bfloat16 to reduce gradients in bf16, or use torch.autocast for compute"
        )
    if skip_all_reduce_unused_params:
        raise NotImplementedError(
            "fastpar DDP does not support skip_all_reduce_unused_params=True; use find_unused_parameters=True "
            "(unused parameters keep their .grad) or set requires_grad=False on parameters that are never used"
        )


def check_grad_dtype(grad_dtype) -> None:
    if grad_dtype not in GRAD_DTYPES:
        raise ValueError(f"grad_dtype must be None, torch.float32, torch.float16 or torch.bfloat16, got {grad_dtype}")


def is_auto_cap(bucket_cap_mb, bucket_cap_mb_list) -> bool:
    """Whether ``bucket_cap_mb`` asks fastpar to choose the layout ("auto"); other values are torch's."""
    if not isinstance(bucket_cap_mb, str):
        return False
    if bucket_cap_mb != "auto":
        raise ValueError(f"bucket_cap_mb must be a number of MiB or 'auto', got {bucket_cap_mb!r}")
    if bucket_cap_mb_list:
        raise ValueError("bucket_cap_mb='auto' chooses every bucket's size; leave bucket_cap_mb_list unset")
    return True


def parent_kwargs(**kwargs) -> dict:
    """The arguments for torch's constructor; one the installed torch lacks may only hold its default.

    None means "torch's default" in fastpar's signature, so it is left out rather than passed: an older torch
    whose default is not None (``broadcast_buffers=True`` before 2.13) would otherwise store None."""
    out = {}
    for name, value in kwargs.items():
        if value is None:
            continue
        if name in _PARENT_PARAMS:
            out[name] = value
        elif value is not False:
            raise TypeError(
                f"DistributedDataParallel({name}=...) needs a newer torch than {torch.__version__}; upgrade torch "
                f"or leave {name} at its default"
            )
    return out


def resolve_group(process_group, device_mesh) -> dist.ProcessGroup:
    if process_group is not None:
        return process_group
    if device_mesh is not None:
        return device_mesh.get_group(mesh_dim=0)
    return _get_default_group()


def check_parameters(module: torch.nn.Module, parameters, expect_sparse_gradient) -> list[str]:
    """The names of ``parameters`` (torch's list for the reducer), after refusing what fastpar cannot reduce."""
    names_by_id: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names_by_id.setdefault(id(p), name)
    names = [names_by_id.get(id(p), f"parameter[{i}]") for i, p in enumerate(parameters)]
    for name, p, sparse in zip(names, parameters, expect_sparse_gradient, strict=True):
        if sparse:
            raise NotImplementedError(
                f"fastpar DDP does not reduce sparse gradients ({name} comes from an Embedding with sparse=True); "
                "use sparse=False"
            )
        if p.layout != torch.strided:
            raise NotImplementedError(f"fastpar DDP reduces dense parameters only; {name} has layout {p.layout}")
    devices = {p.device for p in parameters}
    if len(devices) > 1:
        raise ValueError(
            f"fastpar DDP needs every parameter on one device (CPU, or one CUDA device per process), got "
            f"{sorted(map(str, devices))}; move the module with module.to(device) first"
        )
    return names


def bucket_caps(ddp: _TorchDDP, parameters, static_graph: bool, world_size: int) -> tuple[list[int], list[int]]:
    """(caps for the rebuilt layout, caps for the first layout), as the installed torch computes them."""
    config = getattr(ddp, "_bucket_config", None)
    per_bucket = list(getattr(config, "per_bucket_bytes_caps", ()) or ())
    if per_bucket:
        return per_bucket, per_bucket
    cap = ddp.bucket_bytes_cap
    first = config.first_bucket_bytes_cap if config is not None else DEFAULT_FIRST_BUCKET_BYTES
    caps = [first, cap] if first < cap else [cap]
    if static_graph or not ddp.find_unused_parameters:
        return caps, [sys.maxsize]  # one bucket per dtype until the real gradient order is known
    return caps, caps


def verify_shapes_across_ranks(group: dist.ProcessGroup, module: torch.nn.Module, delay_named) -> None:
    """Every rank must hold the same parameters; the error names the first one that differs."""
    ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
    ignore |= {name for name, _ in delay_named or ()}
    mine = [
        (n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters() if n not in ignore and p.requires_grad
    ]
    everyone: list = [None] * group.size()
    dist.all_gather_object(everyone, mine, group=group)
    reference = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        for k in range(max(len(reference), len(theirs))):
            a = reference[k] if k < len(reference) else None
            b = theirs[k] if k < len(theirs) else None
            if a != b:
                raise RuntimeError(
                    f"fastpar DDP: ranks hold different models. Parameter #{k} is {_describe(a)} on rank 0 but "
                    f"{_describe(b)} on rank {rank}; build the same module (same config, same requires_grad) on "
                    "every rank before wrapping it"
                )


def _describe(entry) -> str:
    return "missing" if entry is None else f"{entry[0]} {list(entry[1])} {entry[2]}"
