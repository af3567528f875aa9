"""Step time of pipeline stages against fastpar DDP on the same model, on gloo and on the fastpar backend.

    python scripts/pipeline_step_time.py [--nproc 2] [--width 1024] [--depth 8] [--batch 64] [--microbatches 4]

One step = ``zero_grad`` + forward + backward + AdamW step on a global batch of ``batch x nproc`` samples, loss
MSE, model ``depth x (Linear(width, width) + GELU)``. Variants, interleaved in rounds on the same spawned ranks
(medians of the rounds):

  no_comm        the whole model on this rank's ``batch`` samples, no communication (DDP's floor)
  ddp/B          fastpar.DistributedDataParallel, ``batch`` samples per rank, on backend B
  1f1b/B, gpipe/B  fastpar.shard.pipeline_model, ``nproc`` stages, the global batch in ``microbatches``

Every variant does the same arithmetic per step across the ranks. Before timing, one backward of each pipeline
on the same global batch must give DDP's gradients (within 1e-5 relative: the microbatch sums add in another
order than DDP's per-rank batch).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn


def _model(width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict:
    import fastpar
    import fastpar.shard as shard

    groups = {"fastpar": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch * world, args.width, generator=gen)
    y = torch.randn(args.batch * world, args.width, generator=gen)
    mine = slice(rank * args.batch, (rank + 1) * args.batch)
    steps, models = {}, {}

    def plain(model, inputs, targets):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step():
            optimizer.zero_grad()
            nn.functional.mse_loss(model(inputs), targets).backward()
            optimizer.step()

        return step

    steps["no_comm"] = plain(_model(args.width, args.depth), x[mine], y[mine])
    for backend, group in groups.items():
        ddp = fastpar.DistributedDataParallel(_model(args.width, args.depth), process_group=group)
        models[f"ddp/{backend}"] = ddp
        steps[f"ddp/{backend}"] = plain(ddp, x[mine], y[mine])
        for schedule in ("1f1b", "gpipe"):
            pipelined = shard.pipeline_model(
                _model(args.width, args.depth),
                stages=world,
                loss_fn=nn.functional.mse_loss,
                microbatches=args.microbatches,
                schedule=schedule,
                example_input=x,
                group=group,
            )
            optimizer = torch.optim.AdamW(pipelined.parameters(), lr=1e-4)
            models[f"{schedule}/{backend}"] = pipelined

            def step(pipelined=pipelined, optimizer=optimizer):
                optimizer.zero_grad()
                pipelined.step(x, y)
                optimizer.step()

            steps[f"{schedule}/{backend}"] = step
    worst = _check_gradients(models, x, y, mine)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    for _ in range(args.rounds):
        for name, step in steps.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.iters):
                step()
            times[name].append((time.perf_counter() - start) / args.iters)
    pipelined = models["1f1b/fastpar"]
    return {
        "median_s": {name: statistics.median(t) for name, t in times.items()},
        "grad_rel_err": worst,
        "split": pipelined.split.points,
        "memory": shard.pipeline_memory_report(pipelined),
        "ddp_param_bytes": sum(p.numel() * p.element_size() for p in models["ddp/fastpar"].parameters()),
    }


def _check_gradients(models: dict, x, y, mine) -> float:
    """Worst relative difference between each pipeline's gradients and DDP's on the same global batch."""
    worst = 0.0
    for name, model in models.items():
        model.zero_grad()
        if name.startswith("ddp/"):
            nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
    for name, model in models.items():
        if name.startswith("ddp/"):
            continue
        model.step(x, y)
        ddp = dict(models["ddp/" + name.split("/")[1]].module.named_parameters())
        for pname, p in model.named_parameters():
            err = ((p.grad - ddp[pname].grad).abs().max() / ddp[pname].grad.abs().max()).item()
            worst = max(worst, err)
            if err > 1e-5:
                raise AssertionError(f"{name}: gradient of {pname} differs from DDP's by {err:.2e} (relative)")
    return worst


def main() -> None:
    from fastpar.launcher import spawn

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64, help="samples per rank (the pipeline gets batch x nproc)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    load = open("/proc/loadavg").read().split()[:3]
    results = spawn(_rank, args.nproc, args, backend="fastpar", timeout=1800)
    print(
        f"{args.depth} x Linear({args.width}) + GELU, AdamW, {args.nproc} ranks, global batch "
        f"{args.batch * args.nproc} ({args.microbatches} microbatches for the pipelines); split "
        f"{results[0]['split']}; load average before {' '.join(load)}, after {' '.join(open('/proc/loadavg').read().split()[:3])}"
    )
    print(f"gradients vs DDP: worst relative difference {max(r['grad_rel_err'] for r in results):.1e}")
    slowest = {name: max(r["median_s"][name] for r in results) for name in results[0]["median_s"]}
    print(f"{'variant':<14}{'step ms':>10}{'/ ddp same backend':>20}{'/ no_comm':>11}")
    for name, seconds in slowest.items():
        backend = name.split("/")[1] if "/" in name else None
        vs_ddp = f"{seconds / slowest['ddp/' + backend]:.2f}" if backend else "-"
        print(f"{name:<14}{seconds * 1e3:>10.1f}{vs_ddp:>20}{seconds / slowest['no_comm']:>11.2f}")
    for rank, r in enumerate(results):
        print(
            f"rank {rank}: pipeline parameters {r['memory']['parameters'] / 2**20:.1f} MiB, gradients "
            f"{r['memory']['gradients'] / 2**20:.1f} MiB; DDP parameters {r['ddp_param_bytes'] / 2**20:.1f} MiB"
        )


if __name__ == "__main__":
    main()
