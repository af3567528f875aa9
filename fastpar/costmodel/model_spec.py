"""The model a plan is for: an importable constructor, a reference transformer by its sizes, or a built module.

A :class:`ModelSpec` builds its model on the meta device (shapes without memory) to count parameters, and
on a real device only when the planner measures activations and compute. It also names the model's
*layers* -- the pieces FSDP2 wraps as units and pipeline stages are cut from: the leaves of the module
tree after expanding containers (``ModuleList``, ``Sequential``, ``ModuleDict``) and modules whose only
job is to hold others, in forward order as registered. Parameters held by no layer (set on a container
itself) form a ``"<root>"`` layer.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..user_errors import UserError
from .reference_transformer import ReferenceTransformer, TransformerConfig

__all__ = ["Layer", "ModelSpec", "model_layers"]

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


@dataclass(frozen=True)
class Layer:
    """One piece of the model: its qualified name, parameter count and whether it is one of a repeated stack
    (a ``ModuleList``/``Sequential`` element: a transformer block), which FSDP2 wraps as its own unit."""

    name: str
    numel: int
    repeated: bool
    param_shapes: tuple[tuple[int, ...], ...]  # in parameter order: FSDP2 pads each one's dim 0 to the world size


def model_layers(module: nn.Module) -> list[tuple[str, nn.Module | None, bool]]:
    """``(name, module, repeated)`` for each layer of ``module`` (see the module docstring); the root layer's
    module is None (its parameters are those directly on containers)."""
    layers: list[tuple[str, nn.Module | None, bool]] = []
    # the root, and a module wrapping it alone (the Trainer's loss wrapper around the model, or a model that is
    # one submodule and a loss), are opened whatever their forward: their layers are the model's
    roots, top = {id(module)}, module
    while len(list(top.children())) == 1 and not list(top.parameters(recurse=False)):
        top = next(top.children())
        roots.add(id(top))

    def visit(prefix: str, m: nn.Module, repeated: bool) -> None:
        children = list(m.named_children())
        own = list(m.named_parameters(recurse=False))
        holds_only = children and not own and type(m).forward is nn.Module.forward  # a plain holder of modules
        if isinstance(m, _CONTAINERS) or holds_only or (id(m) in roots and children and not own):
            in_stack = isinstance(m, (nn.ModuleList, nn.Sequential))
            for name, child in children:
                visit(f"{prefix}.{name}" if prefix else name, child, in_stack)
        else:
            layers.append((prefix or "<model>", m, repeated))

    visit("", module, False)
    return layers


def _layer_records(module: nn.Module) -> list[Layer]:
    records = []
    owned: set[int] = set()
    for name, m, repeated in model_layers(module):
        params = [p for p in m.parameters() if id(p) not in owned]  # a parameter shared by two layers counts once
        owned.update(id(p) for p in params)
        records.append(Layer(name, sum(p.numel() for p in params), repeated, tuple(tuple(p.shape) for p in params)))
    rest = [p for p in module.parameters() if id(p) not in owned]
    if rest:
        records.append(Layer("<root>", sum(p.numel() for p in rest), False, tuple(tuple(p.shape) for p in rest)))
    return records


@dataclass
class ModelSpec:
    """How to build the model, and how to make a batch for it.

    ``constructor``: a callable returning the module (built under ``torch.device(...)``, so a constructor
    that allocates with the default device builds on the meta device for counting). ``example_input``:
    ``(batch_size, seq_len | None, device) -> input``; None uses the module's own ``example_batch``
    method when it has one. ``seq_len``: the sequence length the model is trained at (None: not a
    sequence model). ``describe``: how the model was named (shown in the plan)."""

    constructor: Callable[[], nn.Module]
    describe: str
    example_input: Callable[[int, int | None, Any], Any] | None = None
    seq_len: int | None = None
    loss: Callable[[Any, Any], torch.Tensor] | None = None
    fixed_batch: int | None = None  # from_module: the given batch's size, the only one it can make
    input_shape: tuple[int, ...] | None = None  # from_path's one-sample input shape, when given
    # every activation quadratic in the length comes from scaled_dot_product_attention, which GPUs run with
    # flash/memory-efficient kernels that keep none (the meta device runs the math path, which keeps L x L)
    quadratic_is_sdpa: bool = False
    _layers: list[Layer] | None = field(default=None, repr=False)
    _units: tuple[list[str], list[int], int] | None = field(default=None, repr=False)

    # -- ways to name a model -------------------------------------------------------------------------
    @classmethod
    def transformer(
        cls, *, layers: int, hidden: int, vocab: int, heads: int = 0, seq_len: int = 128, ffn_mult: int = 4
    ) -> ModelSpec:
        """The reference decoder transformer (:mod:`fastpar.costmodel.reference_transformer`) of these sizes."""
        kwargs = dict(layers=layers, hidden=hidden, vocab=vocab, heads=heads, seq_len=seq_len, ffn_mult=ffn_mult)
        try:
            TransformerConfig(**kwargs)  # checked now, so a bad size is refused before anything is built
        except ValueError as exc:
            raise UserError(str(exc)) from None
        return cls(
            constructor=lambda: ReferenceTransformer(**kwargs),
            describe="transformer " + ",".join(f"{k}={v}" for k, v in kwargs.items()),
            seq_len=seq_len,
            loss=ReferenceTransformer.loss,
            quadratic_is_sdpa=True,
        )

    @classmethod
    def from_path(
        cls,
        path: str,
        kwargs: dict[str, Any] | str | None = None,
        *,
        seq_len: int | None = None,
        input_shape: tuple[int, ...] | None = None,
        input_dtype: torch.dtype | str = torch.float32,
    ) -> ModelSpec:
        """``"package.module:function"`` (or a class) called with ``kwargs`` (a dict or a JSON object string).

        ``input_shape``: one sample's input shape (no batch dimension), so any ``nn.Module`` can be planned:
        the planner feeds it a ``(batch, *input_shape)`` tensor of ``input_dtype`` (random values for
        floating-point dtypes, zeros -- a valid token or class index -- for integer ones). Without it the
        module needs an ``example_batch(batch_size, seq_len, device)`` method."""
        if isinstance(kwargs, str):
            try:
                kwargs = json.loads(kwargs)
            except json.JSONDecodeError as exc:
                raise UserError(
                    f"--kwargs is not JSON ({exc.msg}): {kwargs!r}; give an object like '{{\"n\": 4}}'"
                ) from None
            if not isinstance(kwargs, dict):
                raise UserError(f"--kwargs must be a JSON object (keyword arguments), got {kwargs!r}")
        kwargs = dict(kwargs or {})
        module_name, sep, attr = path.partition(":")
        if not sep or not module_name or not attr:
            raise UserError(f"model {path!r} is not 'package.module:function'; e.g. torchvision.models:resnet50")
        try:
            target = importlib.import_module(module_name)
        except ImportError as exc:
            raise UserError(
                f"cannot import {module_name!r} for model {path!r}: {exc}; check the path and PYTHONPATH"
            ) from None
        for part in attr.split("."):
            if not hasattr(target, part):
                raise UserError(f"{module_name!r} has no {attr!r} (model {path!r}); check the name after the colon")
            target = getattr(target, part)
        if not callable(target):
            raise UserError(f"model {path!r} names a {type(target).__name__}, not a function or class")
        args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        example = None
        if input_shape is not None:
            if seq_len is not None:
                raise UserError(
                    "--seq-len and --input-shape both set the input's size; give the length inside --input-shape"
                )
            example = _input_maker(tuple(input_shape), _dtype(input_dtype))
        return cls(
            constructor=lambda: target(**kwargs),
            describe=f"{path}({args})",
            seq_len=seq_len,
            example_input=example,
            input_shape=None if input_shape is None else tuple(input_shape),
        )

    @classmethod
    def from_module(cls, module: nn.Module, example_batch: Any, loss: Callable | None = None) -> ModelSpec:
        """An already built module (any device) and a real batch of its input: the batch size is its first
        dimension. The spec rebuilds nothing: :meth:`build` hands back ``module`` itself."""
        batch_size = _batch_size(example_batch)

        def example(b: int, seq_len: int | None, device: Any) -> Any:
            if b != batch_size:
                raise ValueError(f"this spec has a batch of {batch_size}; cannot make one of {b}")
            return _to(example_batch, device)

        return cls(
            constructor=lambda: module,
            describe=type(module).__name__,
            example_input=example,
            loss=loss,
            fixed_batch=batch_size,
        )

    # -- building ------------------------------------------------------------------------------------
    def build(self, device: str | torch.device = "meta") -> nn.Module:
        try:
            with torch.device(device):
                module = self.constructor()
        except UserError:
            raise
        except TypeError as exc:  # wrong keyword arguments are the user's to fix
            raise UserError(f"building {self.describe} failed: {exc}; check --kwargs") from None
        if not isinstance(module, nn.Module):
            raise UserError(f"{self.describe} returned a {type(module).__name__}, not a torch.nn.Module")
        return module

    def layers(self) -> list[Layer]:
        """The model's layers with their parameter counts (built once, on the meta device)."""
        if self._layers is None:
            self._layers = _layer_records(self.build("meta"))
        return self._layers

    def fsdp_unit_layout(self) -> tuple[list[str], list[int], int]:
        """(each unit's name, its elements, the root's own elements) under ``fully_shard_model(wrap="auto")``."""
        if self._units is None:
            from .fsdp_units import unit_layout

            self._units = unit_layout(self.build("meta"))
        return self._units

    def param_shapes(self) -> list[tuple[int, ...]]:
        return [shape for layer in self.layers() for shape in layer.param_shapes]

    @property
    def numel(self) -> int:
        return sum(layer.numel for layer in self.layers())

    def batch(self, module: nn.Module, batch_size: int, seq_len: int | None, device: Any) -> Any:
        if self.example_input is not None:
            return self.example_input(batch_size, seq_len, device)
        if hasattr(module, "example_batch"):
            return module.example_batch(batch_size, seq_len, device=device)
        raise UserError(
            f"{self.describe} has no example_batch(batch_size, seq_len, device) method, so the planner cannot make "
            "an input to measure activations; give one sample's input shape (fastpar plan --input-shape 3,224,224 "
            "[--input-dtype float32]), add the method, or plan with plan_for_module(module, batch)"
        )

    def loss_of(self, output: Any, batch: Any) -> torch.Tensor:
        if self.loss is not None:
            return self.loss(output, batch)
        first = output if isinstance(output, torch.Tensor) else next(t for t in _tensors(output))
        return first.float().square().mean()  # any scalar that reaches every output element


def _dtype(name: torch.dtype | str) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise UserError(f"input dtype {name!r} is not a torch dtype; e.g. float32, bfloat16, int64")
    return dtype


def _input_maker(shape: tuple[int, ...], dtype: torch.dtype) -> Callable[[int, int | None, Any], torch.Tensor]:
    if not shape or any(n < 1 for n in shape):
        raise UserError(f"input shape {shape} needs at least one dimension, each >= 1 (one sample, no batch)")

    def example(batch_size: int, seq_len: int | None, device: Any) -> torch.Tensor:
        if dtype.is_floating_point or dtype.is_complex:
            return torch.randn((batch_size, *shape), dtype=dtype, device=device)
        return torch.zeros((batch_size, *shape), dtype=dtype, device=device)  # index 0 is valid for any table

    return example


def _tensors(value: Any):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _batch_size(batch: Any) -> int:
    first = next(_tensors(batch), None)
    if first is None or first.ndim == 0:
        raise UserError("the example batch holds no tensor with a batch dimension; pass the model's real input")
    return int(first.shape[0])


def _to(value: Any, device: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    return value
