"""A user's training script: the same code on CPU processes, one GPU, all GPUs or a torchrun cluster.

    python examples/train_classifier.py                       # auto: all GPUs, one GPU, or CPU processes
    python examples/train_classifier.py --environment cpu --devices 2
    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \
        examples/train_classifier.py --environment cluster

Models, optimizer factories and loss functions are defined at module level: the Trainer sends them to
its worker processes, which import this file to rebuild them (hence the ``__main__`` guard).
docs/guide/trainer.md includes this file as it is, and tests/test_docs.py runs it.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import fastpar


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3)


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 20, generator=g)
    return x, (x[:, :2] > 0).long() @ torch.tensor([1, 2])  # 4 classes from the signs of two features


def stop_when_accurate(info: dict) -> bool:
    """An output function: stop as soon as validation accuracy passes 97%."""
    return (info.get("val_accuracy") or 0.0) > 0.97


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--environment", default="auto", choices=["auto", "cpu", "gpu", "multi-gpu", "cluster"])
    p.add_argument("--devices", type=int, default=None)
    args = p.parse_args()
    options = fastpar.TrainingOptions(
        execution_environment=args.environment,  # the one option that moves the job
        devices=args.devices,
        max_epochs=20,
        batch_size=64,
        validation_data=make_data(1024, seed=1),
        output_fns=[stop_when_accurate],
        plots="training-progress",
        output_dir="train-output",  # metrics.jsonl and training-progress.png
        checkpoint_dir="train-output/checkpoints",
        checkpoint_every=50,
        resume=True,  # rerunning continues from the newest checkpoint
    )
    trainer = fastpar.Trainer(
        make_model, make_optimizer, nn.functional.cross_entropy, make_data(8192, 0), options=options
    )
    result = trainer.fit()
    if result.model is not None:  # rank 0 (the other ranks of a torchrun job get None)
        print(f"validation accuracy {result.last('val_accuracy'):.3f} after {result.steps} steps")
        print(f"progress plot {result.plot_path}, metrics {result.metrics_path}")


if __name__ == "__main__":
    main()
