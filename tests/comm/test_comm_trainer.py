"""fastpar.Trainer runs its CPU processes on the "fastpar" backend by default, and on gloo when asked."""

from __future__ import annotations

import json

import pytest
import torch

from fastpar.train import Trainer, TrainingOptions, environment


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


class RecordBackend:
    """Output function (rank 0): writes the process group's backend and shared-memory status once."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, info: dict) -> None:
        if info["state"] == "start":
            import torch.distributed as dist

            import fastpar

            with open(self.path, "w") as fh:
                json.dump({"backend": dist.get_backend(), "status": fastpar.comm.shm_status()}, fh)


def test_cpu_plan_picks_fastpar_by_default_and_gloo_on_request(monkeypatch):
    for name in environment.TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    assert environment.resolve("cpu", devices=2).backend == "fastpar"
    assert environment.resolve("cpu", devices=2, backend="gloo").backend == "gloo"
    assert environment.resolve("cpu", devices=1).backend is None  # one process: no group at all


@pytest.mark.slow
def test_trainer_cpu_processes_reduce_through_shared_memory(tmp_path):
    record = tmp_path / "backend.json"
    x, y = torch.randn(64, 4, generator=torch.Generator().manual_seed(0)), torch.arange(64) % 2
    options = TrainingOptions(
        execution_environment="cpu",
        devices=2,
        max_epochs=1,
        batch_size=8,
        progress_bar=False,
        output_dir=str(tmp_path),
        output_fns=[RecordBackend(str(record))],
    )
    Trainer(make_model, make_optimizer, torch.nn.functional.cross_entropy, (x, y), options=options).fit()
    seen = json.loads(record.read_text())
    assert seen == {"backend": "fastpar", "status": {"backend": "fastpar", "shm": True, "reason": "", "nodes": 1}}
