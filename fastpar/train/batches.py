"""What one batch means to the Trainer: how it reaches the device, how many samples and tokens it holds, and how
its loss (and any other metrics) is computed. Three forms of loss, chosen by what ``Trainer(loss_fn=...)`` is:

- ``loss_fn(outputs, targets)`` (any callable): batches are ``(inputs, targets)``; the model is called as
  ``model(inputs)`` (``model(*inputs)`` for a tuple or list, ``model(**inputs)`` for a dict);
- ``None``: the model computes its own loss -- ``model(**batch)`` for a dict batch (a Hugging Face model given
  ``labels``), ``model(*batch)`` for a tuple or list, ``model(batch)`` otherwise -- and returns it as a scalar
  tensor, as ``outputs.loss`` or ``outputs["loss"]``, or as the first element of a tuple;
- :func:`loss_from_batch` ``(fn)``: ``fn(model, batch)`` returns the loss, or ``(loss, {name: scalar})`` whose
  scalars are logged beside it (per-sample means, weighted by each rank's batch size).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch


class LossFromBatch:
    """``fn(model, batch) -> loss | (loss, {name: scalar})``, marked as such for the Trainer (picklable when ``fn``
    is defined at module level)."""

    def __init__(self, fn: Callable[[Any, Any], Any]) -> None:
        if not callable(fn):
            raise TypeError(f"loss_from_batch needs a function fn(model, batch), got {type(fn).__name__}")
        self.fn = fn

    def __call__(self, model: Any, batch: Any) -> Any:
        return self.fn(model, batch)

    def __repr__(self) -> str:
        return f"loss_from_batch({getattr(self.fn, '__qualname__', self.fn)!r})"


def loss_from_batch(fn: Callable[[Any, Any], Any]) -> LossFromBatch:
    """Tell ``fastpar.Trainer`` that ``fn`` computes the loss from the model and the whole batch:
    ``Trainer(model, optimizer, fastpar.loss_from_batch(fn), data)`` with ``fn(model, batch) -> loss`` or
    ``-> (loss, {"name": scalar, ...})``. Use it for dict batches, several inputs or several losses."""
    return LossFromBatch(fn)


# --- batches ------------------------------------------------------------------------------------------
def to_device(batch: Any, device: torch.device, float_dtype: torch.dtype) -> Any:
    """``batch`` with every tensor (and numpy array) on ``device``, floating ones in the model's ``float_dtype``;
    tuples, lists and dicts are walked, anything else is kept as it is."""
    if isinstance(batch, np.ndarray):
        batch = torch.from_numpy(batch)
    if torch.is_tensor(batch):
        batch = batch.to(device, non_blocking=True)
        return batch.to(float_dtype) if batch.is_floating_point() and batch.dtype != float_dtype else batch
    if isinstance(batch, Mapping):
        items = {k: to_device(v, device, float_dtype) for k, v in batch.items()}
        if type(batch) is dict:
            return items
        try:
            return type(batch)(items)  # e.g. a Hugging Face BatchEncoding
        except Exception:
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(to_device(v, device, float_dtype) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device, float_dtype) for v in batch)
    return batch


def tensors_of(value: Any):
    """The tensors in ``value``, depth first, in order (dict values in their order)."""
    if torch.is_tensor(value):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from tensors_of(v)
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from tensors_of(v)


def batch_size_of(batch: Any) -> int:
    """Samples in ``batch``: the first dimension of its first tensor."""
    first = next((t for t in tensors_of(batch) if t.ndim > 0), None)
    if first is None:
        raise TypeError(
            f"a batch must hold at least one tensor with a batch dimension, got {_describe(batch)}; make the loader "
            "yield tensors, tuples, lists or dicts of tensors"
        )
    return int(first.shape[0])


def token_count(batch: Any) -> int | None:
    """Tokens in a batch of token ids (for tokens/s): ``input_ids`` of a dict batch, else the inputs when they are
    integer ids of shape (batch, sequence); None for other data."""
    if isinstance(batch, Mapping):
        ids = batch.get("input_ids")
    elif isinstance(batch, (tuple, list)) and batch:
        ids = batch[0]
    else:
        ids = batch
    if torch.is_tensor(ids) and ids.ndim == 2 and not ids.is_floating_point() and ids.dtype != torch.bool:
        return ids.numel()
    return None


def _describe(value: Any) -> str:
    if torch.is_tensor(value):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, Mapping):
        return f"a {type(value).__name__} with keys {list(value)[:6]}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


# --- the loss -----------------------------------------------------------------------------------------
@dataclasses.dataclass
class StepResult:
    """One micro-batch's forward: the loss, the samples it covers, its tokens (None: not token data), the
    metrics returned beside it, and (``(x, y)`` form only) outputs and targets for accuracy."""

    loss: torch.Tensor
    samples: int
    tokens: int | None = None
    metrics: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    outputs: Any = None
    targets: Any = None


def call_model(model: Any, inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def loss_of_outputs(outputs: Any) -> torch.Tensor:
    """The loss a model returned: a scalar tensor, ``outputs.loss``, ``outputs["loss"]`` or ``outputs[0]``."""
    candidates = [outputs, getattr(outputs, "loss", None)]
    if isinstance(outputs, Mapping):
        candidates.append(outputs.get("loss"))
    if isinstance(outputs, (tuple, list)) and outputs:
        candidates.append(outputs[0])
    for value in candidates:
        if torch.is_tensor(value) and value.numel() == 1 and value.is_floating_point():
            return value.reshape(())
    raise TypeError(
        f"loss_fn=None: the model's forward returned {_describe(outputs)}, not a loss; return a scalar loss tensor "
        "(a Hugging Face model returns outputs.loss when the batch has 'labels'), or pass a loss_fn: "
        "loss_fn(outputs, targets) or fastpar.loss_from_batch(fn)"
    )


def _metric_tensors(metrics: Any, device: torch.device) -> dict[str, torch.Tensor]:
    if not isinstance(metrics, Mapping):
        raise TypeError(
            f"a loss_from_batch function returned (loss, {type(metrics).__name__}); return (loss, {{name: scalar}})"
        )
    out = {}
    for name, value in metrics.items():
        if name in ("loss", "val_loss") or not isinstance(name, str):
            raise ValueError(f"metric name {name!r}: use a string other than 'loss' (the loss is logged anyway)")
        tensor = torch.as_tensor(value.detach() if torch.is_tensor(value) else value, device=device)
        if tensor.numel() != 1:
            raise ValueError(f"metric {name!r} has {tensor.numel()} values; return one scalar per metric")
        out[name] = tensor.reshape(()).double()
    return out


class Objective:
    """The run's loss in one of the three forms (module docstring), applied to a batch already on the device."""

    def __init__(self, loss_fn: Any) -> None:
        self.loss_fn = loss_fn
        if loss_fn is None:
            self.form = "model"
        elif isinstance(loss_fn, LossFromBatch):
            self.form = "batch"
        else:
            self.form = "targets"

    @property
    def takes_pairs(self) -> bool:
        """``(inputs, targets)`` batches and ``loss_fn(outputs, targets)``: what a pipeline's last stage computes."""
        return self.form == "targets"

    def split(self, batch: Any) -> tuple[Any, Any]:
        """``(inputs, targets)`` of a batch in the ``loss_fn(outputs, targets)`` form; integer targets as int64."""
        if isinstance(batch, Mapping) or not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise TypeError(
                f"with loss_fn(outputs, targets) each batch must be a pair (inputs, targets), got {_describe(batch)}; "
                "for other batches pass loss_fn=None (the model returns its loss) or "
                "fastpar.loss_from_batch(fn) with fn(model, batch) -> loss"
            )
        x, y = batch
        if torch.is_tensor(y) and not y.is_floating_point() and y.dtype not in (torch.int64, torch.bool):
            y = y.long()  # what the classification losses take
        return x, y

    def __call__(self, model: Any, batch: Any, device: torch.device) -> StepResult:
        if self.form == "targets":
            x, y = self.split(batch)
            out = call_model(model, x)
            return StepResult(self.loss_fn(out, y), batch_size_of(x), token_count(x), outputs=out, targets=y)
        samples, tokens = batch_size_of(batch), token_count(batch)
        if self.form == "model":
            return StepResult(loss_of_outputs(call_model(model, batch)), samples, tokens)
        value, metrics = self.loss_fn(model, batch), {}
        if isinstance(value, tuple):
            if len(value) != 2:
                raise TypeError(
                    f"a loss_from_batch function returned a tuple of {len(value)}; return loss or (loss, metrics)"
                )
            value, metrics = value
        if not (torch.is_tensor(value) and value.numel() == 1):
            raise TypeError(
                f"a loss_from_batch function returned {_describe(value)} as its loss; return a scalar tensor"
            )
        return StepResult(value.reshape(()), samples, tokens, _metric_tensors(metrics, device))

    def for_planner(self, module: torch.nn.Module, batch: Any) -> tuple[torch.nn.Module, Any, Callable]:
        """``(module, input, loss(output, input))`` in the form the memory planner probes: ``module(input)``
        (``module(**input)`` for a dict) then ``loss``."""
        if self.form == "targets":
            x, y = self.split(batch)
            if torch.is_tensor(x):
                return module, x, lambda output, _inputs: self.loss_fn(output, y)
        whole = dict(batch) if isinstance(batch, Mapping) else batch  # the probe calls module(**batch) for a dict
        return _LossModule(module, self), whole, lambda output, _inputs: output


class _LossModule(torch.nn.Module):
    """The model and its loss as one module whose forward returns the loss: what the planner can probe when the
    loss needs the whole batch."""

    def __init__(self, model: torch.nn.Module, objective: Objective) -> None:
        super().__init__()
        self.model, self._objective = model, objective

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        batch = kwargs if kwargs else (args[0] if len(args) == 1 else args)
        device = next(self.model.parameters()).device
        return self._objective(self.model, batch, device).loss
