"""The memory planner: per-device bytes and predicted step time of DDP, ZeRO-1, ZeRO-2, FSDP2 and pipeline
stages for one model, and the fastest strategy that fits.

::

    from fastpar.costmodel.memory_planner import plan
    from fastpar.costmodel.model_spec import ModelSpec

    p = plan(ModelSpec.transformer(layers=8, hidden=512, vocab=8000, seq_len=256),
             devices=2, device_memory="2GB", batch_size=4, seq_len=256)
    print(p.table())
    p.choice, p.choice_options      # "zero2", {} -- what TrainingOptions(sharding="auto") runs

Model state (parameters, gradients, optimizer state) is counted from the model's parameter shapes and each
engine's layout (strategy_memory.py). Activations are measured (model_probe.py) and scaled. Step time is the
measured compute plus each strategy's collectives from a calibrated profile or a fabric (strategy_time.py).
A strategy fits when its total is at most ``device_memory * (1 - headroom)``; the headroom (10% by default)
stands for what no estimate here counts: the allocator's fragmentation, the CUDA context, kernels' workspaces
and transient tensors such as the loss's gradient.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..user_errors import UserError
from .bucket_caps import bucket_caps
from .fsdp_units import CPU_UNIT_BYTES, check_blocks_per_unit, group_units
from .model_probe import ProbeResult, probe
from .model_spec import Layer, ModelSpec
from .pipeline_split import SCHEDULES, pipeline_options, stage_internals
from .plan_result import Plan, StrategyEstimate, fmt_bytes, parse_bytes
from .planner_comm import comm_model
from .strategy_memory import OPTIMIZER_STATE, DtypeSizes, bucket_members, strategy_memory
from .strategy_time import optimizer_seconds_per_element, strategy_step_seconds

__all__ = ["STRATEGIES", "Plan", "StrategyEstimate", "parse_bytes", "plan", "plan_for_module"]

STRATEGIES = ("ddp", "zero1", "zero2", "fsdp", "pipeline")
DTYPES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}
DEFAULT_HEADROOM = 0.10
ASSUMED_GPU_FLOPS = 200e12  # planning for GPUs from a CPU host: ~half an H100's dense bf16 peak (stated in notes)
GPU_MEMORY_BYTES_PER_S = 2e12  # HBM bandwidth an elementwise optimizer step reaches (assumed, H100-class)
MAX_PEERS = 15  # forked peers while timing compute for CPU ranks
TIE = 0.03  # step predictions this close are not told apart (the step time model's own spread is wider)
_MB = 1 << 20


def _device_memory(device_memory: int | str | None) -> int:
    if device_memory is not None:
        return parse_bytes(device_memory)
    from ..topology.discover import discover

    gpus = [g for g in discover().gpus if g.memory_total_mib]
    if not gpus:
        raise UserError("NVML reports no GPU memory here; give the device memory (--device-memory 80GB)")
    return min(g.memory_total_mib for g in gpus) * _MB


def plan(
    spec: ModelSpec,
    *,
    devices: int,
    device_memory: int | str | None = None,
    batch_size: int = 8,
    seq_len: int | None = None,
    param_dtype: str = "fp32",
    reduce_dtype: str | None = None,
    optimizer: str = "adamw",
    strategies: Sequence[str] = STRATEGIES,
    stages: Sequence[int] | None = None,
    schedules: Sequence[str] = SCHEDULES,
    microbatches: Sequence[int] | None = None,
    device: str = "cpu",
    profile: Any = None,
    fabric: Any = None,
    backend: str | None = None,
    headroom: float = DEFAULT_HEADROOM,
    probe_batch: int = 2,
    probe_result: ProbeResult | None = None,
    threads: int | None = None,
    device_flops: float | None = None,
    activation_checkpointing: bool | None = None,
    fsdp_blocks_per_unit: int | None = None,
) -> Plan:
    """Per-device bytes and predicted step time of each strategy for ``spec`` on ``devices`` devices of
    ``device_memory`` bytes (None: the smallest GPU NVML reports); ``batch_size`` samples per device of
    ``seq_len`` tokens (default: the spec's). ``device``: where training runs ("cpu" ranks or "cuda");
    ``profile`` (a path or :class:`Profile`) / ``fabric`` (a preset name or :class:`Fabric`) price the
    collectives; with neither, CPU ranks are priced with the profile shipped for their ``backend`` ("gloo" or
    "fastpar"). ``threads``: torch threads while timing compute on CPU (default: the host's cores shared by
    ``devices`` CPU ranks, as the launcher gives each rank). Returns a :class:`Plan` whose ``choice`` is the
    fastest strategy that fits. ``device_flops``: FLOP/s one device sustains; compute is then a FLOP count at
    that rate (the default when planning for GPUs with none here: :data:`ASSUMED_GPU_FLOPS`).
    ``activation_checkpointing``: None prices DDP, ZeRO and FSDP2 with and without checkpointing the repeated
    blocks (``fastpar.shard.checkpoint_activations(model)``: each keeps its input and recomputes the rest in
    backward), True only with, False only without; a model without repeated blocks the probe measured one by
    one is priced without. ``fsdp_blocks_per_unit``: FSDP2 with that many consecutive blocks grouped into one
    unit (``fully_shard_model(blocks_per_unit=...)``); None: on CPU ranks each grouping up to
    :data:`~fastpar.costmodel.fsdp_units.CPU_UNIT_BYTES` a unit is priced for units kept gathered after forward
    and the fastest that fits kept (``choice_options["blocks_per_unit"]``); on GPUs one block a unit."""
    _check(devices, batch_size, param_dtype, reduce_dtype, optimizer, strategies, headroom)
    if fsdp_blocks_per_unit is not None:
        try:
            check_blocks_per_unit(fsdp_blocks_per_unit)
        except ValueError as exc:
            raise UserError(f"fsdp_{exc}, or None") from None
    memory = _device_memory(device_memory)
    usable = int(memory * (1 - headroom))
    seq_len = seq_len if seq_len is not None else spec.seq_len
    layers = spec.layers()
    if not any(layer.numel for layer in layers):
        raise UserError(f"{spec.describe} has no parameters; nothing to plan")
    on_gpu = torch.device(device).type == "cuda"
    gpu_here = on_gpu and torch.cuda.is_available()
    probe_device = device if gpu_here or not on_gpu else "cpu"
    if on_gpu and not gpu_here and device_flops is None:
        device_flops = ASSUMED_GPU_FLOPS
    with _threads(None if on_gpu else threads or max(1, (os.cpu_count() or 1) // devices)):
        measured = probe_result or probe(
            spec,
            batch_size=min(probe_batch, batch_size),
            seq_len=seq_len,
            device=probe_device,
            flops_per_s=device_flops,
            # CPU ranks share this host: time one among its peers (capped: a plan must not fork a crowd)
            alongside=0 if on_gpu else min(devices - 1, MAX_PEERS),
            optimizer=optimizer,
        )
        if measured.optimizer == optimizer and measured.optimizer_s_per_element is not None:
            opt_s = measured.optimizer_s_per_element  # timed in the model's own loop, among its peers
        else:
            opt_s = optimizer_seconds_per_element(optimizer, probe_device)
    if on_gpu and not gpu_here:
        # an elementwise step is memory-bound: parameter read + write, gradient read, each state read + write
        opt_s = (3 + 2 * OPTIMIZER_STATE[optimizer][0]) * DTYPES[param_dtype] / GPU_MEMORY_BYTES_PER_S
    notes = []
    if on_gpu and measured.on_meta and spec.quadratic_is_sdpa and any(measured.act_quadratic):
        measured = replace(measured, act_quadratic=[0.0] * len(measured.act_quadratic))
        notes.append("attention's L x L tensors (meta device: math path) left out: GPUs run flash attention")
    sizes = DtypeSizes(
        param=DTYPES[param_dtype],
        reduce=DTYPES[reduce_dtype or param_dtype],
        activation_scale=(measured.float_share * DTYPES[param_dtype] / 4 + 1 - measured.float_share),
    )
    comm, costs, comm_text = comm_model(profile=profile, fabric=fabric, on_gpu=on_gpu, backend=backend)
    # point-to-point messages (ZeRO's exchange, the pipeline's sends) on the fastpar backend travel over gloo: its
    # shared memory runs the collectives only, so they are priced with gloo's profile unless one was given
    p2p_comm = comm
    if not on_gpu and backend == "fastpar" and profile is None and fabric is None:
        p2p_comm, _, p2p_text = comm_model(on_gpu=False, backend="gloo")
        comm_text += f"; point-to-point messages: {p2p_text}"
    total_bytes = sum(layer.numel for layer in layers) * sizes.param
    # the runtime's rule (bucket_caps.py); shared buckets on the fastpar backend, with the cores of this host
    caps = tuple(bucket_caps(total_bytes, "cuda" if on_gpu else "cpu", devices, shared_buckets=backend == "fastpar"))
    context = _Context(layers, measured, sizes, devices, optimizer, comm, costs, opt_s, caps, on_gpu, seq_len, usable)
    context.p2p_comm = p2p_comm
    if "fsdp" in strategies:
        context.fsdp_groupings = _fsdp_groupings(
            spec, layers, max(sizes.param, sizes.reduce), on_gpu, fsdp_blocks_per_unit
        )
        context.fsdp_point_to_point = not on_gpu and backend != "fastpar"  # gloo (the CPU default): gloo_exchange.py
    if activation_checkpointing is not False:
        context.checkpointed = _checkpointable(spec, layers)
        context.checkpointing = (
            (False,) if not context.checkpointed else (True,) if activation_checkpointing else (False, True)
        )
    estimates: list[StrategyEstimate] = []
    for strategy in strategies:
        for options in _variants(strategy, context, batch_size, stages, schedules, microbatches):
            estimates.append(context.estimate(strategy, options, batch_size))
    estimates = _best_groupings(estimates)
    best = _pick(estimates)
    advice, suggestions = ("", {}) if best else _advice(context, estimates, batch_size, strategies)
    notes = measured.notes + notes
    if on_gpu and not gpu_here:
        notes.append(
            f"no GPU here: compute = FLOPs at {device_flops:.3g} FLOP/s per device (--device-flops), "
            f"optimizer = HBM traffic at {GPU_MEMORY_BYTES_PER_S:.3g} B/s (assumed)"
        )
    if sizes.param == 2:
        notes.append(
            "activations of a 16-bit model scaled from the fp32 forward measured (floating-point tensors x 0.5)"
        )
    return Plan(
        model=spec.describe,
        devices=devices,
        device_memory=memory,
        usable_memory=usable,
        batch_size=batch_size,
        seq_len=seq_len,
        param_dtype=param_dtype,
        optimizer=optimizer,
        estimates=estimates,
        choice=best.strategy if best else None,
        choice_options=dict(best.options) if best else {},
        advice=advice,
        suggestions=suggestions,
        measurement=f"{measured.method}, {min(probe_batch, batch_size)} samples, scaled",
        comm=comm_text,
        notes=notes,
        probe=measured,
    )


@contextlib.contextmanager
def _threads(count: int | None):
    before = torch.get_num_threads()
    if count:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def plan_for_module(module: torch.nn.Module, example_batch: Any, *, loss=None, **kwargs: Any) -> Plan:
    """:func:`plan` for a built module and a real batch of its input (the Trainer's call): activations and
    compute are measured on that batch where the module lives; ``batch_size`` defaults to the batch's."""
    spec = ModelSpec.from_module(module, example_batch, loss=loss)
    kwargs.setdefault("batch_size", spec.fixed_batch)
    kwargs.setdefault("probe_batch", spec.fixed_batch)
    device = next(module.parameters()).device
    kwargs.setdefault("device", device.type)
    if kwargs["probe_batch"] != spec.fixed_batch:
        raise ValueError("plan_for_module measures on the given batch; probe_batch must be its size")
    return plan(spec, **kwargs)


@dataclass
class _Context:
    layers: list[Layer]
    measured: ProbeResult
    sizes: DtypeSizes
    devices: int
    optimizer: str
    comm: Any
    costs: Any
    optimizer_s: float
    caps: tuple[int, int]
    on_gpu: bool
    seq_len: int | None
    usable: int
    # blocks_per_unit -> (the root's and each unit's elements, each unit's span of layers or None) priced for FSDP2
    fsdp_groupings: dict[int, tuple[tuple[int, list[int]], list[tuple[int, int]] | None]] | None = None
    # the blocks activation checkpointing (blocks="auto") would wrap, each as the (first, last) of its probed layers
    checkpointed: tuple[tuple[int, int], ...] = ()
    checkpointing: tuple[bool, ...] = (False,)  # the variants priced: without, with, or both
    fsdp_point_to_point: bool = False  # FSDP2 on gloo: fastpar's point-to-point gather and reduce-scatter
    p2p_comm: Any = None  # prices point-to-point messages (on the fastpar backend: gloo's); None: ``comm``

    def activations(self, batch: float) -> list[float]:
        return [b * self.sizes.activation_scale for b in self.measured.activation_bytes(batch, self.seq_len)]

    def transient(self, batch: float, members: Sequence[int] | None = None) -> float:
        """Bytes that exist only around the start of backward, beyond the saved tensors: the gradient arriving
        at the largest layer output and the one leaving it (the logits' gradient, and softmax's, in a language
        model) -- twice the largest output."""
        outputs = self.measured.output_bytes(batch, self.seq_len)
        chosen = [outputs[i] for i in members] if members is not None else outputs
        return 2 * max(chosen, default=0.0) * self.sizes.activation_scale

    def estimate(self, strategy: str, options: dict, batch_size: int, devices: int | None = None) -> StrategyEstimate:
        n = devices or self.devices
        full = options | stage_internals(self, options, batch_size) if strategy == "pipeline" else options
        if strategy == "fsdp" and self.fsdp_groupings is not None:
            units, spans = self.fsdp_groupings[options.get("blocks_per_unit", 1)]
            full = full | {"units": units} | ({"unit_spans": spans} if spans else {})
        if strategy == "fsdp":
            full = full | {"point_to_point": self.fsdp_point_to_point}
        if strategy in ("zero1", "zero2", "pipeline") and self.p2p_comm is not None:
            full = full | {"p2p_comm": self.p2p_comm}
        buckets = bucket_members(self.layers, self.caps[1], self.caps[0], self.sizes.param)
        acts, recompute = self.activations(batch_size), None
        outputs = [o * self.sizes.activation_scale for o in self.measured.output_bytes(batch_size, self.seq_len)]
        if options.get("activation_checkpointing"):  # a block keeps its input; backward recomputes the rest
            recompute = [0.0] * len(acts)
            for first, last in self.checkpointed:  # recomputed when backward reaches the block, freed layer by layer
                recompute[first : last + 1] = [sum(acts[first : k + 1]) for k in range(first, last + 1)]
                acts[first : last + 1] = [outputs[first - 1] if first else 0.0] + [0.0] * (last - first)
        breakdown = strategy_memory(
            strategy,
            self.layers,
            acts,
            transient=self.transient(batch_size),
            devices=n,
            optimizer=self.optimizer,
            sizes=self.sizes,
            buckets=buckets,
            cpu_exchange=not self.on_gpu,
            options=full,
            cap_bytes=self.caps[1],
            outputs=outputs,
            recompute=recompute,
        )
        forward, backward = self.measured.seconds(batch_size, self.seq_len)
        if options.get("activation_checkpointing"):  # each checkpointed block runs its forward again in backward
            inside = {i for first, last in self.checkpointed for i in range(first, last + 1)}
            backward = [b + (f if i in inside else 0.0) for i, (f, b) in enumerate(zip(forward, backward, strict=True))]
        step = strategy_step_seconds(
            strategy,
            self.layers,
            forward,
            backward,
            devices=n,
            comm=self.comm,
            costs=self.costs,
            optimizer_s_per_element=self.optimizer_s,
            reduce_itemsize=self.sizes.reduce,
            param_itemsize=self.sizes.param,
            caps=self.caps,
            on_gpu=self.on_gpu,
            options=full,
        )
        return StrategyEstimate(strategy, dict(options), breakdown, step, breakdown.total <= self.usable)


def _variants(strategy, context: _Context, batch_size, stages, schedules, microbatches) -> list[dict]:
    if strategy == "pipeline":  # a stage keeps only its microbatches' activations: no checkpointing there
        return pipeline_options(context, batch_size, stages, schedules, microbatches)
    base = [{}]
    if strategy == "fsdp":
        groupings = sorted(context.fsdp_groupings or {1: None})
        # groups only where the units stay gathered until backward: resharding is for the least memory, and a
        # group's whole buffer would be gathered again (allocated anew) in backward; unless the caller chose the
        # group (one grouping priced: the caller's, for both)
        resharded = groupings if len(groupings) == 1 else [1]
        base = [
            {"reshard_after_forward": reshard} | ({"blocks_per_unit": k} if k > 1 else {})
            for reshard, ks in ((True, resharded), (False, groupings))
            for k in ks
        ]
    return [o | ({"activation_checkpointing": True} if ckpt else {}) for ckpt in context.checkpointing for o in base]


def _fsdp_groupings(
    spec: ModelSpec, layers: Sequence[Layer], itemsize: int, on_gpu: bool, only: int | None = None
) -> dict:
    """The groupings of FSDP2 units priced: ``blocks_per_unit`` -> ((root elements, each unit's), each unit's span
    of layers), for units kept gathered after forward. On CPU ranks each unit costs milliseconds whatever its
    size, so consecutive blocks are grouped while a unit stays within
    :data:`~fastpar.costmodel.fsdp_units.CPU_UNIT_BYTES` and two units are left; on GPUs a unit's fixed cost hides
    under the kernels, so only one block a unit. Without a span for every unit (a unit inside one probed layer),
    only one block a unit, priced layer by layer. ``only``: that grouping alone, whatever its size."""
    names, sizes, root = spec.fsdp_unit_layout()
    spans = _spans(names, [layer.name for layer in layers])
    size = dict(zip(names, sizes, strict=True))
    where = dict(zip(names, spans or [], strict=False))
    groupings: dict = {}
    seen: set[tuple[int, ...]] = set()
    for k in (only,) if only else (1, 2, 3, 4, 6, 8, 12, 16, 24, 32):
        if k > 1 and not only and (on_gpu or spans is None or k >= len(names)):
            break  # at least two units: one alone gathers everything before any compute and overlaps nothing
        groups = group_units(names, k)
        numels = [sum(size[name] for name in group) for group in groups]
        if k > 1 and not only and max(numels) * itemsize > CPU_UNIT_BYTES:
            break  # glibc maps larger blocks afresh at every step (fsdp_units.py)
        shape = tuple(len(group) for group in groups)
        if shape in seen:
            continue
        seen.add(shape)
        grouped_spans = [(where[group[0]][0], where[group[-1]][1]) for group in groups] if spans else None
        groupings[k] = ((root, numels), grouped_spans)
    return groupings


def _spans(modules: Sequence[str], layer_names: Sequence[str]) -> list[tuple[int, int]] | None:
    """Each of ``modules`` as the first and last index of the layers it is made of, or None where a module is not a
    run of whole layers (it is inside one probed layer, or its layers are not consecutive)."""
    spans = []
    for module in modules:
        inside = [i for i, name in enumerate(layer_names) if name == module or name.startswith(module + ".")]
        if not inside or inside != list(range(inside[0], inside[-1] + 1)):
            return None
        spans.append((inside[0], inside[-1]))
    return spans


def _best_groupings(estimates: list[StrategyEstimate]) -> list[StrategyEstimate]:
    """FSDP2's estimates with one grouping of units each (per resharding and checkpointing): the fastest that fits,
    the fewest blocks a unit among those within :data:`TIE` of it; where none fits, the smallest."""
    kept: dict[tuple, StrategyEstimate] = {}
    rows: dict[tuple, list[StrategyEstimate]] = {}
    for e in estimates:
        if e.strategy == "fsdp":
            key = (e.options.get("reshard_after_forward", True), bool(e.options.get("activation_checkpointing")))
            rows.setdefault(key, []).append(e)
    for key, group in rows.items():
        fitting = [e for e in group if e.fits]
        if fitting:
            fastest = min(e.step_s for e in fitting)
            tied = [e for e in fitting if e.step_s <= fastest * (1 + TIE)]
            kept[key] = min(tied, key=lambda e: e.options.get("blocks_per_unit", 1))
        else:
            kept[key] = min(group, key=lambda e: e.memory.total)
    chosen = {id(e) for e in kept.values()}
    return [e for e in estimates if e.strategy != "fsdp" or id(e) in chosen]


def _checkpointable(spec: ModelSpec, layers: Sequence[Layer]) -> tuple[tuple[int, int], ...]:
    """The blocks ``checkpoint_activations(model)`` wraps (the repeated blocks, the rule FSDP2's units follow), each
    as the first and last of the probed layers it is made of (a block may be one layer or several, e.g. a
    ``Sequential`` of conv, norm and activation); none where a block is inside a probed layer (the planner can't
    price it)."""
    from .fsdp_units import repeated_blocks

    try:
        blocks = repeated_blocks(spec.build("meta"))
    except Exception:  # noqa: BLE001 - a spec that can't be built on the meta device: nothing to price
        return ()
    return tuple(_spans(blocks, [layer.name for layer in layers]) or ())


def _pick(estimates: Sequence[StrategyEstimate]) -> StrategyEstimate | None:
    """The fastest estimate that fits; predictions within :data:`TIE` of it are a tie, which the simpler
    strategy wins (the order of :data:`STRATEGIES`: fewer collectives, fewer engines, less to go wrong)."""
    fitting = [e for e in estimates if e.fits]
    if not fitting:
        return None
    fastest = min(e.step_s for e in fitting)
    tied = [e for e in fitting if e.step_s <= fastest * (1 + TIE)]
    return min(tied, key=lambda e: (STRATEGIES.index(e.strategy), e.step_s))


def _fitting(context: _Context, batch_size: int, strategies: Sequence[str]) -> StrategyEstimate | None:
    """The fastest estimate that fits in ``context`` at ``batch_size``, or None."""
    rows = [
        context.estimate(strategy, options, batch_size)
        for strategy in strategies
        for options in _variants(strategy, context, batch_size, None, SCHEDULES, None)
    ]
    fitting = [e for e in rows if e.fits]
    return min(fitting, key=lambda e: e.step_s) if fitting else None


def _advice(context: _Context, estimates, batch_size: int, strategies: Sequence[str]) -> tuple[str, dict]:
    """What would make something fit -- more devices, a smaller batch, 16-bit parameters -- as words and as
    ``{"devices": n, "batch_size": b, "param_dtype": "bf16"}`` (each one alone, all else as asked)."""
    found: dict[str, Any] = {}
    ideas = []
    for n in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
        if n > context.devices and (e := _fitting(replace(context, devices=n), batch_size, strategies)):
            found["devices"] = n
            ideas.append(f"{n} devices ({e.label})")
            break
    for b in range(batch_size - 1, 0, -1):
        if e := _fitting(context, b, strategies):
            found["batch_size"] = b
            ideas.append(f"batch size {b} per device ({e.label})")
            break
    if context.sizes.param == 4:
        half = replace(
            context,
            sizes=replace(
                context.sizes,
                param=2,
                reduce=min(2, context.sizes.reduce),
                activation_scale=context.sizes.activation_scale / 2,
            ),
        )
        if e := _fitting(half, batch_size, strategies):
            found["param_dtype"] = "bf16"
            ideas.append(f"bf16 parameters ({e.label})")
    smallest = min(estimates, key=lambda e: e.memory.total)
    least = (
        f"the smallest is {smallest.label} at {fmt_bytes(smallest.memory.total)} of {fmt_bytes(context.usable)} usable"
    )
    if not ideas:
        return (
            f"{least}; nothing tried fits (up to 1024 devices, batch size 1, bf16): the model needs more memory per device",
            found,
        )
    return f"{least}; would fit with " + ", or ".join(ideas), found


def _check(devices, batch_size, param_dtype, reduce_dtype, optimizer, strategies, headroom) -> None:
    if devices < 1:
        raise UserError(f"devices must be at least 1, got {devices}")
    if batch_size < 1:
        raise UserError(f"batch size must be at least 1 sample per device, got {batch_size}")
    for dtype in (param_dtype, reduce_dtype or param_dtype):
        if dtype not in DTYPES:
            raise UserError(f"unknown dtype {dtype!r}; one of fp32, bf16, fp16")
    if optimizer not in OPTIMIZER_STATE:
        raise UserError(f"unknown optimizer {optimizer!r}; one of {', '.join(OPTIMIZER_STATE)}")
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise UserError(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}")
    if not 0 <= headroom < 1:
        raise UserError(f"headroom is a fraction of device memory in [0, 1), got {headroom}")
