"""Construction-time checks and state sync for fastpar's DDP: argument validation with actionable
messages, the cross-rank parameter-shape check, and the list of parameters to reduce."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .buckets import DEFAULT_FIRST_BUCKET_BYTES, TORCH_BUCKET_BYTES

_MB = 1024 * 1024
GRAD_DTYPES = (None, torch.float32, torch.float16, torch.bfloat16)


def refuse_unsupported(
    delay_all_reduce_named_params, param_to_hook_all_reduce, mixed_precision, skip_all_reduce_unused_params
) -> None:
    if delay_all_reduce_named_params is not None or param_to_hook_all_reduce is not None:
        raise NotImplementedError(
            "fastpar DDP does not support delay_all_reduce_named_params/param_to_hook_all_reduce; "
            "use torch.nn.parallel.DistributedDataParallel for delayed all-reduce"
        )
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


def params_to_reduce(module: torch.nn.Module, ignore: set[str]) -> tuple[list[torch.nn.Parameter], list[str]]:
    """Parameters that require grad, deduplicated (tied weights once), in registration order."""
    params, names, seen = [], [], set()
    for name, p in module.named_parameters():  # named_parameters already skips shared duplicates
        if name in ignore or not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        params.append(p)
        names.append(name)
    if not params:
        raise RuntimeError(
            "DistributedDataParallel is not needed when a module doesn't have any parameter that requires a "
            "gradient: every parameter has requires_grad=False (or is ignored). Train at least one parameter, "
            "or call the module directly without DDP."
        )
    for name, p in zip(names, params, strict=True):
        if isinstance(p, torch.nn.parameter.UninitializedParameter):
            raise RuntimeError(
                f"Modules with uninitialized parameters can't be used with DistributedDataParallel ({name} is "
                "lazy); run a dummy forward pass to initialise them first"
            )
        if p.layout != torch.strided:
            raise NotImplementedError(f"fastpar DDP reduces dense parameters only; {name} has layout {p.layout}")
    for m_name, m in module.named_modules():
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad:
            raise NotImplementedError(
                f"fastpar DDP does not reduce sparse gradients ({m_name} has sparse=True); use sparse=False"
            )
    return params, names


def resolve_devices(params, device_ids, output_device):
    """(device_ids, output_device) as torch stores them, after checking they fit the module."""
    devices = {p.device for p in params}
    types = {d.type for d in devices}
    if len(types) != 1 or len(devices) != 1:
        raise ValueError(
            f"fastpar DDP needs every parameter on one device (CPU, or one CUDA device per process), got {devices}; "
            "move the module with module.to(device) first"
        )
    device = next(iter(devices))
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError("device_ids can only be None or contain a single element (one device per process)")
    if device.type == "cpu" or not device_ids:
        if device_ids or output_device is not None:
            raise ValueError(
                f"device_ids={device_ids} and output_device={output_device} only apply to CUDA modules, but the "
                f"module's parameters are on {device}; pass device_ids=None (or move the module to the GPU first)"
            )
        return None, None, device
    ids = [torch._utils._get_device_index(d, True) for d in device_ids]
    if ids[0] != device.index:
        raise ValueError(
            f"device_ids={list(device_ids)} but the module's parameters are on {device}; "
            f"pass device_ids=[{device.index}] or move the module to cuda:{ids[0]}"
        )
    out = torch._utils._get_device_index(output_device if output_device is not None else device_ids[0], True)
    return ids, out, device


def bucket_caps(bucket_cap_mb, bucket_cap_mb_list) -> tuple[list[int], int]:
    """Byte caps per bucket (first, then the rest) and the ``bucket_bytes_cap`` torch exposes."""
    if bucket_cap_mb_list:
        caps = [int(mb * _MB) for mb in bucket_cap_mb_list]
        return caps, max(caps)
    if bucket_cap_mb is None:  # fastpar picks the layout (buckets.auto_caps); torch's numbers for the attribute
        return [DEFAULT_FIRST_BUCKET_BYTES, TORCH_BUCKET_BYTES], TORCH_BUCKET_BYTES
    if bucket_cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
    return [int(bucket_cap_mb * _MB)], int(bucket_cap_mb * _MB)


def check_grad_dtype(grad_dtype) -> None:
    if grad_dtype not in GRAD_DTYPES:
        raise ValueError(f"grad_dtype must be None, torch.float32, torch.float16 or torch.bfloat16, got {grad_dtype}")


def verify_shapes_across_ranks(group, names: list[str], params: list[torch.Tensor]) -> None:
    """Every rank must hold the same parameters; the error names the first one that differs."""
    mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in zip(names, params, strict=True)]
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
