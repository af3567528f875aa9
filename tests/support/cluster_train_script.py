"""The training script of the multi-node tests (not a test itself): started by torchrun, or by the agents
of a ``fastpar.batch(..., nodes=2)`` job, it trains with ``execution_environment="cluster"`` and rank 0
saves the trained parameters to the path given as its first argument.

Environment knobs of the tests: FASTPAR_TEST_CPU_BACKEND (TrainingOptions.cpu_backend, default auto),
FASTPAR_TEST_CHECKPOINT_DIR (checkpoint every 2 steps there), FASTPAR_TEST_STEP_SLEEP (seconds each loss call
sleeps: a run slow enough to kill mid-way). Each rank prints its backend's status at its first step."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

import fastpar


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.ReLU(), torch.nn.Linear(24, 3))


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


class Loss:
    """cross_entropy; prints the group's backend status at the first call and sleeps FASTPAR_TEST_STEP_SLEEP."""

    def __init__(self) -> None:
        self.calls = 0
        self.sleep = float(os.environ.get("FASTPAR_TEST_STEP_SLEEP", "0"))

    def __call__(self, out, y):
        if self.calls == 0:
            print(f"rank {os.environ.get('RANK')} backend status: {fastpar.comm.shm_status()}", flush=True)
        self.calls += 1
        time.sleep(self.sleep)
        return torch.nn.functional.cross_entropy(out, y)


if __name__ == "__main__":
    out = sys.argv[1]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 12, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    options = fastpar.TrainingOptions(
        execution_environment="cluster",
        threads_per_process=1,
        max_epochs=2,
        batch_size=16,
        progress_bar=False,
        output_dir=out + ".out",
        log_every=4,
        cpu_backend=os.environ.get("FASTPAR_TEST_CPU_BACKEND", "auto"),
        checkpoint_dir=os.environ.get("FASTPAR_TEST_CHECKPOINT_DIR"),
        checkpoint_every=2 if os.environ.get("FASTPAR_TEST_CHECKPOINT_DIR") else 0,
    )
    result = fastpar.Trainer(make_model, make_optimizer, Loss(), (x, y), options=options).fit()
    if result.model is not None:  # rank 0
        torch.save(result.model.state_dict(), out)
        print(f"saved rank 0's parameters after {result.steps} steps to {out}", flush=True)
    if os.environ.get("FASTPAR_TEST_REPORT_THREADS"):  # which threads outlive fit(): gloo's must not
        names = sorted(Path(task, "comm").read_text().strip() for task in Path("/proc/self/task").iterdir())
        print(f"threads after fit on rank {os.environ.get('RANK')}: {names}", flush=True)
