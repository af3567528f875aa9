"""Training in the background: fastpar.submit returns a future at once (MATLAB's parfeval).

    python examples/jobs_submit.py

The session stays free while the job trains; progress() shows the latest logged metrics (MATLAB's
afterEach), result() waits for the trained network, cancel() stops a job and every process it started.
"""

from __future__ import annotations

import time

import torch
from torch import nn

import fastpar
from fastpar import jobs


def train(epochs: int) -> fastpar.train.TrainingResult:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 20, generator=g)
    y = (x[:, :2] > 0).long() @ torch.tensor([1, 2])
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))
    options = fastpar.TrainingOptions(
        execution_environment="cpu",
        devices=1,
        max_epochs=epochs,
        batch_size=64,
        log_every=8,
        output_dir=str(jobs.job_dir()),
        progress_bar=False,
    )
    return fastpar.Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy, (x, y), options=options
    ).fit()


if __name__ == "__main__":
    future = fastpar.submit(train, 3, resources={"timeout_min": 30})  # returns at once
    endless = fastpar.submit(train, 10_000, name="too-long")
    print(f"submitted {future.id} and {endless.id}; the session is free")
    while not future.done():
        latest = future.progress()
        if latest:
            print(f"  {future.id}: epoch {latest['epoch'] + 1}, step {latest['iteration']}, loss {latest['loss']:.3f}")
        time.sleep(2)
    result = future.result()
    print(f"{future.id} done: {result.steps} steps, final loss {result.final['loss']:.3f}, model {result.model}")
    print(f"{endless.id} was {endless.state()}; cancelled: {endless.cancel()}, now {endless.state()}")
