"""The training-step variants ``fastpar bench ddp`` times: how each one wraps the model, on which wire, and its step.

A variant's name is its wrapping; the suffix ``_gloo`` puts the same wrapping on a gloo group over the same ranks
(``--backend fastpar`` only), so one run times every wrapper on both wires:

  no_comm           the bare model, no DDP: the floor
  no_overlap        no DDP during backward; after it, one ``torch.cat`` of every gradient (times 1/world, as
                    torch's reducer scales), one all-reduce, and a copy back: what overlap has to beat
  ddp               torch DistributedDataParallel with its defaults: the peer
  ddp_bucket_view   gradient_as_bucket_view=True
  ddp_batched_copy  batched_grad_copy=True (only when the installed torch has it)
  ddp_fastpar_cap   torch DDP with bucket_cap_mb set to the cap fastpar chooses for this model
  ddp_view_cap      gradient_as_bucket_view=True and fastpar's cap
  ddp_fp16_hook     torch DDP + fp16_compress_hook
  fastpar_fp32      fastpar.DistributedDataParallel
  fastpar_bf16      fastpar.DistributedDataParallel(grad_dtype=torch.bfloat16)
  fastpar_cap_<C>   fastpar.DistributedDataParallel(bucket_cap_mb=C), C = 1, 4, 25
  fastpar_auto      fastpar.DistributedDataParallel(bucket_cap_mb="auto"), settled before timing
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from .training_step import MODELS as ALL_MODELS
from .training_step import build_model

MODELS = {name: ALL_MODELS[name] for name in ("mlp", "blocks")}
NICKNAMES = {"mlp": "wide", "blocks": "deep"}
VARIANTS = (
    "no_comm",
    "no_overlap",
    "ddp",
    "ddp_bucket_view",
    "ddp_batched_copy",
    "ddp_fastpar_cap",
    "ddp_view_cap",
    "ddp_fp16_hook",
    "fastpar_fp32",
    "fastpar_bf16",
    "fastpar_cap_1",
    "fastpar_cap_4",
    "fastpar_cap_25",
    "fastpar_auto",
)
GLOO = "_gloo"  # suffix: the same wrapping on the gloo group (--backend fastpar)
# The fp32 wrappers compared on both wires (the low-precision and cap-sweep variants run on the main wire only).
TWINNED = (
    "no_overlap",
    "ddp",
    "ddp_bucket_view",
    "ddp_batched_copy",
    "ddp_fastpar_cap",
    "ddp_view_cap",
    "fastpar_fp32",
)
LOW_PRECISION = ("ddp_fp16_hook", "fastpar_bf16")
FIXED_CAPS = ("fastpar_cap_1", "fastpar_cap_4", "fastpar_cap_25")
AUTO_SETTLE_MAX_STEPS = 60


def base_of(variant: str) -> str:
    """The wrapping of a variant name (``ddp_bucket_view_gloo`` -> ``ddp_bucket_view``)."""
    return variant.removesuffix(GLOO)


def on_gloo_twin(variant: str) -> bool:
    return variant.endswith(GLOO)


def available_variants() -> tuple[list[str], list[str]]:
    """Variants this installation can run, and a note for each one it cannot."""
    from torch.nn.parallel import DistributedDataParallel

    names, notes = list(VARIANTS), []
    if "batched_grad_copy" not in inspect.signature(DistributedDataParallel.__init__).parameters:
        names.remove("ddp_batched_copy")
        notes.append(f"ddp_batched_copy skipped: torch {torch.__version__} DDP has no batched_grad_copy")
    try:
        importlib.import_module("fastpar.ddp").DistributedDataParallel  # noqa: B018
    except (ImportError, AttributeError) as exc:
        names = [n for n in names if not n.startswith("fastpar")]
        notes.append(f"fastpar_fp32/fastpar_bf16 skipped: fastpar.DistributedDataParallel is not available ({exc})")
    return names, notes


def fastpar_cap_mb(model: nn.Module, group=None) -> float:
    """The bucket cap (MB) fastpar's DDP picks for ``model`` on ``group`` (None: the default group) when given
    none."""
    from ...comm import shared_buffers
    from ...ddp.buckets import default_caps

    params = [p for p in model.parameters() if p.requires_grad]
    shared = bool(params) and params[0].device.type == "cpu" and shared_buffers.available(group)
    return default_caps(params, dist.get_world_size(group), shared_buckets=shared)[-1] / 2**20


class NoOverlap:
    """All gradients after backward, in one all-reduce: cat, scale by 1/world (torch's reducer's arithmetic),
    all-reduce, copy back."""

    def __init__(self, model: nn.Module, group=None) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.group = group
        self.scale = 1.0 / dist.get_world_size(group)

    @torch.no_grad()
    def __call__(self) -> None:
        grads = [p.grad for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads]).mul_(self.scale)
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def wrap(variant: str, model: nn.Module, group=None) -> nn.Module:
    """``model`` wrapped as ``variant`` (its base name) on ``group`` (None: the default group); a CUDA model gets
    its device id."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    device_ids = [next(model.parameters()).device.index] if next(model.parameters()).is_cuda else None
    torch_ddp = dict(device_ids=device_ids, process_group=group)
    if variant in ("no_comm", "no_overlap"):
        return model
    if variant == "ddp":
        return TorchDDP(model, **torch_ddp)
    if variant == "ddp_bucket_view":
        return TorchDDP(model, gradient_as_bucket_view=True, **torch_ddp)
    if variant == "ddp_batched_copy":
        return TorchDDP(model, batched_grad_copy=True, **torch_ddp)
    if variant == "ddp_fastpar_cap":
        return TorchDDP(model, bucket_cap_mb=fastpar_cap_mb(model, group), **torch_ddp)
    if variant == "ddp_view_cap":
        return TorchDDP(model, bucket_cap_mb=fastpar_cap_mb(model, group), gradient_as_bucket_view=True, **torch_ddp)
    if variant == "ddp_fp16_hook":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

        wrapped = TorchDDP(model, **torch_ddp)
        wrapped.register_comm_hook(group, fp16_compress_hook)
        return wrapped
    from ...ddp import DistributedDataParallel as FastparDDP

    fastpar_ddp = dict(device_ids=device_ids, process_group=group)
    if variant == "fastpar_fp32":
        return FastparDDP(model, **fastpar_ddp)
    if variant == "fastpar_bf16":
        return FastparDDP(model, grad_dtype=torch.bfloat16, **fastpar_ddp)
    if variant.startswith("fastpar_cap_"):
        return FastparDDP(model, bucket_cap_mb=float(variant.removeprefix("fastpar_cap_")), **fastpar_ddp)
    if variant == "fastpar_auto":
        return FastparDDP(model, bucket_cap_mb="auto", **fastpar_ddp)
    raise ValueError(f"unknown variant {variant!r}")


class Trainee:
    """One variant's model, optimizer and step: ``zero_grad(set_to_none=True)`` + forward + backward (+ the
    no-overlap all-reduce) + SGD step, loss ``out.square().mean()``."""

    def __init__(self, variant: str, model_name: str, device: torch.device, lr: float, gloo_group=None) -> None:
        group = gloo_group if on_gloo_twin(variant) else None
        base = base_of(variant)
        self.model = wrap(base, build_model(model_name).to(device), group)
        self.after_backward = NoOverlap(self.model, group) if base == "no_overlap" else None
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)

    def step(self, x: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.model(x).square().mean().backward()
        if self.after_backward is not None:
            self.after_backward()
        self.optimizer.step()

    def settle(self, x: torch.Tensor) -> int:
        """With bucket_cap_mb="auto": train on ``x`` until the layout is decided; returns the steps taken."""
        auto = getattr(getattr(self.model, "reducer", None), "auto", None)
        steps = 0
        while auto is not None and auto.phase not in ("done", "off") and steps < AUTO_SETTLE_MAX_STEPS:
            self.step(x)
            steps += 1
        return steps

    def flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])


def step_call(rank: int, world_size: int, variant: str, model_name: str, batch: int = 64) -> Callable[[], None]:
    """One rank's training step of ``variant`` on CPU, default group only (for ``fastpar.bench.peers``)."""
    trainee = Trainee(variant, model_name, torch.device("cpu"), lr=0.01)
    x = torch.randn(batch, MODELS[model_name][0], generator=torch.Generator().manual_seed(100 + rank))
    trainee.settle(x)
    return lambda: trainee.step(x)
