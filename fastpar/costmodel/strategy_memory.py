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
  one prefetched, and one unit's unsharded gradients before its reduce-scatter; with
  ``reshard_after_forward=False`` every unit stays gathered from forward to backward.
- ``pipeline``: a stage's layers whole (the largest stage counts); ``dp = N / S`` replicas of each stage
  synchronise like DDP. Activations of the microbatches in flight: with 1F1B stage s holds min(S - s, M)
  of them (the first stage the most), with GPipe all M.

Activations everywhere are the saved tensors plus backward's transient at its start: the gradient arriving
at the largest layer output and the one leaving it (2 x that output; for a language model the logits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

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

    @property
    def model_state(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state

    @property
    def total(self) -> int:
        return self.model_state + self.activations + self.buffers


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
) -> MemoryBreakdown:
    """Bytes per device of ``strategy``; activations are the saved tensors per layer plus the ``transient``
    bytes of backward's start (``options``: ``reshard_after_forward`` for fsdp; ``stages``,
    ``schedule``, ``microbatches``, ``stage_layers`` (layer indices per stage), ``stage_activations`` (bytes per
    stage for one microbatch), ``stage_transients``, ``boundary_bytes`` for pipeline); ``buckets``: each bucket's parameters' elements
    (:func:`bucket_members`);
    ``cap_bytes``: the bucket cap (ZeRO-2's staging is bounded by twice it; default: the largest bucket)."""
    n = devices
    numel = sum(layer.numel for layer in layers)
    tensors = sum(len(layer.param_shapes) for layer in layers)
    activations = int(sum(activation_per_layer) + transient)
    pb, rb = sizes.param, sizes.reduce
    if strategy == "ddp":
        narrow = numel * rb if rb != pb else 0
        state = _state_bytes(numel, tensors, optimizer, sizes)
        return MemoryBreakdown(numel * pb, numel * pb, state, activations, narrow, persistent_buffers=narrow)
    if strategy in ("zero1", "zero2"):
        if strategy == "zero2":  # the runtime's rule (fastpar.zero.gradient_pool): buckets split to fit its buffers
            cap = cap_bytes if cap_bytes is not None else max((sum(b) for b in buckets), default=0) * rb
            limit = staging_numel(numel, rb, n, cap, cpu_exchange)
            buckets = [[members[k] for k in run] for members in buckets for run in split_to_fit(members, limit)]
        padded = [-(-sum(b) // n) * n for b in buckets]
        total_padded = sum(padded)
        state = _state_bytes(total_padded / n, len(padded), optimizer, sizes)
        scratch = int(sum(padded) * (n - 1) / n * rb) if cpu_exchange and n > 1 else 0
        if strategy == "zero1":
            narrow = total_padded * rb if rb != pb else 0
            return MemoryBreakdown(
                total_padded * pb,
                total_padded * pb,
                state,
                activations,
                scratch + narrow,
                persistent_buffers=narrow,
            )
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
        largest_param = max((_numel(shape) for layer in layers for shape in layer.param_shapes), default=0)
        unlaunched = max(buffer, largest_param) * pb  # autograd's .grad not yet staged, dropped at its launch
        # the runtime's OWN_IN_FLIGHT (2): a second large parameter in flight holds its gradient and extras too
        own_extra *= min(2, len(own))
        if len(own) > 1:
            own_extra += max(own) * pb
        transit = pool + scratch + unlaunched + own_extra
        return MemoryBreakdown(
            total_padded * pb,
            total_padded // n * pb,
            state,
            activations,
            transit,
            persistent_buffers=pool + scratch,
        )
    if strategy == "fsdp":
        shard = sum(_fsdp_shard_numel(layer.param_shapes, n) for layer in layers)
        state = _state_bytes(shard, tensors, optimizer, sizes)
        units = [layer for layer in layers if layer.repeated and layer.numel]
        root = numel - sum(u.numel for u in units)
        largest = max((u.numel for u in units), default=0)
        if options.get("reshard_after_forward", True):
            gathered = root + min(2, len(units)) * largest
        else:
            gathered = numel
        unsharded_grads = root + largest  # the root's until the end of backward, one unit's until its reduce-scatter
        buffers = gathered * pb + unsharded_grads * max(pb, rb)
        return MemoryBreakdown(shard * pb, shard * pb, state, activations, buffers)
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
        return max(per_rank, key=lambda b: b.total)
    raise ValueError(f"unknown strategy {strategy!r}")
