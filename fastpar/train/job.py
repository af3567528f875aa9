"""What travels to every worker (``Job``) and how each worker rebuilds model, optimizer and DDP from it.

Workers are fresh processes (spawned by torch's elastic launcher), so everything in a ``Job`` is
pickled: models, factories, loss functions and output functions must be importable — defined at module
level, not lambdas or local functions — and the script's entry guarded by ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .._pickling import Unpicklable, dumps_naming_culprit
from ..launcher import COLLECTIVE_TIMEOUT_S
from .environment import Plan
from .options import TrainingOptions


@dataclasses.dataclass
class OptimizerSpec:
    """An optimizer given as an instance, re-created on each worker's copy of the model.

    Parameter groups are kept by the positions of their parameters in ``model.parameters()``.
    """

    cls: type
    groups: list[dict[str, Any]]  # hyperparameters, with "params" as positions into model.parameters()
    state: dict[str, Any]

    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> OptimizerSpec:
        position = {id(p): i for i, p in enumerate(model.parameters())}
        groups = []
        for group in optimizer.param_groups:
            missing = [p for p in group["params"] if id(p) not in position]
            if missing:
                raise ValueError(
                    "the optimizer holds parameters that are not the model's; build it from model.parameters() "
                    "or pass a module-level factory taking the parameters"
                )
            groups.append(
                {
                    **{k: v for k, v in group.items() if k != "params"},
                    "params": [position[id(p)] for p in group["params"]],
                }
            )
        return cls(type(optimizer), groups, optimizer.state_dict())

    def build(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        params = list(model.parameters())
        groups = [{**g, "params": [params[i] for i in g["params"]]} for g in self.groups]
        optimizer = self.cls(groups)
        optimizer.load_state_dict(self.state)
        return optimizer


@dataclasses.dataclass
class Job:
    model: torch.nn.Module | Callable[[], torch.nn.Module]
    optimizer: OptimizerSpec | Callable[[Any], torch.optim.Optimizer]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    train_data: Any
    options: TrainingOptions
    plan: Plan
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S


def private_copy(job: Job) -> Job:
    """``job`` with a model instance and an optimizer's state copied into this process's own memory. Workers the
    trainer launches receive their arguments through torch's multiprocessing pickler, which shares tensors'
    storage between the processes: every rank's optimizer would step the same parameters (twice as far per step
    with 2 processes)."""
    model = copy.deepcopy(job.model) if isinstance(job.model, torch.nn.Module) else job.model
    optimizer = job.optimizer
    if isinstance(optimizer, OptimizerSpec):
        optimizer = dataclasses.replace(optimizer, state=copy.deepcopy(optimizer.state))
    return dataclasses.replace(job, model=model, optimizer=optimizer)


def build_model(model: Any) -> torch.nn.Module:
    if isinstance(model, torch.nn.Module):
        return model
    built = model()
    if not isinstance(built, torch.nn.Module):
        raise TypeError(f"the model factory returned {type(built).__name__}, not a torch.nn.Module")
    return built


def build_optimizer(optimizer: Any, model: torch.nn.Module) -> torch.optim.Optimizer:
    if isinstance(optimizer, OptimizerSpec):
        return optimizer.build(model)
    built = optimizer(model.parameters())
    if not isinstance(built, torch.optim.Optimizer):
        raise TypeError(f"the optimizer factory returned {type(built).__name__}, not a torch.optim.Optimizer")
    return built


def ddp_choice(options: TrainingOptions) -> str:
    """ "fastpar" or "torch": which DistributedDataParallel ``options.ddp`` means here."""
    if options.ddp != "auto":
        return options.ddp
    if options.strategy in ("zero1", "zero2"):
        return "fastpar"  # ZeRO lives on fastpar's buckets (it runs without the extension too)
    from ..ops.loader import ext_status

    return "fastpar" if ext_status()["backend"] != "torch" else "torch"


def wrap_ddp(model: torch.nn.Module, options: TrainingOptions, device: torch.device) -> torch.nn.Module:
    """fastpar's or torch's DistributedDataParallel, as ``options.ddp`` asks."""
    device_ids = [device.index] if device.type == "cuda" else None
    if ddp_choice(options) == "fastpar":
        from ..ddp import DistributedDataParallel

        return DistributedDataParallel(
            model,
            device_ids=device_ids,
            grad_dtype=options.grad_dtype,
            find_unused_parameters=options.find_unused_parameters,
        )
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=device_ids, find_unused_parameters=options.find_unused_parameters
    )
    if options.grad_dtype in (torch.bfloat16, torch.float16):  # torch's way: a compression comm hook
        ddp.register_comm_hook(options.grad_dtype, _compress_hook)
    return ddp


def _compress_hook(dtype, bucket):  # no annotations: torch checks them against its own types
    """torch's fp16/bf16_compress_hook (cast, divide, all-reduce, cast back), for any backend: torch's own
    bf16 hook refuses gloo ("requires CUDA 11+ and NCCL 2.10+") although gloo reduces bf16 fine."""
    buffer = bucket.buffer()
    compressed = buffer.to(dtype).div_(dist.get_world_size())
    future = dist.all_reduce(compressed, async_op=True).get_future()

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return future.then(decompress)


def check_picklable(job: Job) -> None:
    """Raise TypeError naming the argument that can't be sent to worker processes, and how to fix it."""
    parts = {
        "model": job.model,
        "optimizer": job.optimizer,
        "loss_fn": job.loss_fn,
        "train_data": job.train_data,
        "options.validation_data": job.options.validation_data,
        "options.output_fns": list(job.options.output_fns),
        "options.lr_scheduler": job.options.lr_scheduler,
    }
    try:
        dumps_naming_culprit(job, parts.items(), default="an argument")
        return
    except Unpicklable as exc:
        culprit, error = exc.culprit, exc.error
    raise TypeError(
        f"fastpar.Trainer: {culprit} can't be sent to the worker processes ({type(error).__name__}: {error}). "
        "Workers are separate processes: define models, factories, loss and output functions at module level "
        "of an importable module (no lambdas, local functions or classes defined inside functions), and guard "
        "the script's entry with `if __name__ == '__main__':`."
    ) from error
