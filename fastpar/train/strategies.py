"""How each sharding strategy builds, steps and checkpoints the model: the part of the training loop that
differs between DDP, ZeRO-1, ZeRO-2, FSDP2 and pipeline stages, one small class each.

The loop (loop.py) only calls what :class:`Strategy` declares: ``forward_backward``, ``no_sync``, ``clip``,
the optimizer's ``step``, and for checkpoints ``checkpoint_state``/``load_checkpoint`` (sharded strategies,
written as DCP folders) or the single-file path (DDP). ``sharding="auto"`` is resolved by planning.py
before any of these is built.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..shard import checkpoint as sharded
from ..tensor_storage import storage_bytes
from ..user_errors import OptionError
from .batches import Objective, StepResult, token_count
from .job import Job, build_model, build_optimizer, wrap_ddp


def checkpointed(model: Any, opts: Any) -> Any:
    """``model`` (a module, or a builder returning one) with ``activation_checkpointing`` applied."""
    from ..shard.activation_checkpoint import checkpoint_activations, checkpointing_spec

    spec = checkpointing_spec(opts.activation_checkpointing)
    if spec is None:
        return model
    if isinstance(model, torch.nn.Module):
        checkpoint_activations(model, *spec)
        return model
    return _CheckpointedBuilder(model, spec)


class _CheckpointedBuilder:
    def __init__(self, build: Any, spec: tuple) -> None:
        self.build, self.spec = build, spec

    def __call__(self) -> torch.nn.Module:
        from ..shard.activation_checkpoint import checkpoint_activations

        module = build_model(self.build)
        checkpoint_activations(module, *self.spec)
        return module


class Strategy:
    """Replicated model and optimizer (DDP, or one process): the default behaviour of every hook."""

    name = "ddp"
    sharded_checkpoints = False  # True: DCP folders (every rank writes its pieces); False: rank 0 writes one file
    collective_forward = False  # True: every forward takes part in collectives (each rank must run as many)
    grad_scaler: Any = None  # mixed_precision='fp16': the loss is scaled before backward (set by the loop)

    def __init__(self, job: Job, rank: int, world_size: int, device: torch.device) -> None:
        self.job, self.opts = job, job.options
        self.rank, self.world_size, self.device = rank, world_size, device
        self.objective = Objective(job.loss_fn)
        self.model = checkpointed(build_model(job.model), self.opts).to(device)  # evaluation, names, final state
        self.optimizer = build_optimizer(job.optimizer, self.model)
        self.train_model = wrap_ddp(self.model, self.opts, device) if world_size > 1 else self.model

    # --- which data this rank reads ---------------------------------------------------------------
    @property
    def data_rank(self) -> int:
        return self.rank

    @property
    def data_world_size(self) -> int:
        return self.world_size

    # --- one step -----------------------------------------------------------------------------------
    def no_sync(self, last_micro: bool):
        """The context for one micro-batch's backward: no gradient sync unless it is the group's last."""
        if last_micro or self.world_size == 1:
            return contextlib.nullcontext()
        return self.train_model.no_sync()

    def forward_backward(self, batch: Any, scale: float, autocast) -> StepResult:
        """Forward and backward of one micro-batch (on the device): its loss, samples, tokens and metrics."""
        with autocast():
            result = self.objective(self.train_model, batch, self.device)
        loss = result.loss * scale
        (loss if self.grad_scaler is None else self.grad_scaler.scale(loss)).backward()
        return result

    def clip(self, max_norm: float) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def compile(self, kwargs: dict[str, Any]) -> None:
        """Run the step through ``torch.compile(train_model)``; ``model`` (state, evaluation) stays the module."""
        self.train_model = torch.compile(self.train_model, **kwargs)

    # --- checkpoints and the result ------------------------------------------------------------------
    def model_shapes(self) -> dict[str, torch.Size]:
        return {k: v.shape for k, v in self.model.state_dict().items()}

    def checkpoint_state(self) -> dict[str, Any]:
        raise NotImplementedError  # replicated state: rank 0 writes single files (resume.py)

    def load_full(self, model_state: dict[str, Any], optimizer_state: dict[str, Any]) -> None:
        """Load a whole-model state (a single-file checkpoint) on every rank."""
        self.model.load_state_dict(model_state)
        self.optimizer.load_state_dict(optimizer_state)

    def load_checkpoint(self, path: Path) -> None:
        raise NotImplementedError

    def full_model_state(self) -> dict[str, torch.Tensor] | None:
        """Collective: the whole model's state on rank 0 (CPU tensors), None elsewhere."""
        if self.rank != 0:
            return None
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}

    def describe(self) -> str:
        return self.name

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds now, read from the tensors (each
        storage once; a sharded tensor's local piece)."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        state = [v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        return {
            "parameters": storage_bytes(params),
            "gradients": storage_bytes(p.grad for p in params),
            "optimizer_state": storage_bytes(state),
        }


class ZeroStrategy(Strategy):
    """ZeRO-1 (optimizer state sharded) or ZeRO-2 (+ gradients) on fastpar's DDP buckets."""

    sharded_checkpoints = True

    def __init__(self, job: Job, rank: int, world_size: int, device: torch.device, *, stage: int) -> None:
        super().__init__(job, rank, world_size, device)
        from ..zero import ShardedOptimizer

        self.name = f"zero{stage}"
        kwargs = {"shard_gradients": True} if stage == 2 else {}
        # the same optimizer (class, groups, state), each rank stepping its slices
        self.optimizer = ShardedOptimizer.from_optimizer(self.train_model, self.optimizer, **kwargs)

    def clip(self, max_norm: float) -> None:
        self.optimizer.clip_grad_norm_(max_norm)  # the reduced gradients exist as slices only

    def model_state_bytes(self) -> dict[str, int]:
        report = self.optimizer.memory_report()  # the flat buffers, the gradient slices and pool, the state
        return {k: report[k] for k in ("parameters", "gradients", "optimizer_state")}

    def load_full(self, model_state: dict[str, Any], optimizer_state: dict[str, Any]) -> None:
        self.optimizer.wait_for_params()  # no all-gather may land on the parameters after the load
        super().load_full(model_state, optimizer_state)  # each rank keeps its slices of the full state

    def checkpoint_state(self) -> dict[str, Any]:
        from .zero_checkpoint import zero_state

        optim = zero_state(self.optimizer)  # waits for the parameters' all-gather first
        return {"model": self.model.state_dict(), "optim": optim}

    def load_checkpoint(self, path: Path) -> None:
        from .zero_checkpoint import load_zero_state

        self.optimizer.wait_for_params()
        model_state = self.model.state_dict()  # views of the flat buffers: loading writes the parameters
        sharded.load_sharded({"model": model_state}, path)
        load_zero_state(self.optimizer, path)


class DcpStrategy(Strategy):
    """A model and plain optimizer checkpointed through torch's ``get_state_dict``/``set_state_dict``.

    The optimizer's hyperparameters are saved per parameter (``optim.groups_of.<name>``), not as the list of
    param groups: pipeline stages hold different parameters, so their group lists differ, and a list under one
    key would be written once for all of them (DCP keeps one copy of a replicated value)."""

    sharded_checkpoints = True

    def checkpoint_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": _by_parameter(optim_state)}

    def load_checkpoint(self, path: Path) -> None:
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)  # the skeleton: this rank's pieces
        state = {"model": model_state, "optim": _by_parameter(optim_state)}
        sharded.load_sharded(state, path)
        groups_of = state["optim"]["groups_of"]
        optim_state = {
            "state": state["optim"]["state"],
            "param_groups": [{**groups_of[g["params"][0]], "params": g["params"]} for g in optim_state["param_groups"]],
        }
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=optim_state)


def _by_parameter(optim_state: dict[str, Any]) -> dict[str, Any]:
    """``get_state_dict``'s optimizer state with each parameter's group hyperparameters under its own name."""
    groups_of = {
        name: {k: v for k, v in group.items() if k != "params"}
        for group in optim_state["param_groups"]
        for name in group["params"]
    }
    return {"state": optim_state["state"], "groups_of": groups_of}


class FsdpStrategy(DcpStrategy):
    """Fully sharded parameters, gradients and optimizer state through torch's FSDP2 (fastpar's policies)."""

    name = "fsdp"
    collective_forward = True

    def __init__(self, job: Job, rank: int, world_size: int, device: torch.device, plan_options=None) -> None:
        from ..shard import fully_shard_model

        self.job, self.opts = job, job.options
        self.rank, self.world_size, self.device = rank, world_size, device
        self.objective = Objective(job.loss_fn)
        opts, planned = self.opts, dict(plan_options or {})
        reshard = opts.fsdp_reshard_after_forward
        if reshard is None:
            reshard = planned.get("reshard_after_forward", True)
        # the plan's grouping (it groups only wrap="auto"'s blocks: loop.py plans other units one block a unit)
        blocks = opts.fsdp_blocks_per_unit or planned.get("blocks_per_unit", 1)
        # a factory is built on the meta device and only this rank's shards are materialised (with the values
        # the eagerly built model seeded with ``seed`` holds): no rank holds the whole model
        self.model = self.train_model = fully_shard_model(
            checkpointed(job.model, opts),  # before fully_shard: the recomputed forward all-gathers again
            wrap=opts.fsdp_wrap,
            mixed_precision="bf16" if opts.mixed_precision else None,
            reshard_after_forward=reshard,
            device=device,
            seed=opts.seed,
            blocks_per_unit=blocks,
        )
        self.optimizer = build_optimizer(job.optimizer, self.model)  # a plain optimizer over the DTensor shards
        self.reshard, self.blocks_per_unit = reshard, blocks

    def describe(self) -> str:
        grouped = f", {self.blocks_per_unit} blocks a unit" if self.blocks_per_unit > 1 else ""
        return f"fsdp (reshard after forward: {self.reshard}{grouped})"

    def no_sync(self, last_micro: bool):
        self.model.set_requires_gradient_sync(last_micro)  # accumulate unreduced until the group's last
        return contextlib.nullcontext()

    def model_shapes(self) -> dict[str, torch.Size]:
        return {k: v.shape for k, v in self.model.state_dict().items()}  # DTensor shapes are global

    def load_full(self, model_state: dict[str, Any], optimizer_state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        names = {id(p): n for n, p in self.model.named_parameters()}
        position = [names[id(p)] for g in self.optimizer.param_groups for p in g["params"]]
        by_name = {
            "state": {position[i]: v for i, v in optimizer_state["state"].items()},
            "param_groups": [
                {**g, "params": [position[i] for i in g["params"]]} for g in optimizer_state["param_groups"]
            ],
        }
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=model_state,
            optim_state_dict=by_name,
            options=StateDictOptions(full_state_dict=True),  # each rank keeps its shards of the whole state
        )

    def full_model_state(self) -> dict[str, torch.Tensor] | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return full if self.rank == 0 else None


def _microbatches_for(batch_size: int, stages: int, wanted: int) -> int:
    """The most micro-batches up to ``wanted`` that split ``batch_size`` evenly, preferring at least one per
    stage (what 1F1B needs)."""
    divisors = [d for d in range(min(wanted, batch_size), 0, -1) if batch_size % d == 0]
    return next((d for d in divisors if d >= stages), divisors[0])


class PipelineStrategy(DcpStrategy):
    """Layers split into stages (torch.distributed.pipelining schedules); data parallel across stage replicas."""

    name = "pipeline"

    def compile(self, kwargs: dict[str, Any]) -> None:
        raise ValueError(
            "TrainingOptions.compile: the pipeline strategy runs torch.distributed.pipelining's schedule, which the "
            "Trainer does not compile; choose another sharding (ddp, zero1, zero2, fsdp) or compile=False"
        )

    def __init__(
        self, job: Job, rank: int, world_size: int, device: torch.device, plan_options=None, example_input=None
    ) -> None:
        from ..shard import pipeline_model

        self.job, self.opts = job, job.options
        self.rank, self.world_size, self.device = rank, world_size, device
        self.objective = Objective(job.loss_fn)
        if not self.objective.takes_pairs:
            raise OptionError(
                "sharding",
                "sharding='pipeline' splits model(inputs) into stages and computes loss_fn(outputs, targets) on the "
                "last one, so it takes (inputs, targets) batches with loss_fn(outputs, targets); with "
                f"loss_fn={self.objective.loss_fn!r} choose sharding 'ddp', 'zero1', 'zero2' or 'fsdp'",
            )
        opts, planned = self.opts, dict(plan_options or {})
        stages = opts.pipeline_stages or planned.get("stages") or world_size
        if world_size % stages:
            raise ValueError(
                f"TrainingOptions.pipeline_stages={stages} does not divide the {world_size} processes; choose a "
                "divisor (processes = stages x data-parallel replicas)"
            )
        microbatches = opts.microbatches or planned.get("microbatches") or 2 * stages
        if opts.batch_size % microbatches:
            if opts.microbatches:
                raise ValueError(
                    f"batch_size={opts.batch_size} does not split into {microbatches} micro-batches; set "
                    "TrainingOptions.microbatches to a divisor of batch_size"
                )
            microbatches = _microbatches_for(opts.batch_size, stages, microbatches)  # the plan's does not divide
        schedule = opts.pipeline_schedule
        if opts.sharding == "auto" and schedule == "1f1b":  # the default: the plan's schedule
            schedule = planned.get("schedule", schedule)
        if not opts.microbatches and microbatches < stages and schedule == "1f1b":
            schedule = "gpipe"  # 1F1B needs a microbatch per stage; a smaller batch still runs as GPipe
        virtual = planned.get("virtual_stages", 1) if schedule == "interleaved-1f1b" else 1
        if virtual > 1 and microbatches % max(1, microbatches // stages):
            virtual = 1  # the plan's interleaving does not fit this batch's microbatches: one stage per rank
        split: Any = "auto"  # measured and balanced by pipeline_model
        planned_split = planned.get("split")
        if planned_split is not None and planned.get("stages") == stages and len(planned_split) == stages * virtual - 1:
            split = list(planned_split)  # where stages 1.. begin, as pipeline_model takes it
        self.pipeline = pipeline_model(
            build_model(job.model).to(device),
            stages=stages,
            loss_fn=job.loss_fn,
            microbatches=microbatches,
            schedule=schedule,
            split=split,
            virtual_stages=virtual,
            example_input=example_input,  # a real batch: the split is measured on it and fixes the shapes sent
            device=device,
            memory_limit_bytes=opts.memory_budget_bytes,
        )
        self.stages, self.microbatches = stages, microbatches
        self.model = self.train_model = self.pipeline.module  # this rank's stage, parameters under their global names
        self.optimizer = build_optimizer(job.optimizer, self.model)

    @property
    def data_rank(self) -> int:  # every stage of one replica reads the same batches
        return self.pipeline.layout.dp_rank

    @property
    def data_world_size(self) -> int:
        return self.pipeline.layout.dp

    def no_sync(self, last_micro: bool):
        return contextlib.nullcontext()  # one batch per step (grad_accum_steps=1): micro-batches inside .step

    def forward_backward(self, batch: Any, scale: float, autocast) -> StepResult:
        x, y = self.objective.split(batch)
        with autocast():
            loss = self.pipeline.step(x, y)  # forward and backward of every micro-batch, scheduled
        if loss is None:  # not the last stage: its ranks count no samples, so the logged mean is the last stage's
            return StepResult(torch.zeros((), device=self.device), 0)
        return StepResult(loss.detach(), len(y), token_count(x))

    def clip(self, max_norm: float) -> None:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        local = torch.stack([g.detach().double().pow(2).sum() for g in grads]).sum() if grads else torch.zeros(())
        local = local.to(self.device, torch.float64)
        dist.all_reduce(local)  # every stage's squares, counted once per data-parallel replica
        total = math.sqrt(local.item() / self.data_world_size)
        coef = max_norm / (total + 1e-6)
        if coef < 1:
            torch._foreach_mul_(grads, coef)

    def load_full(self, model_state: dict[str, Any], optimizer_state: dict[str, Any]) -> None:
        raise sharded.IncompatibleCheckpointError(
            "a single-file checkpoint (written by sharding='ddp') does not load into pipeline stages: its optimizer "
            "state is keyed by position, not by name; resume with sharding='ddp', or start a new run from its weights"
        )

    def model_shapes(self) -> dict[str, torch.Size]:
        shapes = {k: v.shape for k, v in self.model.state_dict().items()}
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, shapes)  # the whole model: the union of the stages
        return {k: v for stage in everyone for k, v in stage.items()}

    def full_model_state(self) -> dict[str, torch.Tensor] | None:
        mine = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        everyone: list | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(mine, everyone, dst=0)
        if self.rank != 0:
            return None
        return {k: v for stage in everyone for k, v in stage.items()}

    def describe(self) -> str:
        return f"pipeline ({self.stages} stages x {self.data_world_size} replicas, {self.microbatches} micro-batches)"


def build_strategy(
    job: Job,
    name: str,
    rank: int,
    world_size: int,
    device: torch.device,
    plan_options: dict | None = None,
    example_batch: Any = None,
) -> Strategy:
    """The strategy ``name`` (already resolved from "auto") for this rank. One process: plain training.
    ``example_batch``: a real batch on the device (pipeline stages are measured and shaped on its inputs)."""
    if world_size == 1 or name == "ddp":
        return Strategy(job, rank, world_size, device)
    if name in ("zero1", "zero2"):
        return ZeroStrategy(job, rank, world_size, device, stage=int(name[-1]))
    if name == "fsdp":
        return FsdpStrategy(job, rank, world_size, device, plan_options)
    if name == "pipeline":
        example_input = Objective(job.loss_fn).split(example_batch)[0] if example_batch is not None else None
        return PipelineStrategy(job, rank, world_size, device, plan_options, example_input)
    raise ValueError(f"unknown sharding strategy {name!r}")
