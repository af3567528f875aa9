"""Per-device bytes of each training strategy: parameters, gradients, optimizer state, activations, and the
buffers in flight (bucket buffers, gathered FSDP2 units, pipeline messages).

What each strategy keeps, per device of ``N`` (``P`` parameter elements; itemsizes from the dtypes):

- ``ddp``: everything whole. Gradients live in the flat bucket buffers (views); reducing in a narrower
  dtype adds a second flat buffer of the reduce dtype.
- ``zero1``: the optimizer state of 1/N of every bucket (buckets padded to a multiple of N). On gloo and the
  fastpar backend the reduce-scatter is point-to-point, into a scratch buffer of (N-1)/N of each bucket, which
  exists from the bucket's launch to the end of backward (not between steps).
- ``zero2``: also the gradients as shards (1/N), plus a pool of three buffers (one filling, one on the wire, one
  being summed) sized by ``zero_staging.staging_numel`` with their point-to-point scratch; in a step also
  autograd's gradients not yet staged (the largest parameter's at least) and, for a parameter larger than a
  buffer (reduced from its own gradient), its point-to-point scratch.
- ``fsdp``: parameters, gradients and state as shards; each parameter's dim 0 padded to a multiple of N (as
  ``fully_shard`` does). In flight: the root unit (never resharded), the largest unit gathered plus the next
  one prefetched, and one unit's unsharded gradients before its reduce-scatter (on gloo with the (N-1)/N
  scratch its point-to-point reduce-scatter receives into); with ``reshard_after_forward=False`` every unit
  stays gathered from forward to backward.
- ``pipeline``: a stage's layers whole (the largest stage counts); ``dp = N / S`` replicas of each stage
  synchronise like DDP. Activations of the microbatches in flight: with 1F1B stage s holds min(S - s, M)
  of them (the first stage the most), with GPipe all M.

Activations everywhere are the saved tensors plus backward's transient at its start: the gradient arriving
at the largest layer output and the one leaving it (2 x that output; for a language model the logits).

The peak (``MemoryBreakdown.total``) is the largest of three moments of a step, not their sum, where the
layers' outputs are known (:func:`step_peak`): backward's start (what is held + every activation + the loss's
gradient); the largest gradient's arrival in backward (what is held + autograd's fresh gradient + the buffers
in flight then + the activations of the layers before it; a layer's gradient curve otherwise); and the
optimizer step (everything held + the optimizer's temporaries: foreach Adam's ``sqrt`` of the whole second
moment on GPUs; on CPU, where torch's Adam loops over tensors, two temporaries of the largest tensor stepped).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

from .model_spec import Layer
from .pipeline_split import in_flight
from .zero_staging import POOL_CAPACITY, split_to_fit, staging_numel

__all__ = ["OPTIMIZER_STATE", "DtypeSizes", "MemoryBreakdown", "strategy_memory"]

# optimizer -> (state tensors per parameter, each the parameter's size and dtype; fp32 scalar "step" per parameter)
OPTIMIZER_STATE = {
    "adamw": (2, True),
    "adam": (2, True),
    "sgd": (0, False),
    "sgd-momentum": (1, False),
}
ZERO2_POOL_BUFFERS = POOL_CAPACITY  # ShardedOptimizer(shard_gradients=True)'s pool: filling, on the wire, being summed
_STEP_BYTES = 4  # torch keeps Adam's step as a float32 scalar tensor per parameter (per bucket shard in ZeRO)


@dataclass(frozen=True)
class DtypeSizes:
    param: int = 4  # bytes per parameter element (and per gradient element: grads are in the parameter dtype)
    reduce: int = 4  # bytes per element on the wire
    activation_scale: float = 1.0  # floating-point activations relative to the measured fp32 ones


@dataclass
class MemoryBreakdown:
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    buffers: int  # in flight at the peak: bucket buffers, gathered units, messages
    persistent_buffers: int = 0  # the part of ``buffers`` allocated once and kept (scratch, pools)
    notes: list[str] = field(default_factory=list)
    peak: int | None = None  # the step's peak by moment (step_peak); None: the sum of the parts
    peak_at: str = ""  # the moment that sets it

    @property
    def model_state(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state

    @property
    def total(self) -> int:
        return self.peak if self.peak is not None else self.model_state + self.activations + self.buffers


@dataclass(frozen=True)
class StepMoments:
    """What a strategy holds beyond the saved activations at each moment of a step (bytes per device)."""

    forward: int  # held through forward and at backward's start (state kept between steps, gathered units)
    gradient: int  # held when the largest gradient arrives (its fresh copy and the buffers in flight then)
    step: int  # held in the optimizer step (state, gradients, the optimizer's temporaries)


def optimizer_temporaries(optimizer: str, stepped_numel: float, largest_numel: float, itemsize: int, cpu: bool) -> int:
    """Bytes torch's Adam/AdamW allocates in ``step``: on GPUs (foreach) ``_foreach_sqrt`` of the whole second
    moment; on CPU (torch's default there is the loop per tensor) ``sqrt`` and its quotient of the largest tensor,
    two at once. SGD updates in place."""
    per_param, _ = OPTIMIZER_STATE[optimizer]
    if per_param < 2:
        return 0
    return int((2 * largest_numel if cpu else stepped_numel) * itemsize)


def step_peak(
    moments: StepMoments,
    activation_per_layer: Sequence[float],
    outputs: Sequence[float],
    largest_layer: int,
    recompute: Sequence[float] | None = None,
) -> tuple[int, str]:
    """The most bytes live at once in a step, and the moment: backward's start (every activation and the loss's
    gradient, 2 x the last output), the gradient curve (at layer k: the activations of layers 0..k, the gradient
    arriving at its output and the one leaving at its input), the largest gradient's arrival (activations of
    the layers before ``largest_layer``), or the optimizer step. ``recompute``: per layer, the recomputed
    activations live while its backward runs (in a checkpointed block: those of the block's layers up to it)."""
    acts = list(activation_per_layer)
    again = list(recompute) if recompute is not None else [0.0] * len(acts)
    last = len(acts) - 1
    upto = list(accumulate(acts))  # upto[k]: activations of layers 0..k, still saved when backward reaches k
    start = (upto[last] + 2 * outputs[last]) if acts else 0.0
    curve = max(
        (
            upto[k] + again[k] + (2 * outputs[k] if k == last else outputs[k]) + (outputs[k - 1] if k else 0.0)
            for k in range(len(acts))
        ),
        default=0.0,
    )
    # its own layer's saved activations: partly freed by then (a coarse layer: most); a recomputed block's: live
    before_largest = (upto[largest_layer] - acts[largest_layer] + again[largest_layer]) if acts else 0.0
    candidates = [
        (moments.forward + max(start, curve), "backward's start"),
        (moments.gradient + before_largest, "the largest gradient in backward"),
        (moments.step, "the optimizer step"),
    ]
    value, where = max(candidates, key=lambda c: c[0])
    return int(value), where


def _state_bytes(numel: float, tensors: int, optimizer: str, sizes: DtypeSizes) -> int:
    per_param, has_step = OPTIMIZER_STATE[optimizer]
    return int(numel * per_param * sizes.param + (tensors * _STEP_BYTES if has_step else 0))


def bucket_members(layers: Sequence[Layer], cap_bytes: int, first_cap_bytes: int, itemsize: int) -> list[list[int]]:
    """The elements of each parameter in each bucket, the parameters taken in backward order (last layer first),
    by torch's own bucket assignment (``fastpar.ddp.buckets.assign_buckets`` calls the same function, so DDP's
    reducer, ZeRO and the plan bucket alike), on meta tensors of the parameters' shapes: no memory."""
    import torch
    import torch.distributed as dist

    dtype = {2: torch.bfloat16, 8: torch.float64}.get(itemsize, torch.float32)
    shapes = [tuple(shape) for layer in reversed(layers) for shape in reversed(layer.param_shapes)]
    numels = [_numel(shape) for shape in shapes]
    assign = getattr(dist, "_compute_bucket_assignment_by_size", None) if dist.is_available() else None
    if assign is None or not shapes:  # a torch without it: the same rule (a bucket closes once it reaches its cap)
        return _capped(numels, itemsize, first_cap_bytes, cap_bytes)
    tensors = [torch.empty(shape, dtype=dtype, device="meta") for shape in shapes]
    indices, _ = assign(tensors, [first_cap_bytes, cap_bytes], [False] * len(tensors), list(range(len(tensors))))
    return [[numels[i] for i in bucket] for bucket in indices]


def bucket_numels(layers: Sequence[Layer], cap_bytes: int, first_cap_bytes: int, itemsize: int) -> list[int]:
    """Bucket sizes (elements): :func:`bucket_members` summed."""
    return [sum(members) for members in bucket_members(layers, cap_bytes, first_cap_bytes, itemsize)]


def _capped(numels: Sequence[int], itemsize: int, first_cap_bytes: int, cap_bytes: int) -> list[list[int]]:
    buckets: list[list[int]] = []
    current: list[int] = []
    for numel in numels:
        current.append(numel)
        if sum(current) * itemsize >= (first_cap_bytes if not buckets else cap_bytes):
            buckets.append(current)
            current = []
    if current:
        buckets.append(current)
    return buckets


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _fsdp_shard_numel(shapes: Sequence[Sequence[int]], n: int) -> int:
    """Elements of one rank's shards: ``fully_shard`` pads each parameter's dim 0 to a multiple of ``n``."""
    total = 0
    for shape in shapes:
        if not shape:
            total += 1  # a 0-d parameter is one element per rank once padded
            continue
        rows = -(-shape[0] // n)
        total += rows * _numel(shape[1:])
    return total


def strategy_memory(
    strategy: str,
    layers: Sequence[Layer],
    activation_per_layer: Sequence[float],
    *,
    transient: float = 0.0,
    devices: int,
    optimizer: str,
    sizes: DtypeSizes,
    buckets: Sequence[int],
    cpu_exchange: bool,
    options: dict,
    cap_bytes: int | None = None,
    outputs: Sequence[float] | None = None,
    recompute: Sequence[float] | None = None,
) -> MemoryBreakdown:
    """Bytes per device of ``strategy``; activations are the saved tensors per layer plus the ``transient``
    bytes of backward's start (``options``: ``reshard_after_forward`` for fsdp; ``stages``,
    ``schedule``, ``microbatches``, ``stage_layers`` (layer indices per stage), ``stage_activations`` (bytes per
    stage for one microbatch), ``stage_transients``, ``boundary_bytes`` for pipeline); ``buckets``: each bucket's parameters' elements
    (:func:`bucket_members`);
    ``cap_bytes``: the bucket cap (ZeRO-2's staging is bounded by twice it; default: the largest bucket);
    ``outputs``: each layer's output bytes -- given, the peak is taken by moment (:func:`step_peak`);
    ``recompute``: what each layer's backward recomputes (activation checkpointing, see :func:`step_peak`)."""
    breakdown, moments = _strategy_memory(
        strategy,
        layers,
        activation_per_layer,
        transient=transient,
        devices=devices,
        optimizer=optimizer,
        sizes=sizes,
        buckets=buckets,
        cpu_exchange=cpu_exchange,
        options=options,
        cap_bytes=cap_bytes,
    )
    if outputs is not None and moments is not None and len(outputs) == len(layers):
        breakdown.peak, breakdown.peak_at = step_peak(
            moments, activation_per_layer, outputs, _largest_layer(layers), recompute
        )
        breakdown.notes.append(f"peak at {breakdown.peak_at}")
    return breakdown


def _largest_layer(layers: Sequence[Layer]) -> int:
    """The first layer (forward order) holding the largest parameter: its gradient is the largest in flight."""
    sizes = [max((_numel(shape) for shape in layer.param_shapes), default=0) for layer in layers]
    return sizes.index(max(sizes)) if sizes else 0


def _strategy_memory(
    strategy: str,
    layers: Sequence[Layer],
    activation_per_layer: Sequence[float],
    *,
    transient: float,
    devices: int,
    optimizer: str,
    sizes: DtypeSizes,
    buckets: Sequence[Sequence[int]],
    cpu_exchange: bool,
    options: dict,
    cap_bytes: int | None,
) -> tuple[MemoryBreakdown, StepMoments | None]:
    """:func:`strategy_memory`'s parts, and the bytes held at each moment of a step (None for a pipeline)."""
    n = devices
    numel = sum(layer.numel for layer in layers)
    tensors = sum(len(layer.param_shapes) for layer in layers)
    activations = int(sum(activation_per_layer) + transient)
    pb, rb = sizes.param, sizes.reduce
    largest_param = max((_numel(shape) for layer in layers for shape in layer.param_shapes), default=0)
    if strategy == "ddp":
        narrow = numel * rb if rb != pb else 0
        state = _state_bytes(numel, tensors, optimizer, sizes)
        held = 2 * numel * pb + state + narrow
        moments = StepMoments(
            held,
            held + largest_param * pb,
            held + optimizer_temporaries(optimizer, numel, largest_param, pb, cpu_exchange),
        )
        breakdown = MemoryBreakdown(numel * pb, numel * pb, state, activations, narrow, persistent_buffers=narrow)
        return breakdown, moments
    if strategy in ("zero1", "zero2"):
        if strategy == "zero2":  # the runtime's rule (fastpar.zero.gradient_pool): buckets split to fit its buffers
            cap = cap_bytes if cap_bytes is not None else max((sum(b) for b in buckets), default=0) * rb
            limit = staging_numel(numel, rb, n, cap, cpu_exchange)
            buckets = [[members[k] for k in run] for members in buckets for run in split_to_fit(members, limit)]
        padded = [-(-sum(b) // n) * n for b in buckets]
        total_padded = sum(padded)
        state = _state_bytes(total_padded / n, len(padded), optimizer, sizes)
        scratch = int(sum(padded) * (n - 1) / n * rb) if cpu_exchange and n > 1 else 0
        temporaries = optimizer_temporaries(optimizer, total_padded / n, max(padded, default=0) / n, pb, cpu_exchange)
        if strategy == "zero1":
            narrow = total_padded * rb if rb != pb else 0
            held = 2 * total_padded * pb + state + narrow
            # the largest gradient: autograd's copy, and its bucket's receive scratch (freed once summed)
            largest_scratch = int(max(padded, default=0) * (n - 1) / n * rb) if cpu_exchange and n > 1 else 0
            moments = StepMoments(held, held + largest_param * pb + largest_scratch, held + temporaries)
            breakdown = MemoryBreakdown(
                total_padded * pb,
                total_padded * pb,
                state,
                activations,
                scratch + narrow,
                persistent_buffers=narrow,
            )
            return breakdown, moments
        # pooled buffers of the largest bucket that fits; a larger one (one parameter) is reduced in its gradient's
        # memory, two at a time: on CPU ranks with a scratch of (N-1)/N of it and, padded, a padded copy of the last
        # rank's region (1/N); with torch's reduce-scatter a padded one in a copy of it
        pooled = [p for p in padded if p <= limit]
        buffer = max(pooled, default=0)
        lent = min(ZERO2_POOL_BUFFERS, len(pooled))  # allocated on first use: never more than there are buckets
        pool = lent * buffer * rb
        scratch = int(lent * buffer * (n - 1) / n * rb) if cpu_exchange and n > 1 else 0
        own_extra = 0
        own = [p for p in padded if p > limit]
        for p, real in ((p, sum(b)) for p, b in zip(padded, buckets, strict=True) if p > limit):
            if rb != pb:  # reduced in another dtype: staged into a buffer of its own
                extra = p + (p * (n - 1) / n if cpu_exchange and n > 1 else 0)
            elif cpu_exchange and n > 1:
                extra = p * (n - 1) / n + (p / n if p != real else 0)
            else:
                extra = p if p != real else 0
            own_extra = max(own_extra, int(extra * rb))
        unlaunched = max(buffer, largest_param) * pb  # autograd's .grad not yet staged, dropped at its launch
        # the runtime's OWN_IN_FLIGHT (2): a second large parameter in flight holds its gradient and extras too
        own_extra *= min(2, len(own))
        if len(own) > 1:
            own_extra += max(own) * pb
        transit = pool + scratch + unlaunched + own_extra
        held = total_padded * pb + total_padded // n * pb + state + pool + scratch
        moments = StepMoments(held, held + unlaunched + own_extra, held + temporaries)
        breakdown = MemoryBreakdown(
            total_padded * pb,
            total_padded // n * pb,
            state,
            activations,
            transit,
            persistent_buffers=pool + scratch,
        )
        return breakdown, moments
    if strategy == "fsdp":
        shard = sum(_fsdp_shard_numel(layer.param_shapes, n) for layer in layers)
        state = _state_bytes(shard, tensors, optimizer, sizes)
        if "units" in options:  # fastpar.shard's own choice of units (costmodel.fsdp_units)
            root, units = options["units"][0], [u for u in options["units"][1] if u]
        else:
            units = [layer.numel for layer in layers if layer.repeated and layer.numel]
            root = numel - sum(units)
        largest = max(units, default=0)
        if options.get("reshard_after_forward", True):
            gathered = root + min(2, len(units)) * largest
        else:
            gathered = numel
        unsharded_grads = root + largest  # the root's until the end of backward, one unit's until its reduce-scatter
        # on gloo the point-to-point reduce-scatter receives the peers' chunks of that unit into a scratch
        scratch = largest * (n - 1) / n * rb if options.get("point_to_point") and n > 1 else 0
        buffers = int(gathered * pb + unsharded_grads * max(pb, rb) + scratch)
        largest_shard = max(
            (_fsdp_shard_numel([shape], n) for layer in layers for shape in layer.param_shapes), default=0
        )
        held = shard * pb + state  # zero_grad(set_to_none) drops the sharded gradients between steps
        moments = StepMoments(
            held + gathered * pb,
            held + max(shard - root // n, 0) * pb + buffers,  # the root's gradient shards come last
            held + shard * pb + optimizer_temporaries(optimizer, shard, largest_shard, pb, cpu_exchange),
        )
        return MemoryBreakdown(shard * pb, shard * pb, state, activations, buffers), moments
    if strategy == "pipeline":
        stages = options["stage_layers"]  # stages x virtual stages of them; rank r holds r, r + S, ...
        ranks = options.get("stages", len(stages))
        virtual = options.get("virtual_stages", 1)
        m = options["microbatches"]
        per_rank = []
        for r in range(ranks):
            mine = list(range(r, len(stages), ranks))
            members = [i for k in mine for i in stages[k]]
            stage_numel = sum(layers[i].numel for i in members)
            stage_tensors = sum(len(layers[i].param_shapes) for i in members)
            held = {k: in_flight(options["schedule"], k, ranks, virtual, m) for k in mine}
            acts = sum(held[k] * options["stage_activations"][k] for k in mine)
            acts += max(options["stage_transients"][k] for k in mine)
            # sends and receives of the boundary activation and its gradient, one per microbatch in flight
            messages = 2 * sum(held.values()) * options["boundary_bytes"] if len(stages) > 1 else 0
            per_rank.append(
                MemoryBreakdown(
                    stage_numel * pb,
                    stage_numel * pb,
                    _state_bytes(stage_numel, stage_tensors, optimizer, sizes),
                    int(acts),
                    int(messages),
                    notes=[f"stage {r}" if virtual == 1 else f"rank {r} of the pipeline (stages {mine})"],
                )
            )
        return max(per_rank, key=lambda b: b.total), None
    raise ValueError(f"unknown strategy {strategy!r}")
