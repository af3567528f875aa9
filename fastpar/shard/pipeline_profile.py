"""The layers of a model to pipeline, and what each one costs on a microbatch.

A model can be pipelined when it is an ordered sequence of layers, each taking the previous layer's single
output tensor. :func:`model_layers` accepts exactly:

- an ``nn.Sequential`` (or ``nn.ModuleList``): its children, in order;
- any other ``nn.Module`` whose ``forward`` applies its children in registration order, one after the other
  (``embed``, ``blocks``, ``head``). A child that is an ``nn.ModuleList`` counts as its entries, so
  ``self.blocks = nn.ModuleList(...)`` contributes ``blocks.0``, ``blocks.1``, ... as separate layers. Whether
  ``forward`` really is that chain cannot be read from the code; :func:`profile_layers` runs both on the
  example microbatch and refuses the model when the outputs differ.

Each layer keeps its state-dict name (``"3"``, ``"blocks.3"``, ``"head"``), so a stage's ``state_dict()`` keys
are the original model's keys for its layers.

:func:`profile_layers` measures every layer on a copy (the user's layers and their gradients are never touched,
and the random number generators are restored afterwards, so measuring changes no result): the forward +
backward time of one microbatch, the bytes of its parameters, the bytes autograd saves for its backward (the
activations a stage keeps per microbatch in flight), and its output's shape and dtype (what the stage after a
split point receives).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
from torch import nn

from ..tensor_storage import StorageCounter, storage_bytes
from ..user_errors import UserError

HOW_TO_EXPRESS = (
    "express the model as an nn.Sequential of its layers (e.g. nn.Sequential(embed, *blocks, head)), each "
    "taking the previous layer's output tensor"
)


class PipelineConfigError(UserError, ValueError):
    """A pipeline that cannot be built as asked; the message says what to change. Raised before the first step."""


@dataclass(frozen=True)
class ModelLayers:
    """The layers of a model in the order its forward applies them, with their state-dict names."""

    names: tuple[str, ...]
    modules: tuple[nn.Module, ...]
    is_sequential: bool  # nn.Sequential/nn.ModuleList: the chain is the forward by construction

    def __len__(self) -> int:
        return len(self.modules)


@dataclass(frozen=True)
class LayerCost:
    """One layer measured on one microbatch."""

    name: str
    seconds: float  # forward + backward, the fastest of the repeats
    param_bytes: int
    activation_bytes: int  # tensors autograd saves for backward (parameters excluded)
    output_shape: tuple[int, ...]
    output_dtype: torch.dtype


def model_layers(model: nn.Module) -> ModelLayers:
    """The layers of ``model`` (module docstring says what is accepted). Raises :class:`PipelineConfigError`."""
    if not isinstance(model, nn.Module):
        raise PipelineConfigError(f"pipeline_model needs an nn.Module, got {type(model).__name__}; {HOW_TO_EXPRESS}")
    names: list[str] = []
    modules: list[nn.Module] = []
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList) and not isinstance(model, nn.ModuleList):
            for index, entry in child.named_children():
                names.append(f"{name}.{index}")
                modules.append(entry)
        else:
            names.append(name)
            modules.append(child)
    if not modules:
        raise PipelineConfigError(f"{type(model).__name__} has no child modules to split into stages; {HOW_TO_EXPRESS}")
    owned = {id(p) for m in modules for p in m.parameters()}
    outside = [n for n, p in model.named_parameters(recurse=False) if id(p) not in owned]
    if outside:
        raise PipelineConfigError(
            f"{type(model).__name__} holds parameters outside its child modules ({', '.join(outside)}), which no "
            f"stage would own; move them into a layer and {HOW_TO_EXPRESS}"
        )
    return ModelLayers(tuple(names), tuple(modules), isinstance(model, nn.Sequential | nn.ModuleList))


def microbatch_of(example_input: torch.Tensor, microbatches: int) -> torch.Tensor:
    """The first microbatch of a batch, as the pipeline schedule splits it (dim 0, ``tensor_split``)."""
    return example_input.tensor_split(microbatches, dim=0)[0]


def _saved_activation_bytes(layer: nn.Module, inputs: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(output, bytes of the non-parameter tensors autograd saved in the forward), each storage counted once."""
    counter = StorageCounter(exclude=layer.parameters())
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        if t.device.type != "meta":
            saved += counter.count([t])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(inputs)
    return out, saved


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # GPU kernels are asynchronous: time them to completion


def _time_forward_backward(layer: nn.Module, inputs: torch.Tensor, device: torch.device, repeats: int) -> float:
    best = float("inf")
    for attempt in range(repeats + 1):  # the first run warms caches and allocators: not counted
        layer.zero_grad(set_to_none=True)
        _synchronize(device)
        start = time.perf_counter()
        out = layer(inputs)
        if out.requires_grad:
            out.backward(torch.ones_like(out))
        _synchronize(device)
        if attempt:
            best = min(best, time.perf_counter() - start)
    return best


def _forward_is_the_chain(model: nn.Module, layers: ModelLayers, microbatch: torch.Tensor) -> str:
    """'' when ``model(x)`` equals applying ``layers`` in order to ``x``; else what differs."""
    param = next(model.parameters(), None)
    x = microbatch.to(param.device) if param is not None else microbatch
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        seed = torch.initial_seed()
        torch.manual_seed(seed)
        expected = model(x)
        torch.manual_seed(seed)  # the same draws for the chain as for the forward
        out = x
        for layer in layers.modules:
            out = layer(out)
    if not isinstance(expected, torch.Tensor):
        return f"its forward returns {type(expected).__name__}, not a tensor"
    if out.shape != expected.shape or not torch.allclose(out, expected, rtol=1e-4, atol=1e-6):
        return f"its forward is not its layers ({', '.join(layers.names)}) applied in order"
    return ""


def profile_layers(
    model: nn.Module, layers: ModelLayers, microbatch: torch.Tensor, device: torch.device, repeats: int = 3
) -> list[LayerCost]:
    """Measure every layer of ``layers`` on ``microbatch`` (module docstring). Raises
    :class:`PipelineConfigError` when the model is not the chain of its layers or a layer's output is not one
    tensor."""
    devices = [device] if device.type == "cuda" else []
    costs: list[LayerCost] = []
    with torch.random.fork_rng(devices=devices):  # dropout etc. draw numbers here: the run's stream is unchanged
        if not layers.is_sequential:
            why = _forward_is_the_chain(model, layers, microbatch)
            if why:
                raise PipelineConfigError(
                    f"{type(model).__name__} cannot be split into stages: {why}; {HOW_TO_EXPRESS}"
                )
        x = microbatch.to(device)
        for name, layer in zip(layers.names, layers.modules, strict=True):
            measured = copy.deepcopy(layer).to(device)
            inputs = x.detach().requires_grad_(x.is_floating_point())
            out, activation_bytes = _saved_activation_bytes(measured, inputs)
            if not isinstance(out, torch.Tensor):
                raise PipelineConfigError(
                    f"layer {name!r} ({type(layer).__name__}) returns {type(out).__name__}; every layer must return "
                    f"one tensor for the next: {HOW_TO_EXPRESS}"
                )
            seconds = _time_forward_backward(measured, inputs, device, repeats)
            costs.append(
                LayerCost(
                    name=name,
                    seconds=seconds,
                    param_bytes=storage_bytes(layer.parameters()),  # a parameter shared by two layers once
                    activation_bytes=activation_bytes,
                    output_shape=tuple(out.shape),
                    output_dtype=out.dtype,
                )
            )
            x = out.detach()
            del measured, out
    return costs
