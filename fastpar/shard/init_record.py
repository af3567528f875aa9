"""What building a model does to its tensors, recorded on the meta device and replayed on a real one.

Building under ``torch.device("meta")`` costs no memory, but it computes nothing either: the values a model's
construction gives its parameters (``reset_parameters()`` in each layer's ``__init__``, a Hugging Face model's
``post_init``, weights tied after construction, an ``init_fn``) exist only as a sequence of calls. This module
records that sequence -- every torch call the construction makes, in order, through a ``TorchFunctionMode`` --
and replays it on the real device: the same calls, in the same order, with each meta tensor replaced by the
real tensor the replay made for it. The global RNG is drawn exactly as the eager build draws it (a tensor the
construction drew and then dropped, such as a head's weight replaced by a tied embedding, is drawn too), so
every value and the RNG state after it are the eager build's, bit for bit.

Memory: a real tensor lives from the first call that makes it to the last call that uses it (known from the
record); a model tensor is handed to ``keep(name, full)`` at its last use -- the caller keeps this rank's
shard -- and dropped. A rank holds at once only what the construction has in flight, typically one module's
own parameters, never the model.

What cannot be replayed is refused by name before anything is sharded: a model tensor the record never saw
made (created outside torch's functions, for example from NumPy), or one whose value the record does not
reach. Calls are replayed only when they make or change a tensor; queries (shapes, dtypes) are not.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from ..tensor_storage import storage_key

__all__ = ["ConstructionRecord", "Unreplayable", "named_model_tensors", "record_construction"]

_NOT_REPLAYED = {torch._C._set_grad_enabled}  # the replay runs under no_grad as a whole


_UNINITIALISED = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


def _poison(out: Any) -> None:
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
            t.fill_(float("nan"))


def _key(t: torch.Tensor) -> tuple[str, int]:
    """Identity of a tensor's storage: views, ``.data`` and a Parameter made from a tensor share it."""
    return storage_key(t)


def _name(func: Any) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


def _changes_something(func: Any, out: Any) -> bool:
    """Whether a call with no tensor output still changes a tensor (``w[0] = 1``, ``p.data = t``)."""
    name = _name(func)
    return name.endswith("_") or name.endswith("__setitem__") or name.endswith("__set__")


@dataclass
class _Call:
    func: Any
    args: tuple
    kwargs: dict
    out: Any
    keys: set[int] = field(default_factory=set)  # storages it reads, writes or makes


class _Recorder(TorchFunctionMode):
    def __init__(self, calls: list[_Call]) -> None:
        super().__init__()
        self.calls = calls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _NOT_REPLAYED:
            return out
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if outputs or _changes_something(func, out):
            inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            keys = {_key(t) for t in (*inputs, *outputs) if t.is_meta}
            self.calls.append(_Call(func, args, kwargs, out, keys))
        return out


class ConstructionRecord:
    """The calls that built a model on meta, and which storage each of its parameters and buffers lives in."""

    def __init__(self, calls: list[_Call], model: nn.Module) -> None:
        self.calls = calls
        # every name of every model tensor (tied parameters have several), with its storage and geometry
        self.targets: dict[int, list[tuple[str, torch.Tensor]]] = {}
        for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
            self.targets.setdefault(_key(t), []).append((name, t))
        made = set()
        for call in calls:
            made.update(_key(t) for t in tree_flatten(call.out)[0] if isinstance(t, torch.Tensor) and t.is_meta)
        self.unmade = [names[0][0] for key, names in self.targets.items() if key not in made]

    def replay(self, device: torch.device, keep: Callable[[str, torch.Tensor], None]) -> set[str]:
        """Run the calls on ``device``; ``keep(name, full_value)`` for every name of every model tensor once its
        value is final. Returns the names kept."""
        last_use: dict[int, int] = {}
        for i, call in enumerate(self.calls):
            for key in call.keys:
                last_use[key] = i
        finished_at: dict[int, list[int]] = {}
        for key, i in last_use.items():
            finished_at.setdefault(i, []).append(key)
        real: dict[int, torch.Tensor] = {}  # id(meta tensor object) -> its real tensor
        by_key: dict[tuple[str, int], list[int]] = {}  # storage -> ids of the meta objects mapped in `real`
        kept: set[str] = set()

        def to_real(x: Any) -> Any:
            if not isinstance(x, torch.Tensor) or not x.is_meta:
                return x
            found = real.get(id(x))
            if found is not None:
                return found
            # a tensor the record saw made under another object (a Parameter wrapping it): same storage
            for other in by_key.get(_key(x), ()):
                base = real[other]
                if base.dtype == x.dtype:
                    view = base.as_strided(x.size(), x.stride(), x.storage_offset())
                    _remember(x, view)
                    return view
            raise Unreplayable(x)

        def _remember(meta: torch.Tensor, value: torch.Tensor) -> None:
            real[id(meta)] = value
            by_key.setdefault(_key(meta), []).append(id(meta))

        with torch.no_grad(), torch.device(device):
            for i, call in enumerate(self.calls):
                out = call.func(*tree_map(to_real, call.args), **tree_map(to_real, call.kwargs))
                if _name(call.func).rsplit(".", 1)[-1] in _UNINITIALISED:
                    _poison(out)  # a model tensor nothing writes afterwards stays NaN and is refused by name
                metas = [t for t in tree_flatten(call.out)[0] if isinstance(t, torch.Tensor)]
                values = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
                for meta, value in zip(metas, values, strict=True):
                    if meta.is_meta and id(meta) not in real:
                        _remember(meta, value)
                for key in finished_at.get(i, ()):
                    for name, meta in self.targets.get(key, ()):
                        keep(name, to_real(meta))
                        kept.add(name)
                    for obj in by_key.pop(key, ()):
                        real.pop(obj, None)
        return kept


class Unreplayable(RuntimeError):
    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__(f"a {tuple(tensor.shape)} {tensor.dtype} tensor the construction did not make")


def record_construction(build: Callable[[], nn.Module], init_fn: Callable[[nn.Module], None] | None = None):
    """``build()`` (then ``model.apply(init_fn)``) under ``torch.device("meta")``, recorded:
    returns ``(model, ConstructionRecord)``."""
    for _ in range(2):
        calls: list[_Call] = []
        with torch.device("meta"), _Recorder(calls), _libraries_initialise_on_meta() as told:
            model = build()
            if isinstance(model, nn.Module) and init_fn is not None:
                model.apply(init_fn)
        if told or not _has_transformers_model(model):
            break
        # the builder imported transformers itself, too late to be told: build again (no memory, on meta)
    return model, (ConstructionRecord(calls, model) if isinstance(model, nn.Module) else None)


def _has_transformers_model(model: object) -> bool:
    utils = sys.modules.get("transformers.modeling_utils")
    pretrained = getattr(utils, "PreTrainedModel", None)
    return (
        pretrained is not None
        and isinstance(model, nn.Module)
        and any(isinstance(m, pretrained) for m in model.modules())
    )


@contextmanager
def _libraries_initialise_on_meta() -> Iterator[bool]:
    """Hugging Face ``transformers`` skips a model's weight initialisation (``post_init``) when it sees the meta
    device, expecting a checkpoint to be loaded; here the initialisation is what is being recorded, so it is told
    that no device is set (its eager behaviour), for the duration of the build only. Yields whether it was told."""
    utils = sys.modules.get("transformers.modeling_utils")
    probe = getattr(utils, "get_torch_context_manager_or_global_device", None)
    if probe is None:
        yield False
        return
    utils.get_torch_context_manager_or_global_device = lambda: None
    try:
        yield True
    finally:
        utils.get_torch_context_manager_or_global_device = probe


def named_model_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)
