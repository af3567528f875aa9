"""Activation checkpointing: chosen blocks keep only their input for backward and run their forward again there.

Memory for speed: a checkpointed block's saved activations (everything its backward needs) are dropped after its
forward and recomputed, block by block, during backward, so a step holds the blocks' inputs plus one block's
activations instead of all of them, for about one more forward of those blocks. It stands on torch's composable
``checkpoint`` (non-reentrant, RNG state preserved, so dropout draws the same mask twice): parameter and module
names are unchanged, so DDP, ZeRO, FSDP2 (applied before ``fully_shard``), ``state_dict`` and checkpoints see the
same model, and the results are the same bits as without it.

Which blocks (``blocks=``): ``"auto"`` -- the repeated blocks of the model (children of a ``ModuleList`` or
``Sequential`` that are two or more instances of one class with parameters: a transformer's layers), as FSDP's
units are chosen; block classes or class names; or a callable ``module -> bool``. ``every=k`` keeps every k-th of
them (the k-th, 2k-th, ...): less recomputation, less memory saved.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from .wrap_policy import WrapError, _by_class, _repeated_blocks

Blocks = str | type | Sequence[type | str] | Callable[[nn.Module], bool]
_MARK = "_fastpar_checkpointed"


class ActivationCheckpointError(ValueError):
    """The blocks to checkpoint can't be chosen as asked; the message says what to change."""


def checkpoint_activations(model: nn.Module, blocks: Blocks = "auto", every: int = 1) -> list[str]:
    """Checkpoint the activations of ``model``'s chosen blocks (see the module's docstring), in place; returns their
    qualified names. Apply it before wrapping the model (DDP, ``fully_shard``) and before ``torch.compile``."""
    from torch.distributed._composable import checkpoint

    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ActivationCheckpointError(f"every={every!r}: give a whole number >= 1 (1: every block)")
    names = block_names(model, blocks)[every - 1 :: every]
    if not names:
        raise ActivationCheckpointError(
            f"every={every} leaves none of the {len(block_names(model, blocks))} blocks of {type(model).__name__}; "
            "use a smaller every"
        )
    for name in names:
        block = model.get_submodule(name)
        if getattr(block, _MARK, False):
            raise ActivationCheckpointError(f"block {name!r} is already checkpointed; apply it once")
        checkpoint(block)
        setattr(block, _MARK, True)
    return names


def block_names(model: nn.Module, blocks: Blocks = "auto") -> list[str]:
    """The qualified names of the blocks ``blocks`` selects, in the model's order."""
    try:
        if blocks == "auto":
            names = _repeated_blocks(model)
            if not names:
                raise ActivationCheckpointError(
                    f"{type(model).__name__} has no repeated blocks (two or more children of one class in a "
                    "ModuleList or Sequential) for blocks='auto'; name the block classes to checkpoint"
                )
            return names
        if isinstance(blocks, (str, type)):
            return _by_class(model, [blocks])
        if isinstance(blocks, Sequence):
            return _by_class(model, list(blocks))
    except WrapError as exc:
        raise ActivationCheckpointError(str(exc).replace("wrap:", "blocks:").replace("wrap=", "blocks=")) from None
    if callable(blocks):
        names = [name for name, module in model.named_modules() if name and blocks(module)]
        if not names:
            raise ActivationCheckpointError(f"blocks={blocks!r} selects no module of {type(model).__name__}")
        return names
    raise ActivationCheckpointError(
        f"blocks={blocks!r}: give 'auto', block classes or class names, or a callable module -> bool"
    )


def checkpointing_spec(option: bool | int | str | Sequence[str]) -> tuple[Blocks, int] | None:
    """``TrainingOptions.activation_checkpointing`` as ``(blocks, every)``: False/None -> None; True -> every
    repeated block; k -> every k-th repeated block; class names -> those blocks."""
    if option is None or option is False:
        return None
    if option is True:
        return "auto", 1
    if isinstance(option, int):
        if option < 1:
            raise ActivationCheckpointError(f"activation_checkpointing={option}: every k-th block needs k >= 1")
        return "auto", option
    if isinstance(option, str):
        return ("auto" if option == "auto" else (option,)), 1
    if isinstance(option, Sequence) and option and all(isinstance(name, str) for name in option):
        return tuple(option), 1
    raise ActivationCheckpointError(
        f"activation_checkpointing={option!r}: give True (every repeated block), k (every k-th), or block class names"
    )
