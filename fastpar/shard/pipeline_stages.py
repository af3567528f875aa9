"""Pipeline stages: a model split across ranks, run by ``torch.distributed.pipelining``'s schedules.

:func:`pipeline_model` splits an ordered sequence of layers (see :mod:`fastpar.shard.pipeline_profile`) at
points measured and chosen on group rank 0 and broadcast (:mod:`fastpar.shard.pipeline_split`), keeps this
rank's stages, wraps each in torch's ``PipelineStage`` and drives them with ``ScheduleGPipe``, ``Schedule1F1B``
or ``ScheduleInterleaved1F1B``. With more ranks than stages the world is ``stages x dp``
(:mod:`fastpar.shard.pipeline_layout`) and each stage module is wrapped in fastpar's
``DistributedDataParallel`` over its data-parallel group: it subclasses torch's DDP, so ``PipelineStage``
runs every microbatch but the last under ``no_sync()`` and prepares the reducer for the last one itself; the
stage's gradients are all-reduced (averaged) once per step, overlapped with that last backward.

What a step's gradient is: for microbatches ``m_1..m_n`` of the batch (``n = microbatches``, equal sizes),
every parameter's ``.grad`` is the gradient of ``(1/n) * sum_i loss_fn(stage_output(m_i), target_i)``,
averaged over the ``dp`` replicas: the gradient of the mean loss over the global batch when ``loss_fn``
averages over its microbatch. The ``1/n`` is applied to each microbatch's loss before its backward (torch's
schedules are built with ``scale_grads=False``), which is exactly what a one-process loop
``(loss_fn(model(m_i), t_i) / n).backward()`` does, so gradients accumulate in the same order with the same
terms.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..tensor_storage import storage_bytes
from .pipeline_layout import PipelineLayout, pipeline_layout
from .pipeline_profile import PipelineConfigError, microbatch_of, model_layers, profile_layers
from .pipeline_split import PipelineSplit, check_batch, check_pipeline_shape, choose_split

__all__ = ["PipelinedModel", "pipeline_memory_report", "pipeline_model"]


class StageLayers(nn.Module):
    """Layers of the original model under their original names (``"3"``, ``"blocks.3"``), so ``state_dict()``
    keys are the model's keys; ``forward`` applies them in order when they are one contiguous stage."""

    def __init__(self, named_layers: Sequence[tuple[str, nn.Module]], contiguous: bool = True) -> None:
        super().__init__()
        self._order = [name for name, _ in named_layers]
        self._contiguous = contiguous
        for name, layer in named_layers:
            parent, _, leaf = name.rpartition(".")
            owner: nn.Module = self
            if parent:  # "blocks.3": an entry of the model's ModuleList "blocks"
                if parent not in self._modules:
                    self.add_module(parent, nn.ModuleDict())
                owner = self._modules[parent]
            owner.add_module(leaf, layer)

    def layers(self) -> Iterator[nn.Module]:
        for name in self._order:
            yield self.get_submodule(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._contiguous:
            raise RuntimeError(
                "this rank's stages are not contiguous layers (interleaved schedule): run them with "
                "PipelinedModel.step()"
            )
        for layer in self.layers():
            x = layer(x)
        return x


class _MicrobatchMean:
    """``loss_fn(output, target) / microbatches``: each microbatch's share of the batch's mean loss."""

    def __init__(self, loss_fn: Callable[..., torch.Tensor], microbatches: int) -> None:
        self.loss_fn, self.microbatches = loss_fn, microbatches

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, target) / self.microbatches


def _default_device(group: dist.ProcessGroup) -> torch.device:
    if torch.cuda.is_available() and "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agreed(fn: Callable[[], object], group: dist.ProcessGroup, device: torch.device):
    """``fn()`` run on the group's rank 0 and broadcast: every rank gets the same value, or raises the same
    error (so no rank goes on alone into the first step's send, or waits for a rank that failed)."""
    box: list[object] = [None]
    failure: BaseException | None = None
    if dist.get_rank(group) == 0:
        try:
            box[0] = ("ok", fn())
        except PipelineConfigError as exc:
            box[0] = ("refused", str(exc))
        except Exception as exc:  # e.g. a layer that fails on the example: tell the other ranks, then raise it
            failure = exc
            box[0] = ("failed", f"{type(exc).__name__}: {exc}")
    dist.broadcast_object_list(box, group_src=0, group=group, device=device)
    status, value = box[0]
    if failure is not None:
        raise failure
    if status == "refused":
        raise PipelineConfigError(value)
    if status == "failed":
        raise RuntimeError(f"pipeline_model: group rank 0 failed while measuring the layers on the example: {value}")
    return value


def _meta(shape, dtype) -> torch.Tensor:
    """What a stage sends or receives, for ``PipelineStage``'s static shapes; floating activations carry
    gradients back (a stage whose output metadata says no grad would wait for none)."""
    return torch.empty(shape, dtype=dtype, device="meta").requires_grad_(dtype.is_floating_point)


class PipelinedModel:
    """This rank's share of a pipelined model; built by :func:`pipeline_model`.

    ``step(inputs, targets)`` runs forward and backward of the whole batch through the pipeline and leaves the
    gradients in ``.parameters()`` (module docstring says what they are); step the optimizer on
    ``.parameters()`` afterwards, on every rank. Attributes: ``module`` (this rank's stage layers, a
    :class:`StageLayers` with the original state-dict names), ``stage_indices``, ``is_first`` / ``is_last``
    (whether this rank holds the first / last stage), ``split`` (:class:`PipelineSplit`), ``layout``,
    ``pp_group``, ``dp_group``, ``last_stage_rank`` (global rank of this pipeline's last stage, where the loss
    is), ``stages`` (torch's ``PipelineStage`` objects), ``schedule`` (torch's schedule), ``device``.
    """

    def __init__(self, *, module, stages, schedule, split, layout, device, microbatches, batch_shape) -> None:
        self.module: StageLayers = module
        self.stages = stages
        self.schedule = schedule
        self.split: PipelineSplit = split
        self.layout: PipelineLayout = layout
        self.device = device
        self.microbatches = microbatches
        self.batch_shape = batch_shape
        self.stage_indices = tuple(s.stage_index for s in stages)
        self.is_first = any(s.is_first for s in stages)
        self.is_last = any(s.is_last for s in stages)
        self.pp_group, self.dp_group = layout.pp_group, layout.dp_group
        self.last_stage_rank = layout.pp_ranks[(split.num_stages - 1) % layout.stages]

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.module.zero_grad(set_to_none=set_to_none)

    def train(self, mode: bool = True) -> PipelinedModel:
        self.module.train(mode)
        return self

    def step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> torch.Tensor | None:
        """Forward + backward of one batch (split into ``microbatches``), gradients accumulated into
        ``.grad`` (call ``zero_grad`` between steps, as with any model). Returns, on the rank holding the last
        stage, the mean of the microbatch losses of this replica's batch (detached); None on the other ranks.
        Every rank of the pipeline calls it; ``inputs`` are read on the first stage, ``targets`` on the last."""
        for name, batch in (("inputs", inputs), ("targets", targets)):
            if batch is not None:
                check_batch(batch.shape[0], self.microbatches, f"the {name} batch")
        if inputs is not None and tuple(inputs.shape) != self.batch_shape:
            raise PipelineConfigError(
                f"the stages were built for batches of shape {list(self.batch_shape)} (example_input), got "
                f"{list(inputs.shape)}; every step needs that shape (with a DataLoader: drop_last=True), or build "
                f"the pipeline with an example of the new shape"
            )
        if self.is_first and inputs is None or self.is_last and targets is None:
            raise PipelineConfigError(
                "the first stage needs inputs and the last stage targets: pass both on every rank"
            )
        args = (inputs.to(self.device),) if self.is_first else ()
        target = targets.to(self.device) if self.is_last else None
        losses: list[torch.Tensor] | None = [] if self.is_last else None
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        if not self.is_last:
            return None
        total = losses[0].detach()
        for loss in losses[1:]:  # each is already loss_fn / microbatches: their sum is the mean
            total = total + loss.detach()
        return total


def _schedule(kind: str, stages: list, microbatches: int, loss_fn):
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    loss = _MicrobatchMean(loss_fn, microbatches)
    if kind == "interleaved-1f1b":
        return ScheduleInterleaved1F1B(stages, microbatches, loss_fn=loss, scale_grads=False)
    cls = Schedule1F1B if kind == "1f1b" else ScheduleGPipe
    return cls(stages[0], microbatches, loss_fn=loss, scale_grads=False)


def pipeline_model(
    model: nn.Module,
    *,
    stages: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    microbatches: int,
    schedule: str = "1f1b",
    split: str | Sequence[int] = "auto",
    example_input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    virtual_stages: int = 1,
    device: torch.device | str | None = None,
    memory_limit_bytes: int | None = None,
    optimizer_state_factor: float = 2.0,
) -> PipelinedModel:
    """Split ``model`` into ``stages`` pipeline ranks (x ``virtual_stages`` for ``"interleaved-1f1b"``) over
    ``group`` (default: the world); every rank of the group calls it with the same arguments and the same
    (seeded) model.

    ``model``: an ordered sequence of layers (:mod:`fastpar.shard.pipeline_profile` says exactly what is
    accepted). ``loss_fn(output, target)``: the loss of one microbatch (usually its mean). ``example_input``: a
    batch like those :meth:`PipelinedModel.step` will get (its first microbatch is measured, and fixes the
    shapes the stages exchange). ``split``: ``"auto"`` (balance measured time under ``memory_limit_bytes`` per
    rank; :mod:`fastpar.shard.pipeline_split`) or the layer indices where stages 1.. begin. ``device``: where
    this rank's stages run (default: the current CUDA device on an NCCL group, else CPU). A group larger than
    ``stages`` runs ``size / stages`` data-parallel pipelines (:mod:`fastpar.shard.pipeline_layout`).

    Raises :class:`PipelineConfigError`, on every rank and before the first step, for a pipeline that cannot
    run (too few layers, microbatches the schedule cannot use, a batch that does not split evenly, a model
    that is not a sequence of layers, no split that fits the memory limit).
    """
    from torch.distributed.pipelining import PipelineStage

    from ..ddp import DistributedDataParallel

    group = group or dist.group.WORLD
    layers = model_layers(model)
    check_pipeline_shape(
        num_layers=len(layers),
        stages=stages,
        virtual_stages=virtual_stages,
        microbatches=microbatches,
        schedule=schedule,
        world_size=dist.get_world_size(group),
    )
    check_batch(example_input.shape[0], microbatches, "example_input")
    device = torch.device(device) if device is not None else _default_device(group)
    microbatch = microbatch_of(example_input, microbatches)

    def measure_and_choose() -> PipelineSplit:
        costs = profile_layers(model, layers, microbatch, device)
        return choose_split(
            costs,
            stages=stages,
            virtual_stages=virtual_stages,
            microbatches=microbatches,
            schedule=schedule,
            split=split,
            memory_limit_bytes=memory_limit_bytes,
            optimizer_state_factor=optimizer_state_factor,
        )

    chosen: PipelineSplit = _agreed(measure_and_choose, group, device)
    layout = pipeline_layout(stages, group)
    total = stages * virtual_stages
    mine = [layout.pp_rank + v * stages for v in range(virtual_stages)]
    pipeline_stages, named = [], []
    for index in mine:
        span = chosen.stage_layers(index)
        stage_named = [(layers.names[i], layers.modules[i]) for i in span]
        named += stage_named
        submodule: nn.Module = StageLayers(stage_named).to(device)
        if layout.dp > 1:
            submodule = DistributedDataParallel(submodule, process_group=layout.dp_group)
        before = chosen.layers[span.start - 1] if span.start else None
        last = chosen.layers[span.stop - 1]
        inputs = microbatch.to(device) if before is None else _meta(before.output_shape, before.output_dtype)
        pipeline_stages.append(
            PipelineStage(
                submodule,
                index,
                total,
                device,
                input_args=inputs,
                output_args=_meta(last.output_shape, last.output_dtype),
                group=layout.pp_group,
            )
        )
    own = pipeline_stages[0].submod if virtual_stages == 1 else StageLayers(named, contiguous=False)
    return PipelinedModel(
        module=getattr(own, "module", own),  # the layers, not their DDP wrapper
        stages=pipeline_stages,
        schedule=_schedule(schedule, pipeline_stages, microbatches, loss_fn),
        split=chosen,
        layout=layout,
        device=device,
        microbatches=microbatches,
        batch_shape=tuple(example_input.shape),
    )


def pipeline_memory_report(pipelined: PipelinedModel) -> dict[str, int]:
    """This rank's bytes of ``"parameters"`` and ``"gradients"`` (0 before the first backward), read from the
    tensors themselves: each storage counted once, whole (gradients that are views into a DDP bucket count the
    bucket they live in)."""

    params = list(pipelined.parameters())
    return {
        "parameters": storage_bytes(params),
        "gradients": storage_bytes(p.grad for p in params if p.grad is not None),
    }
