"""Step time of fastpar's fully sharded path (fully_shard_model) against fastpar DDP on the same backend, on
CPU ranks: 8 x (Linear(1024) + GELU) + AdamW, batch 64 a rank, variants interleaved in rounds, medians.

    python scripts/fsdp_step_time.py --backend fastpar --rounds 7 --steps 3
    python scripts/fsdp_step_time.py --backend gloo --variants ddp,fsdp_layers,fsdp_root_keep
    python scripts/fsdp_step_time.py --backend gloo --width 64 --depth 16 --batch 8   # fixed cost per unit

Every variant first takes one step on the same batch; its parameters must match fastpar DDP's within a
tolerance (reduce-scatter and all-reduce sum in different orders). The official table is ``fastpar bench
shard``; this script is the quick probe of the unit, reshard and prefetch choices.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

WIDTH, DEPTH, BATCH = 1024, 8, 64

# name -> fully_shard_model keywords (None: fastpar DDP)
VARIANTS: dict[str, dict | None] = {
    "ddp": None,
    "fsdp2_by_hand": {"by_hand": True},
    "fsdp2_pairs_by_hand": {"by_hand": True, "per_unit": 2},
    "fsdp_layers": {"wrap": "auto"},
    "fsdp_layers_reshard_last": {"wrap": "auto", "reshard_last": True},
    "fsdp_layers_stock_collectives": {"wrap": "auto", "stock_collectives": True},
    "fsdp_layers_no_prefetch": {"wrap": "auto", "prefetch": 0},
    "fsdp_layers_keep": {"wrap": "auto", "reshard_after_forward": False},
    "fsdp_layers_keep_no_prefetch": {"wrap": "auto", "reshard_after_forward": False, "prefetch": 0},
    "fsdp_root": {"wrap": "root"},
    "fsdp_root_keep": {"wrap": "root", "reshard_after_forward": False},
}


def build() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
    return nn.Sequential(*layers)


def _trainee(keywords: dict | None):
    import fastpar

    if keywords is None:
        torch.manual_seed(0)
        model = fastpar.DistributedDataParallel(build())
    elif keywords.get("by_hand"):  # torch's FSDP2 as its docs apply it: each Linear, then the root
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        model = build()
        linears = [layer for layer in model if isinstance(layer, nn.Linear)]
        per_unit = keywords.get("per_unit", 1)  # >1: fewer, larger units (fully_shard of a module list)
        for first in range(0, len(linears), per_unit):
            group = linears[first : first + per_unit]
            fully_shard(group if per_unit > 1 else group[0])
        fully_shard(model)
    else:
        keywords = dict(keywords)
        reshard_last = keywords.pop("reshard_last", False)
        stock_collectives = keywords.pop("stock_collectives", False)
        model = fastpar.fully_shard_model(build, seed=0, **keywords)
        if stock_collectives:  # undo the gloo point-to-point exchanges (shard/gloo_exchange.py), to measure them
            from torch.distributed.fsdp import FSDPModule
            from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

            for unit in model.modules():
                if isinstance(unit, FSDPModule):
                    unit.set_custom_reduce_scatter(DefaultReduceScatter())
                    unit.set_custom_all_gather(DefaultAllGather())
        if reshard_last:  # undo fully_shard_model's choice to keep the last unit gathered, to measure it
            units = [m for m in model.modules() if m is not model and hasattr(m, "set_reshard_after_forward")]
            units[-1].set_reshard_after_forward(True)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def _step(model, optimizer, x: torch.Tensor) -> None:
    optimizer.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    optimizer.step()


def _full(model) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return torch.cat(
        [(p.full_tensor() if isinstance(p, DTensor) else p).detach().flatten() for p in model.parameters()]
    )


def _rank(rank: int, world: int, names: list[str], rounds: int, steps: int, shape: tuple[int, int, int]) -> dict:
    global WIDTH, DEPTH, BATCH  # spawned ranks import this module afresh: the command line's shape comes as an argument
    WIDTH, DEPTH, BATCH = shape
    trainees = {name: _trainee(VARIANTS[name]) for name in names}
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(BATCH, WIDTH, generator=gen)
    for model, optimizer in trainees.values():  # one step on the same batch: the results agree
        _step(model, optimizer, x)
    reference = _full(trainees[names[0]][0])
    worst = {name: (_full(m) - reference).abs().max().item() for name, (m, _) in trainees.items()}
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        for name, (model, optimizer) in trainees.items():
            _step(model, optimizer, x)  # warm
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                _step(model, optimizer, x)
            dist.barrier()
            times[name].append((time.perf_counter() - start) / steps)
    return {"times": times, "worst": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="fastpar", choices=["fastpar", "gloo"])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--width", type=int, default=WIDTH)
    parser.add_argument("--depth", type=int, default=DEPTH)
    parser.add_argument("--batch", type=int, default=BATCH)
    args = parser.parse_args()
    names = args.variants.split(",")
    if names[0] != "ddp":
        names = ["ddp", *[n for n in names if n != "ddp"]]
    import os

    import fastpar  # noqa: F401 - registers the fastpar backend
    from fastpar.launcher import spawn

    load_before = os.getloadavg()[0]
    shape = (args.width, args.depth, args.batch)
    results = spawn(_rank, args.nproc, names, args.rounds, args.steps, shape, backend=args.backend, timeout=1800)
    load_after = os.getloadavg()[0]
    times = results[0]["times"]
    ddp = statistics.median(times["ddp"])
    print(
        f"{args.depth} x Linear({args.width}), batch {args.batch}; backend {args.backend}, {args.nproc} ranks, {args.rounds} rounds x {args.steps} steps, "
        f"load {load_before:.1f} -> {load_after:.1f}"
    )
    print(
        f"{'variant':28s} {'median ms':>10s} {'min ms':>8s} {'x ddp':>6s} {'x ddp/round':>12s} {'max |p - ddp|':>14s}"
    )
    for name in names:
        med = statistics.median(times[name])
        per_round = statistics.median(t / d for t, d in zip(times[name], times["ddp"], strict=True))
        print(
            f"{name:28s} {med * 1e3:10.1f} {min(times[name]) * 1e3:8.1f} {med / ddp:6.2f} {per_round:12.2f} "
            f"{results[0]['worst'][name]:14.2e}"
        )


if __name__ == "__main__":
    main()
