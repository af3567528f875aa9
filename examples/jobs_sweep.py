"""Many networks at once: a hyperparameter sweep with fastpar.sweep (MATLAB's parfor over trainings).

    python examples/jobs_sweep.py                  # this machine: one trial per GPU, or per CPU core
    python examples/jobs_sweep.py --cluster slurm --partition gpu   # every trial a Slurm job

Each trial trains one network with fastpar.Trainer in its own process, pinned to its slot (a GPU and the
cores near it, or a core); more trials than slots wait in a queue. The live table shows every trial's
state and latest metrics; at the end you get the table of results, the best trial and one PNG with every
trial's validation curve. Run it again and the finished trials are read back instead of trained again.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import fastpar
from fastpar import jobs


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 20, generator=g)
    y = (x[:, :2] > 0).long() @ torch.tensor([1, 2])  # 4 classes from the signs of two features
    return x, y


def train(config: dict) -> fastpar.train.TrainingResult:
    """One trial: train a network of the given width with the given learning rate."""
    torch.manual_seed(0)  # the same initial weights whenever this trial runs
    model = nn.Sequential(nn.Linear(20, config["width"]), nn.ReLU(), nn.Linear(config["width"], 4))
    options = fastpar.TrainingOptions(
        max_epochs=4,
        batch_size=64,
        validation_data=make_data(512, seed=1),
        output_dir=str(jobs.job_dir()),  # the trial's own folder: metrics.jsonl next to its logs
        progress_bar=False,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    return fastpar.Trainer(
        model, optimizer, nn.functional.cross_entropy, make_data(2048, seed=0), options=options
    ).fit()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--cluster", default="auto", choices=["auto", "local", "slurm"])
    p.add_argument("--partition", help="Slurm partition")
    args = p.parse_args()
    configs = [{"lr": lr, "width": width} for lr in (3e-3, 3e-2) for width in (16, 64)]
    result = fastpar.sweep(
        train,
        configs,
        folder="runs/sweep",
        cluster=args.cluster,
        resources={"slurm_partition": args.partition} if args.partition else None,
    )
    table = result.table  # a pandas DataFrame when pandas is installed, else the list of records
    print(table[["lr", "width", "state", "val_loss", "val_accuracy"]] if hasattr(table, "columns") else table)
    print(f"best trial by {result.metric}: {result.best}")
    print(f"every trial's curve: {result.plot_path}")
