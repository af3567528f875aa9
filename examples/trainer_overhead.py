"""Benchmark: fastpar.Trainer's time per step against a hand-written DDP loop doing the same work.

Both run 2 CPU processes on gloo with torch's DDP, the same MLP, data, batch size, optimizer and
fastpar.data.array_loader; the Trainer logs every ``log_every`` steps (its only extra work) and
writes no plot or checkpoint. Runs alternate (trainer, loop, trainer, loop, ...) and the median of
each is compared, so a busy machine hurts both alike.

    .venv/bin/python examples/trainer_overhead.py --steps 200 --repeats 3

``compare(...)`` returns the numbers for the bench harness.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from fastpar.launcher import spawn
from fastpar.train import Trainer, TrainingOptions

WIDTH, CLASSES, FEATURES = 512, 10, 256


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, CLASSES),
    )


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def make_data(samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(samples, FEATURES, generator=g), torch.randint(0, CLASSES, (samples,), generator=g)


def _hand_written(rank: int, world_size: int, data, batch_size: int, steps: int) -> float:
    """The loop a user would write: seconds per step on this rank."""
    from fastpar.data import array_loader

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(make_model())
    optimizer = make_optimizer(model.parameters())
    loader = array_loader(*data, batch_size, rank=rank, world_size=world_size, last_batch="drop", device="cpu")
    done, epoch = 0, 0
    start = time.perf_counter()
    while done < steps:
        loader.set_epoch(epoch)
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            done += 1
            if done == steps:
                break
        epoch += 1
    return (time.perf_counter() - start) / steps


def _trainer(data, batch_size: int, steps: int, log_every: int) -> float:
    per_epoch = len(data[0]) // (2 * batch_size)
    if steps % per_epoch:
        raise ValueError(f"steps must be a multiple of the {per_epoch} steps per epoch")
    with tempfile.TemporaryDirectory() as out:
        opts = TrainingOptions(
            max_epochs=steps // per_epoch,
            batch_size=batch_size,
            execution_environment="cpu",
            devices=2,
            ddp="torch",
            log_every=log_every,
            progress_bar=False,
            output_dir=out,
        )
        result = Trainer(make_model, make_optimizer, torch.nn.functional.cross_entropy, data, options=opts).fit()
    return result.elapsed / result.steps


def compare(steps: int = 200, batch_size: int = 64, repeats: int = 3, log_every: int = 10) -> dict[str, float]:
    """Median seconds per step of the Trainer and the hand-written loop, and their ratio."""
    data = make_data(samples=steps // 4 * 2 * batch_size)  # 4 epochs
    trainer, loop = [], []
    for _ in range(repeats):
        trainer.append(_trainer(data, batch_size, steps, log_every))
        loop.append(max(spawn(_hand_written, 2, data, batch_size, steps, threads=1)))  # the slower rank sets the pace
    t, h = statistics.median(trainer), statistics.median(loop)
    return {"trainer_s_per_step": t, "loop_s_per_step": h, "ratio": t / h, "trainer_all": trainer, "loop_all": loop}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200, help="a multiple of 4 (4 epochs)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--log-every", type=int, default=10)
    a = p.parse_args()
    r = compare(a.steps, a.batch_size, a.repeats, a.log_every)
    print(f"{'':>14} {'ms/step (median)':>17} {'all runs (ms/step)':>30}")
    print(
        f"{'trainer':>14} {1e3 * r['trainer_s_per_step']:>17.3f} {' '.join(f'{1e3 * v:.3f}' for v in r['trainer_all']):>30}"
    )
    print(
        f"{'hand-written':>14} {1e3 * r['loop_s_per_step']:>17.3f} {' '.join(f'{1e3 * v:.3f}' for v in r['loop_all']):>30}"
    )
    print(f"trainer / hand-written = {r['ratio']:.3f}  (goal <= 1.03)")


if __name__ == "__main__":
    main()
