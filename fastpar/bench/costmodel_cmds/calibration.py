"""The measurements behind a profile, run on every rank of a live process group at once.

Everything the prediction of a step uses is measured in the *same interleaved rounds* as the steps it
is checked against, so a machine that speeds up or slows down between phases (other jobs) hits the
measurement and the prediction alike. Each variant below is one zero-argument call; the calibrate
benchmark times them all together with ``launch.time_on_all_ranks``:

- ``no_comm``: a bare training step that also records when each gradient is ready (:class:`GradTimer`);
- ``ddp_cap_<C>mb``: a torch DDP training step at bucket cap C (the measurements to predict);
- ``torch_pack`` / ``torch_unpack`` / ``fastpar_pack`` / ``fastpar_unpack``: the model's gradients into
  one flat bucket and back (torch's per-tensor ``mul(out=)``/``copy_``, ``fastpar.ops.pack/unpack``);
- ``allreduce_<size>``: one all-reduce per sweep size (checked element by element before);
- ``contention``: backward alone, a stream of all-reduces alone, then both at once (:class:`ContentionTrial`);
- ``fsdp_units_ddp`` / ``fsdp_units_keep`` / ``fsdp_units_reshard``: a model of small units under fastpar DDP
  and ``fastpar.fully_shard_model``, kept gathered or resharded after forward: what a unit adds to a step
  whatever its size; ``pipeline_slots_local`` / ``pipeline_slots``: the same small model stepped alone and
  pipelined over the group's ranks (``fastpar.pipeline_model``, 1F1B): what a pipeline slot (one microbatch
  through one stage, its two messages) adds whatever its compute; ``zero_buckets_ddp`` / ``zero_buckets``: the
  small model with one bucket per layer under fastpar DDP and under ZeRO-1: what a ZeRO bucket (its
  reduce-scatter and all-gather exchanges) adds (:func:`step_overheads`).

Reduce-scatter and all-gather are measured on their own beforehand (:func:`measure_collectives`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ... import ops
from ...costmodel.perf_profile import CollectiveTable
from .. import launch
from ..benchmarks.collective_cases import check_and_time, distinct_sizes, make_case
from ..harness import Plan, WrongResultError, count_mismatches, format_bytes

CONTENTION_BUCKET_BYTES = 4 << 20  # the all-reduce kept on the wire while backward runs
MAX_SLOWDOWN = 10.0  # a slowdown estimate beyond 10x (10% speed) is noise from other jobs, not contention


def measure_collectives(
    names: Sequence[str],
    sizes: Sequence[int],
    device: torch.device,
    rank: int,
    world_size: int,
    plan: Plan,
    *,
    timed: bool = True,
) -> dict[str, CollectiveTable]:
    """float32 ``names`` at ``sizes`` (bytes, nccl-tests' convention), each size checked element by element
    and, with ``timed``, timed; a wrong result raises WrongResultError on every rank alike."""
    tables = {}
    for name in names:
        nbytes, seconds = [], []
        for size in distinct_sizes(name, list(sizes), 4, world_size):
            case, wrong, took = check_and_time(name, size, torch.float32, device, rank, world_size, plan, timed=timed)
            if wrong:
                raise WrongResultError(
                    f"{name} of {format_bytes(case.nbytes)} on {world_size} ranks: {wrong} wrong elements; "
                    "no profile written"
                )
            nbytes.append(case.nbytes)
            seconds.append(took)
        tables[name] = CollectiveTable(nbytes, seconds) if timed else None
    return tables


def allreduce_variants(sizes: Sequence[int], device: torch.device, rank: int, world_size: int) -> dict[str, Callable]:
    """``allreduce_<bytes>``: one all-reduce of each size on zeroed buffers (check them first)."""
    variants = {}
    for size in distinct_sizes("allreduce", list(sizes), 4, world_size):
        case = make_case("allreduce", size, torch.float32, device, rank, world_size)
        case.inp.zero_()
        variants[f"allreduce_{case.nbytes}"] = case.call
    return variants


def move_variants(params: Sequence[torch.Tensor], device: torch.device, world_size: int) -> dict[str, Callable]:
    """The four ways of moving gradients shaped like ``params`` into one flat bucket and back."""
    grads = [torch.randn(p.shape, dtype=p.dtype, device=device) for p in params]
    flat = torch.empty(sum(g.numel() for g in grads), dtype=grads[0].dtype, device=device)
    views = list(flat.split([g.numel() for g in grads]))
    flat_grads = [g.view(-1) for g in grads]
    scale = 1.0 / world_size
    return {
        # torch's reducer: at::mul_out(bucket_view, grad, 1/world) per gradient, then grad.copy_(view) back
        "torch_pack": lambda: [torch.mul(g, scale, out=v) for v, g in zip(views, flat_grads, strict=True)],
        "torch_unpack": lambda: [g.copy_(v) for g, v in zip(flat_grads, views, strict=True)],
        "fastpar_pack": lambda: ops.pack(grads, flat, scale),
        "fastpar_unpack": lambda: ops.unpack(flat, grads),
    }


class ContentionTrial:
    """How backward and a stream of 4 MiB all-reduces slow each other when they share the machine.

    One call, on all ranks together: backward alone (b), the all-reduces alone (w), then both at once,
    the all-reduces launched asynchronously just before backward, enough of them to outlast it (b', w').
    compute_slowdown = b'/b - 1. While both ran (b' seconds) the wire did b'/(1 + k_w) of its work and the
    rest alone afterwards: w' = b' + w - b'/(1 + k_w), so 1 + k_w = b' / (b' + w - w')."""

    def __init__(
        self,
        model: torch.nn.Module,
        batch: torch.Tensor,
        loss_fn: Callable,
        device: torch.device,
        backward_s: float,
        allreduce_4mb_s: float,
    ) -> None:
        self.model, self.batch, self.loss_fn, self.device = model, batch, loss_fn, device
        self.bucket = torch.zeros(CONTENTION_BUCKET_BYTES // 4, device=device)
        self.count = max(1, min(64, math.ceil(1.5 * backward_s / allreduce_4mb_s)))
        self.samples: list[tuple[float, float, float, float]] = []

    def _launch(self) -> list:
        # one zero buffer for all: concurrent sums of zeros stay zeros, and the bytes on the wire are real
        return [dist.all_reduce(self.bucket, async_op=True) for _ in range(self.count)]

    def _loss(self) -> torch.Tensor:
        self.model.zero_grad(set_to_none=True)
        return self.loss_fn(self.model(self.batch))

    def __call__(self) -> None:
        loss = self._loss()
        launch.barrier(self.device)
        t0 = time.perf_counter()
        loss.backward()
        alone = time.perf_counter() - t0
        launch.barrier(self.device)
        t0 = time.perf_counter()
        for work in self._launch():
            work.wait()
        wire = time.perf_counter() - t0
        loss = self._loss()
        launch.barrier(self.device)
        t0 = time.perf_counter()
        works = self._launch()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        for work in works:
            work.wait()
        self.samples.append((alone, wire, t2 - t1, time.perf_counter() - t0))

    def result(self, skip: int) -> dict[str, float]:
        """The slowdowns after the first ``skip`` trials (warm-up): per trial from the slowest rank's four times
        (ranks run each trial together), then the median over trials, so each estimate pairs measurements taken
        seconds apart and a machine that drifts between trials does not bias it."""
        kept = self.samples[skip:] or self.samples
        flat = launch.slowest([t for sample in kept for t in sample], self.device)
        computes, wires = [], []
        for b, w, b_with, w_with in zip(*[iter(flat)] * 4, strict=True):
            computes.append(b_with / b - 1.0)
            if w_with <= b_with:  # the wire finished while backward still ran: all of its work was shared
                wires.append(w_with / w - 1.0)
            else:
                alone_after = b_with + w - w_with  # the wire made no headway at all when this is <= 0
                wires.append(b_with / alone_after - 1.0 if alone_after > 0 else MAX_SLOWDOWN)
        medians = [statistics.median(flat[k::4]) for k in range(4)]
        return {
            "compute_slowdown": min(max(statistics.median(computes), 0.0), MAX_SLOWDOWN),
            "wire_slowdown": min(max(statistics.median(wires), 0.0), MAX_SLOWDOWN),
            "allreduces": float(self.count),
            "trials": float(len(kept)),
            "backward_alone_s": medians[0],
            "wire_alone_s": medians[1],
            "backward_with_wire_s": medians[2],
            "wire_with_backward_s": medians[3],
        }


def ddp_variants(
    build: Callable[[], torch.nn.Module],
    batch: torch.Tensor,
    check_batch: torch.Tensor,
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    caps_mb: Sequence[float],
    device: torch.device,
    lr: float = 0.01,
) -> dict[str, Callable]:
    """``ddp_cap_<C>mb``: a torch DDP step (zero_grad(set_to_none) + forward + backward + SGD) per cap.

    Before timing, every variant takes one step on ``check_batch`` (the same on every rank); their
    parameters must then agree (within float rounding: at more than two ranks the bucket layout changes
    the order of the all-reduce's sums), else WrongResultError on every rank."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    device_ids = [device.index] if device.type == "cuda" else None
    steps, flat = {}, {}
    for cap in caps_mb:
        model = TorchDDP(build(), device_ids=device_ids, bucket_cap_mb=cap)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)

        def step(x: torch.Tensor, model=model, optimizer=optimizer) -> None:
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(x)).backward()
            optimizer.step()

        step(check_batch)
        name = f"ddp_cap_{cap:g}mb"
        flat[name] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        steps[name] = lambda step=step: step(batch)
    reference = next(iter(flat.values()))
    wrong = {
        n: launch.agree_count(count_mismatches(f, reference, rtol=1e-5, atol=1e-7), device) for n, f in flat.items()
    }
    if any(wrong.values()):
        listing = ", ".join(f"{n}: {k} parameters differ" for n, k in wrong.items() if k)
        raise WrongResultError(f"torch DDP at different bucket caps disagrees after one step: {listing}")
    return steps


# a model of small layers: the bytes of its units, slots and buckets cost next to nothing, so what a sharded step
# adds to it is the fixed part per unit, slot and bucket
SMALL_LAYERS, SMALL_WIDTH, SMALL_BATCH = 16, 64, 8
LAYER_BYTES = (SMALL_WIDTH + 1) * SMALL_WIDTH * 4
PIPELINE_MICROBATCHES = 4


def _small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(SMALL_LAYERS):
        layers += [torch.nn.Linear(SMALL_WIDTH, SMALL_WIDTH), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def zero_bucket_variants(device: torch.device, rank: int, group=None) -> dict[str, Callable]:
    """``zero_buckets_ddp`` / ``zero_buckets``: an AdamW step of :data:`SMALL_LAYERS` x Linear(64) with one bucket
    per layer under fastpar DDP and under ZeRO-1 (``ShardedOptimizer``), checked against each other first
    (bit for bit: ZeRO-1 sums as DDP does; the second step builds the buckets by the gradients' real order)."""
    from ...ddp import DistributedDataParallel
    from ...zero import ShardedOptimizer

    caps = [LAYER_BYTES / 2**20]  # one Linear(64)'s weight and bias per bucket
    ddp = DistributedDataParallel(_small_model().to(device), process_group=group, bucket_cap_mb_list=caps)
    zero = DistributedDataParallel(_small_model().to(device), process_group=group, bucket_cap_mb_list=caps)
    trainees = {
        "zero_buckets_ddp": (ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3)),
        "zero_buckets": (zero, ShardedOptimizer(zero, torch.optim.AdamW, lr=1e-3)),
    }
    return _checked_steps(trainees, device, rank, first_steps=2, what="ZeRO-1")


def fsdp_unit_variants(device: torch.device, rank: int, group=None) -> dict[str, Callable]:
    """``fsdp_units_<ddp|keep|reshard>``: an AdamW step of :data:`SMALL_LAYERS` x Linear(64) under fastpar DDP and
    under ``fully_shard_model`` (one unit per Linear), each checked against DDP after one step first."""
    from ...ddp import DistributedDataParallel
    from ...shard import fully_shard_model

    models = {
        "fsdp_units_ddp": DistributedDataParallel(_small_model().to(device), process_group=group),
        "fsdp_units_keep": fully_shard_model(_small_model().to(device), group=group, reshard_after_forward=False),
        "fsdp_units_reshard": fully_shard_model(_small_model().to(device), group=group, reshard_after_forward=True),
    }
    trainees = {n: (m, torch.optim.AdamW(m.parameters(), lr=1e-3)) for n, m in models.items()}
    # FSDP2 reduce-scatters the sum and divides after, DDP divides first: equal within rounding
    return _checked_steps(trainees, device, rank, first_steps=1, what="fully_shard_model", rtol=1e-4, atol=1e-6)


def _checked_steps(trainees: dict, device: torch.device, rank: int, *, first_steps: int, what: str, **tolerance):
    """A timed step for each ``(model, optimizer)`` on this rank's batch of the small model, after ``first_steps``
    steps whose parameters must agree with the first trainee's (the reference: fastpar DDP) on every rank."""
    x = torch.randn(SMALL_BATCH, SMALL_WIDTH, generator=torch.Generator().manual_seed(rank)).to(device)
    steps = {}
    for name, (model, optimizer) in trainees.items():

        def step(model=model, optimizer=optimizer) -> None:
            optimizer.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            optimizer.step()
            if hasattr(optimizer, "wait_for_params") and device.type == "cpu":
                optimizer.wait_for_params()  # ZeRO's all-gather runs in gloo's threads: inside the timed step

        for _ in range(first_steps):
            step()
        steps[name] = step

    def full(model) -> torch.Tensor:
        return torch.cat([getattr(p, "full_tensor", lambda p=p: p)().detach().reshape(-1) for p in model.parameters()])

    reference = full(next(iter(trainees.values()))[0])
    wrong = {
        n: launch.agree_count(count_mismatches(full(m), reference, **tolerance), device)
        for n, (m, _) in trainees.items()
    }
    if any(wrong.values()):
        listing = ", ".join(f"{n}: {k} parameters differ" for n, k in wrong.items() if k)
        raise WrongResultError(f"{what} disagrees with fastpar DDP after {first_steps} step(s): {listing}")
    return steps


def pipeline_slot_variants(device: torch.device, world_size: int, group=None) -> dict[str, Callable]:
    """``pipeline_slots_local``: an AdamW step of the small model alone on this rank's share of the batch;
    ``pipeline_slots``: the model pipelined over the ``world_size`` ranks, :data:`PIPELINE_MICROBATCHES`
    microbatches of :data:`SMALL_BATCH` rows, 1F1B. Timed only: the pipeline's results are checked against
    one-process accumulation by ``tests/shard``."""
    from ...shard import pipeline_model

    batch = torch.randn(world_size * SMALL_BATCH, SMALL_WIDTH, generator=torch.Generator().manual_seed(0))
    batch = batch.to(device)
    local = _small_model().to(device)
    local_optimizer = torch.optim.AdamW(local.parameters(), lr=1e-3)
    pipelined = pipeline_model(
        _small_model().to(device),
        stages=world_size,
        loss_fn=lambda out, _target: out.square().mean(),
        microbatches=PIPELINE_MICROBATCHES,
        schedule="1f1b",
        example_input=batch,
        group=group,
    )
    optimizer = torch.optim.AdamW(pipelined.parameters(), lr=1e-3)

    def alone() -> None:
        local_optimizer.zero_grad(set_to_none=True)
        local(batch[:SMALL_BATCH]).square().mean().backward()
        local_optimizer.step()

    def pipelined_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        pipelined.step(batch, batch)
        optimizer.step()

    return {"pipeline_slots_local": alone, "pipeline_slots": pipelined_step}


def step_overheads(seconds: dict[str, float], world_size: int) -> dict[str, float]:
    """The profile's ``overheads`` (medians of the same interleaved rounds): per FSDP unit, what sharding it kept
    gathered adds to DDP's step and what resharding it after forward adds on top; per ZeRO bucket, what ZeRO-1
    adds to DDP's step; per pipeline slot (of the (M + S - 1) of a 1F1B step), what pipelining adds to the model
    stepped alone."""
    keep = (seconds["fsdp_units_keep"] - seconds["fsdp_units_ddp"]) / SMALL_LAYERS
    reshard = (seconds["fsdp_units_reshard"] - seconds["fsdp_units_keep"]) / SMALL_LAYERS
    overheads = {
        "fsdp_unit_s": max(0.0, keep),
        "fsdp_regather_s": max(0.0, reshard),
        "fsdp_unit_bytes": float(LAYER_BYTES),
    }
    zero = (seconds["zero_buckets"] - seconds["zero_buckets_ddp"]) / SMALL_LAYERS
    slots = PIPELINE_MICROBATCHES + world_size - 1
    pipeline = (seconds["pipeline_slots"] - seconds["pipeline_slots_local"]) / slots
    return overheads | {
        "zero_bucket_s": max(0.0, zero),
        "zero_bucket_bytes": float(LAYER_BYTES),
        "pipeline_slot_s": max(0.0, pipeline),
        "pipeline_message_bytes": float(SMALL_BATCH * SMALL_WIDTH * 4),
    }
