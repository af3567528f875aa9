"""Measured bytes and step times of each training strategy on real ranks, to check the planner's predictions
(imported by spawned ranks; used by tests/costmodel/test_memory_planner_measured.py and bench/plan_accuracy.py).

Bytes are counted per distinct storage (views of one flat buffer count once), after a full step:
parameters, gradients (where they live after backward: ``.grad``, bucket buffers or shards) and optimizer
state. Engines: fastpar's DDP and ``ShardedOptimizer`` (ZeRO-1, and ZeRO-2 when it has ``shard_gradients``),
``fastpar.shard.fully_shard_model`` (FSDP2; where it is missing, torch's ``fully_shard`` per repeated layer
and at the root), and ``fastpar.shard.pipeline_model`` (where it is missing, torch's ``PipelineStage`` +
``Schedule1F1B``/``ScheduleGPipe`` by hand) over the planner's split, schedule and microbatches.
"""

from __future__ import annotations

import time
from statistics import median

import torch
import torch.distributed as dist
from torch import nn

from fastpar.costmodel.model_spec import ModelSpec, model_layers
from fastpar.costmodel.reference_transformer import ReferenceTransformer


def _storages(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):  # a DTensor: this rank's shard
            t = t.to_local()
        s = t.untyped_storage()
        if s._cdata not in seen:
            seen.add(s._cdata)
            total += s.nbytes()
    return total


def _state_tensors(optimizers) -> list[torch.Tensor]:
    return [v for opt in optimizers for state in opt.state.values() for v in state.values() if torch.is_tensor(v)]


def _build(model_kwargs) -> ReferenceTransformer:
    torch.manual_seed(0)
    return ReferenceTransformer(**model_kwargs)


class _Engine:
    """One strategy's model and optimizer; ``step(ids)`` trains one step, ``bytes()`` counts what it holds."""

    def __init__(
        self, strategy: str, options: dict, model_kwargs: dict, rank: int, world: int, config_batch: int
    ) -> None:
        import fastpar

        self.strategy, self.rank, self.world = strategy, rank, world
        module = _build(model_kwargs)
        self.loss = ReferenceTransformer.loss
        adamw = dict(lr=1e-3, weight_decay=0.01)
        self.grad_bytes_after_backward = 0
        if strategy == "local":  # no communication: the compute floor of a step, timed in the same rounds
            self.model = module
            self.opt = torch.optim.AdamW(module.parameters(), **adamw)
        elif strategy == "ddp":
            self.model = fastpar.DistributedDataParallel(module)
            self.opt = torch.optim.AdamW(self.model.parameters(), **adamw)
        elif strategy in ("zero1", "zero2"):
            self.model = fastpar.DistributedDataParallel(module)
            extra = {"shard_gradients": True} if strategy == "zero2" else {}
            self.opt = fastpar.ShardedOptimizer(self.model, torch.optim.AdamW, **extra, **adamw)
        elif strategy == "fsdp":
            self.model = _fully_shard(
                module, options.get("reshard_after_forward", True), options.get("blocks_per_unit", 1)
            )
            self.opt = torch.optim.AdamW(self.model.parameters(), **adamw)
        elif strategy == "pipeline":
            self.pipeline = _pipeline(module, options, rank, world, self.loss, config_batch)
            self.model = self.pipeline.module if hasattr(self.pipeline, "module") else self.pipeline.model
            self.opt = torch.optim.AdamW(self.model.parameters(), **adamw)
        else:
            raise ValueError(strategy)

    def step(self, ids: torch.Tensor) -> None:
        self.opt.zero_grad()
        if self.strategy == "pipeline":
            # the pipeline trains on its S devices' batches at once (what data parallelism would give them)
            full = ids.repeat(self.world, 1)
            self.pipeline.step(full, full)
        else:
            self.loss(self.model(ids), ids).backward()
        self.grad_bytes_after_backward = _storages(p.grad for p in self.model.parameters())
        self.opt.step()

    def bytes(self) -> dict[str, int]:
        """Parameters, gradients and optimizer state; ``"buffers_included"`` is 1 where the engine's own report
        counts its persistent buffers (ZeRO's scratch and pool) among the gradients."""
        if self.strategy in ("zero1", "zero2"):
            report = getattr(self.opt, "memory_report", None)
            if report is not None:
                got = report()
                return {
                    **{k: int(got[k]) for k in ("parameters", "gradients", "optimizer_state")},
                    "buffers_included": 1,
                }
            return {
                "parameters": _storages(zb.param_flat for zb in self.opt._sharded),
                "gradients": _storages(zb.bucket.grad_flat for zb in self.opt._sharded),  # ZeRO-1's gradients
                "optimizer_state": _storages(_state_tensors(self.opt._inner)),
                "buffers_included": 0,
            }
        return {
            "parameters": _storages(self.model.parameters()),
            "gradients": self.grad_bytes_after_backward,
            "optimizer_state": _storages(_state_tensors([self.opt])),
            "buffers_included": 0,
        }


def _fully_shard(module: nn.Module, reshard: bool, blocks_per_unit: int = 1) -> nn.Module:
    """fastpar's FSDP2 entry point where it exists, else torch's ``fully_shard`` by hand on the same units."""
    try:
        from fastpar.shard import fully_shard_model
    except ImportError:
        from torch.distributed.fsdp import fully_shard

        for _, layer, repeated in model_layers(module):
            if repeated and any(True for _ in layer.parameters()):
                fully_shard(layer, reshard_after_forward=reshard)
        return fully_shard(module)
    return fully_shard_model(module, wrap="auto", reshard_after_forward=reshard, blocks_per_unit=blocks_per_unit)


class _TorchPipeline:
    """torch's pipelining over the planner's split, by hand: this rank's stage and the schedule."""

    def __init__(self, module, options, rank, world, loss) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        layers = model_layers(module)
        starts = [0, *options["split"], len(layers)]
        self.model = nn.Sequential(*(layers[i][1] for i in range(starts[rank], starts[rank + 1])))
        stage = PipelineStage(self.model, rank, world, torch.device("cpu"))
        schedule = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[options["schedule"]]
        self.schedule = schedule(stage, n_microbatches=options["microbatches"], loss_fn=loss)
        self.rank, self.world = rank, world

    def step(self, inputs, targets) -> None:
        if self.rank == 0:
            self.schedule.step(inputs)
        else:
            self.schedule.step(target=targets)


def _pipeline(module, options, rank, world, loss, batch_size):
    """fastpar's ``pipeline_model`` where it exists (the plan's split, schedule and microbatches), else torch's
    pipelining by hand."""
    try:
        from fastpar.shard import pipeline_model
    except ImportError:
        return _TorchPipeline(module, options, rank, world, loss)
    example = torch.zeros(batch_size * world, module.config.seq_len, dtype=torch.long)
    return pipeline_model(
        module,
        stages=options["stages"],
        loss_fn=loss,
        microbatches=options["microbatches"],
        schedule=options["schedule"],
        split=list(options["split"]),
        example_input=example,
    )


def measure_rank(rank: int, world: int, config: dict) -> dict:
    """On every rank: build each strategy in ``config["strategies"]`` (label -> (strategy, options)), train
    ``config["warmup"]`` steps, then ``config["rounds"]`` rounds of one timed step per strategy, interleaved.
    Returns {label: {"bytes": {...}, "step_s": [seconds per round]}}."""
    torch.manual_seed(1 + rank)
    ids = torch.randint(0, config["model"]["vocab"], (config["batch_size"], config["model"]["seq_len"]))
    engines = {
        label: _Engine(s, o, config["model"], rank, world, config["batch_size"])
        for label, (s, o) in config["strategies"].items()
    }
    for engine in engines.values():
        for _ in range(config.get("warmup", 1)):
            engine.step(ids)
    times = {label: [] for label in engines}
    sizes = config.get("collective_bytes", [])
    wire = {(op, n): [] for op in _COLLECTIVES for n in sizes}
    for _ in range(config.get("rounds", 0)):
        for label, engine in engines.items():
            dist.barrier()
            t0 = time.perf_counter()
            engine.step(ids)
            times[label].append(time.perf_counter() - t0)
        for (op, n), seconds in wire.items():  # the collectives, under the load of the same rounds
            dist.barrier()
            seconds.append(_collective(op, n, world))
    out = {label: {"bytes": e.bytes(), "step_s": times[label]} for label, e in engines.items()}
    out["collectives"] = {f"{op}:{n}": v for (op, n), v in wire.items()}
    return out


_COLLECTIVES = ("allreduce", "reducescatter", "allgather")


def _collective(op: str, nbytes: int, world: int) -> float:
    """Seconds of one ``op`` of ``nbytes`` (as nccl-tests counts them: the larger buffer)."""
    big = torch.ones(nbytes // 4)
    small = torch.empty(big.numel() // world)
    t0 = time.perf_counter()
    if op == "allreduce":
        dist.all_reduce(big)
    elif op == "reducescatter":
        (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(small, big)
    else:
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(big, small)
    return time.perf_counter() - t0


def compare_state(estimate, results: list[dict]) -> tuple[int, int]:
    """(predicted, measured) bytes of the largest rank: parameters + gradients + optimizer state, and where the
    engine's report counts its persistent buffers (ZeRO's scratch and pool) the predicted ones too."""
    rows = [r[estimate.label]["bytes"] for r in results]
    measured = max(row["parameters"] + row["gradients"] + row["optimizer_state"] for row in rows)
    extra = estimate.memory.persistent_buffers if rows[0]["buffers_included"] else 0
    return estimate.memory.model_state + extra, measured


def slowest_rank_medians(results: list[dict]) -> dict[str, float]:
    """Per strategy, the median step over rounds of the slowest rank in each round."""
    labels = [label for label in results[0] if label != "collectives"]
    out = {}
    for label in labels:
        rounds = zip(*(r[label]["step_s"] for r in results), strict=True)
        out[label] = median(max(r) for r in rounds) if results[0][label]["step_s"] else float("nan")
    return out


def measured_profile(results: list[dict], shipped, backend: str = "gloo"):
    """A :class:`Profile` of ``backend``'s collectives timed in the rounds (slowest rank's medians), with
    ``shipped``'s contention factors (measuring those takes minutes)."""
    from fastpar.costmodel.perf_profile import CollectiveTable, Profile

    tables = {}
    for key in results[0]["collectives"]:
        op, n = key.split(":")
        rounds = zip(*(r["collectives"][key] for r in results), strict=True)
        t = median(max(r) for r in rounds)
        tables.setdefault(op, ([], []))
        tables[op][0].append(int(n))
        tables[op][1].append(t)
    return Profile(
        backend=backend,
        device="cpu",
        world_size=len(results),
        collectives={op: CollectiveTable(list(x), list(t)) for op, (x, t) in tables.items()},
        contention=dict(shipped.contention),
        meta={"created": "measured in the rounds"},
    )


def spec_of(model_kwargs: dict) -> ModelSpec:
    return ModelSpec.transformer(**model_kwargs)
