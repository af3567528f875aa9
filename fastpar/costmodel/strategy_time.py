"""Predicted step time of each strategy: the measured compute (model_probe) plus the strategy's collectives,
priced by a calibrated profile or a fabric (collective_costs) and overlapped as each engine overlaps them.

- ``ddp``: backward with each bucket all-reduced as it fills -- the step simulator (step_simulator.py) with
  the gradients ready at the end of their layer's measured backward; then the optimizer over all parameters.
- ``zero1`` / ``zero2``: the same with a reduce-scatter per bucket (ZeRO-2's buckets split into the runs that fit
  its staging buffers, as the runtime splits them; it first copies each gradient into its staging buffer,
  priced at the profile's copy bandwidth; on CPU ranks each bucket also costs the profile's measured fixed
  time per bucket, ``SyncCosts.zero_bucket_s``); the optimizer over 1/N; the all-gather of
  the updated shards runs under the next forward (each module waits for its bucket). On CPU ranks ZeRO
  exchanges the shards point to point (gloo's own reduce-scatter is slower): each way the bytes of half an
  all-reduce, priced so.
- ``fsdp``: per unit (the layers each unit runs, ``unit_spans``: one block or a group of them; the rest is the root
  unit) an all-gather before its forward and, when resharded after forward, again before its backward (not the last
  unit, which stays gathered), and a reduce-scatter of its gradients after it, each with FSDP2's copies into and out
  of the flat buffers (priced at the profile's copy bandwidth). On GPUs the wire runs one collective at a time under
  the compute, the next unit's gather prefetched while this one computes; on CPU ranks the collectives and the
  compute share the cores, so they are taken one after the other. On gloo the gathers and reduce-scatters are
  fastpar's point-to-point exchanges, priced as ZeRO's: each way the bytes of half an all-reduce. On CPU ranks each
  unit also costs the profile's measured fixed time per unit (``SyncCosts.fsdp_unit_s``: FSDP2's hooks and its
  collectives' latency among busy ranks, beyond what the tables price for a unit that small), and
  ``fsdp_regather_s`` more when resharded after forward.
- ``pipeline``: M microbatches through S stages: (M + S - 1) slots of the slowest stage's forward + backward
  (interleaved 1F1B with V stages per rank: (V M + S - 1) slots of the slowest of its S V stages)
  of one microbatch and its two point-to-point messages (the bubble is (S - 1) / (M + S - 1) of it), then
  the stage's gradients all-reduced across its dp = N / S replicas and its optimizer step; each microbatch after
  the first adds its gradients into the stage's (priced at the profile's copy bandwidth). On CPU ranks each
  slot also costs the profile's measured fixed time per slot (``SyncCosts.pipeline_slot_s``: the schedule's
  Python and its messages' latency among busy ranks, beyond what the table prices for messages that small).

Contention between compute and the wire on CPU ranks (the profile's factors) is applied to DDP and ZeRO,
whose overlap the step simulator models; FSDP and pipeline overlaps are taken at face value.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from statistics import median

import torch

from .bucket_optimizer import size_capped_buckets
from .model_spec import Layer
from .step_simulator import GradArrival, StepTimeline, SyncCosts, simulate_step
from .zero_staging import split_to_fit, staging_numel

__all__ = ["Comm", "make_optimizer", "optimizer_seconds_per_element", "strategy_step_seconds"]

Comm = Callable[[str, float, int], float]  # (op, nbytes, ranks) -> seconds; op: allreduce|reducescatter|allgather|p2p


def make_optimizer(optimizer: str, params) -> torch.optim.Optimizer:
    """The torch optimizer a plan's ``optimizer`` name stands for (torch's default implementation)."""
    from .strategy_memory import OPTIMIZER_STATE

    if optimizer not in OPTIMIZER_STATE:
        raise ValueError(f"unknown optimizer {optimizer!r}; one of {', '.join(OPTIMIZER_STATE)}")
    params = list(params)
    return {
        "adamw": lambda: torch.optim.AdamW(params, lr=1e-3),
        "adam": lambda: torch.optim.Adam(params, lr=1e-3),
        "sgd": lambda: torch.optim.SGD(params, lr=1e-3),
        "sgd-momentum": lambda: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
    }[optimizer]()


def optimizer_seconds_per_element(optimizer: str, device: str | torch.device = "cpu", numel: int = 1 << 20) -> float:
    """Seconds per parameter element of one ``optimizer`` step here on a lone tensor (what a plan uses when the
    probe could not time the step inside the model's own training loop: see ``model_probe.probe``)."""
    p = torch.nn.Parameter(torch.zeros(numel, device=device))
    p.grad = torch.ones_like(p)
    opt = make_optimizer(optimizer, [p])
    opt.step()  # creates the state
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        opt.step()
        if p.device.type == "cuda":
            torch.cuda.synchronize()  # CPU-GPU sync point: the step must be done before the clock stops
        times.append(time.perf_counter() - t0)
    return median(times) / numel


def _overlapped(compute_s: float, wire_s: float, costs: SyncCosts) -> float:
    """Elapsed time of ``compute_s`` and ``wire_s`` run together, each slowed while the other runs."""
    kc, kw = 1.0 + costs.compute_slowdown, 1.0 + costs.wire_slowdown
    if wire_s <= 0:
        return compute_s
    if wire_s * kw <= compute_s * kc:  # the wire finishes first
        t = wire_s * kw
        return t + compute_s - t / kc
    t = compute_s * kc
    return t + wire_s - t / kw


def _timeline(layers: Sequence[Layer], backward: Sequence[float], itemsize: int) -> StepTimeline:
    """Each parameter's gradient ready at the end of its layer's backward (layers run last to first)."""
    grads, now, index = [], 0.0, 0
    starts = []
    for layer in layers:
        starts.append(index)
        index += len(layer.param_shapes)
    for i in reversed(range(len(layers))):
        now += backward[i]
        for k, shape in reversed(list(enumerate(layers[i].param_shapes))):
            numel = 1
            for d in shape:
                numel *= d
            grads.append(GradArrival(starts[i] + k, numel * itemsize, "float32", now))
    return StepTimeline(grads, max(now, grads[-1].ready_s if grads else 0.0))


def strategy_step_seconds(
    strategy: str,
    layers: Sequence[Layer],
    forward: Sequence[float],
    backward: Sequence[float],
    *,
    devices: int,
    comm: Comm,
    costs: SyncCosts,
    optimizer_s_per_element: float,
    reduce_itemsize: int,
    param_itemsize: int,
    caps: tuple[int, int],
    on_gpu: bool,
    options: dict,
) -> float:
    """Seconds of one step of ``strategy``; ``forward``/``backward``: seconds per layer at the per-rank batch
    (for pipeline, ``options`` carries ``stage_layers``, ``microbatches``, ``boundary_bytes``; for fsdp
    ``point_to_point``: the gathers and reduce-scatters are fastpar's point-to-point exchanges, on gloo)."""
    n = devices
    numel = sum(layer.numel for layer in layers)
    if strategy in ("ddp", "zero1", "zero2"):
        timeline = _timeline(layers, backward, reduce_itemsize)
        timeline = StepTimeline(timeline.grads, timeline.backward_s, sum(forward), 0.0)
        buckets = size_capped_buckets(timeline.grads, [caps[0], caps[1]]) if timeline.grads else []
        if strategy == "zero2":  # the runtime's rule (zero_staging.py): each bucket split into runs that fit a buffer
            limit = staging_numel(numel, reduce_itemsize, n, caps[1], not on_gpu)
            numels = {g.index: g.nbytes // reduce_itemsize for g in timeline.grads}
            buckets = [
                [members[k] for k in run]
                for members in buckets
                for run in split_to_fit([numels[i] for i in members], limit)
            ]
        if strategy == "ddp":
            wire = lambda b: comm("allreduce", b, n)  # noqa: E731
        elif on_gpu:
            wire = lambda b: comm("reducescatter", b, n)  # noqa: E731
        else:  # ZeRO's point-to-point exchange on CPU ranks moves the bytes of half an all-reduce, either way
            p2p = options.get("p2p_comm", comm)  # on the fastpar backend it travels over gloo
            wire = lambda b: p2p("allreduce", b, n) / 2  # noqa: E731
        # DDP's and ZeRO-1's gradients are bucket views (nothing packed), ZeRO-2 copies each one into its staging
        # buffer in its hook; DDP averages each bucket after it, ZeRO only its shard
        sync = replace(
            costs,
            pack_s_per_byte=costs.pack_s_per_byte if strategy == "zero2" else 0.0,
            unpack_s_per_byte=costs.unpack_s_per_byte if strategy == "ddp" else 0.0,
        )
        sim = simulate_step(timeline, buckets, wire, sync) if buckets else None
        backward_and_sync = sim.sync_end_s if sim else timeline.backward_s
        if strategy == "ddp":
            return sum(forward) + backward_and_sync + optimizer_s_per_element * numel
        sizes = {g.index: g.nbytes * param_itemsize // reduce_itemsize for g in timeline.grads}
        gather_one = (lambda b: comm("allgather", b, n)) if on_gpu else wire
        gather = sum(gather_one(sum(sizes[i] for i in members)) for members in buckets)
        forward_s = _overlapped(sum(forward), gather, costs)
        fixed = 0.0
        if not on_gpu and costs.zero_bucket_s > 0:
            # per bucket: measured as ZeRO-1's step less DDP's with the same small buckets, so less the tables'
            # price of ZeRO's two exchanges of such a bucket and plus that of DDP's all-reduce of it
            small = costs.zero_bucket_bytes
            priced = 2 * wire(small) - comm("allreduce", small, n)
            fixed = len(buckets) * max(0.0, costs.zero_bucket_s - priced)
        return forward_s + backward_and_sync + fixed + optimizer_s_per_element * numel / n
    if strategy == "fsdp":
        if options.get("point_to_point"):  # each way the bytes of half an all-reduce, as ZeRO's exchange
            comm = _point_to_point(comm)
        return _fsdp_seconds(
            layers, forward, backward, n, comm, param_itemsize, reduce_itemsize, on_gpu, options, costs
        ) + (optimizer_s_per_element * numel / n)
    if strategy == "pipeline":
        return _pipeline_seconds(
            layers,
            forward,
            backward,
            n,
            comm,
            options.get("p2p_comm", comm),
            reduce_itemsize,
            optimizer_s_per_element,
            options,
            0.0 if on_gpu else costs.pipeline_slot_s,
            costs.pipeline_message_bytes,
            costs.pack_s_per_byte,
        )
    raise ValueError(f"unknown strategy {strategy!r}")


class _Wire:
    """One collective on the wire at a time, in the order they are issued."""

    def __init__(self) -> None:
        self.free = 0.0

    def run(self, issued: float, seconds: float) -> float:
        self.free = max(self.free, issued) + seconds
        return self.free


def _point_to_point(comm: Comm) -> Comm:
    """FSDP2's gather and reduce-scatter as fastpar's point-to-point exchanges on gloo (shard/gloo_exchange.py):
    each moves the bytes of half a ring all-reduce of the unit, either way."""

    def priced(op: str, nbytes: float, ranks: int) -> float:
        return comm("allreduce", nbytes, ranks) / 2 if op in ("allgather", "reducescatter") else comm(op, nbytes, ranks)

    return priced


def _fsdp_seconds(layers, forward, backward, n, comm, param_itemsize, reduce_itemsize, on_gpu, options, costs):
    # each unit as the span of layers it runs (first, last); without spans (``options["unit_spans"]``), each
    # repeated layer with parameters is a unit. Layers outside every span belong to the root.
    spans = options.get("unit_spans") or [(i, i) for i, layer in enumerate(layers) if layer.repeated and layer.numel]
    first_of = {a: k for k, (a, _) in enumerate(spans)}
    last_of = {b: k for k, (_, b) in enumerate(spans)}
    inside = {i for a, b in spans for i in range(a, b + 1)}
    root_numel = sum(layer.numel for i, layer in enumerate(layers) if i not in inside)
    unit_numel = [sum(layer.numel for layer in layers[a : b + 1]) for a, b in spans]
    copy = costs.pack_s_per_byte  # FSDP2 copies shards into the gather buffer and out of it, grads likewise

    def gathered(numel: int) -> tuple[float, float]:  # (wire, copies) of one unit's all-gather
        nbytes = numel * param_itemsize
        return comm("allgather", nbytes, n), nbytes * (1 + 1 / n) * copy

    def scattered(numel: int) -> tuple[float, float]:
        nbytes = numel * reduce_itemsize
        return comm("reducescatter", nbytes, n), nbytes * (1 + 1 / n) * copy

    reshard = options.get("reshard_after_forward", True)
    wire = _Wire()
    # forward: the root unit gathered first, then each unit's gather as it starts (under the previous unit on GPUs)
    w, c = gathered(root_numel)
    now = wire.run(0.0, w) + c
    previous_start = now
    for i in range(len(layers)):
        if i in first_of:
            w, c = gathered(unit_numel[first_of[i]])
            arrived = wire.run(previous_start if on_gpu else now, w) + c
            previous_start = now = max(now, arrived)
        now += forward[i]
    # backward, last layer first: the last unit stayed gathered after forward (fastpar's fully_shard_model keeps
    # it); each other unit's gather issued as the unit after it starts (GPUs: under it); each unit's gradients
    # reduce-scattered once its first layer's backward is done
    arrived_at: dict[int, float] = {}
    for i in reversed(range(len(layers))):
        if i in last_of:
            k = last_of[i]
            now = max(now, arrived_at.get(k, 0.0))
            if reshard and k > 0:
                w, c = gathered(unit_numel[k - 1])
                arrived_at[k - 1] = wire.run(now, w) + c
                if not on_gpu:  # CPU ranks: the gather and this backward share the cores; taken one after the other
                    now = arrived_at[k - 1]
        now += backward[i]
        if i in first_of:
            w, c = scattered(unit_numel[first_of[i]])
            done = wire.run(now, w) + c
            now = now + c if on_gpu else done
    w, c = scattered(root_numel)
    count = len(spans) + (1 if root_numel else 0)
    return (
        wire.run(now, w) + c + _unit_fixed_seconds(count, reshard, on_gpu, costs, gathered, scattered, param_itemsize)
    )


def _unit_fixed_seconds(count, reshard, on_gpu, costs, gathered, scattered, param_itemsize) -> float:
    """What ``count`` units add whatever their size on CPU ranks: the profile's measured time per small unit less
    what the tables already price for a unit that size (on GPUs FSDP2's hooks run ahead of the kernels)."""
    if on_gpu or costs.fsdp_unit_s <= 0:
        return 0.0
    small = int(costs.fsdp_unit_bytes // param_itemsize)
    priced = sum(gathered(small)) + sum(scattered(small))
    fixed = max(0.0, costs.fsdp_unit_s - priced)
    if reshard:
        fixed += max(0.0, costs.fsdp_regather_s - sum(gathered(small)))
    return count * fixed


def _pipeline_seconds(
    layers,
    forward,
    backward,
    n,
    comm,
    p2p_comm,
    reduce_itemsize,
    optimizer_s_per_element,
    options,
    slot_fixed_s=0.0,
    fixed_message_bytes=0.0,
    accumulate_s_per_byte=0.0,
) -> float:
    stages = options["stage_layers"]  # stages x virtual stages; rank r runs r, r + S, ...
    s_count, m = options.get("stages", len(stages)), options["microbatches"]
    virtual = len(stages) // s_count
    per_batch = options["stage_batch_scale"]  # a stage's microbatch relative to the per-rank batch timed
    slot = max(sum(forward[i] + backward[i] for i in members) * per_batch for members in stages)
    p2p = 2 * p2p_comm("p2p", options["boundary_bytes"], 2) if len(stages) > 1 else 0.0
    if slot_fixed_s > 0 and len(stages) > 1:  # CPU ranks: the schedule's and the messages' fixed cost per slot,
        # measured with small messages (perf_profile's overheads), less what the table prices for those
        p2p += max(0.0, slot_fixed_s - 2 * p2p_comm("p2p", fixed_message_bytes, 2))
    dp = n // s_count
    stage_numel = max(
        sum(layers[i].numel for k in range(r, len(stages), s_count) for i in stages[k]) for r in range(s_count)
    )
    sync = comm("allreduce", stage_numel * reduce_itemsize, dp) if dp > 1 else 0.0
    # every microbatch after the first adds its gradients into the stage's (autograd accumulates into .grad)
    accumulate = (m - 1) * stage_numel * reduce_itemsize * accumulate_s_per_byte
    # each rank runs its V stages for every microbatch; the fill and drain take S - 1 slots of one stage: the
    # bubble is (S - 1) / (V M) of the step instead of (S - 1) / M
    return (m * virtual + s_count - 1) * (slot + p2p) + accumulate + sync + optimizer_s_per_element * stage_numel
