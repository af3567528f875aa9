"""fastpar.Trainer on CPU with 2 gloo ranks started by torch's elastic launcher.

One uninterrupted run is the reference; a stopped-then-resumed run and a run whose rank 1 is killed
with SIGKILL mid-epoch (and restarted by the elastic agent) must end with bit-identical parameters.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fastpar.train import ExecutionEnvironmentError, Trainer, TrainingOptions, environment
from fastpar.train import checkpoint as ckpt

CLASSES = 3


# --- module-level pieces: workers are separate processes and unpickle these by reference ----------
def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, CLASSES))


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def blobs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Three Gaussian clusters in 8-D: learnable, not trivially (clusters overlap a little)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    centres = torch.tensor([[1.5, 0, 0, 0, 0, 0, 0, 0], [0, 1.5, 0, 0, 0, 0, 0, 0], [0, 0, 1.5, 0, 0, 0, 0, 0]])
    return centres[y] + torch.randn(n, 8, generator=g), y


class StopAt:
    """Output function: logs every info record to a file and asks to stop at ``step``."""

    def __init__(self, step: int, log: str) -> None:
        self.step, self.log = step, log

    def __call__(self, info: dict) -> bool:
        with open(self.log, "a") as fh:
            fh.write(json.dumps({k: info[k] for k in ("state", "iteration", "epoch")}) + "\n")
        return info["state"] == "iteration" and info["iteration"] >= self.step


class KillingLoss:
    """Cross-entropy that SIGKILLs rank 1 at its ``at``-th training call, once (a marker file remembers)."""

    def __init__(self, at: int, marker: str) -> None:
        self.at, self.marker, self.calls = at, marker, 0

    def __call__(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            self.calls += 1
            if self.calls == self.at and dist.get_rank() == 1 and not os.path.exists(self.marker):
                Path(self.marker).touch()
                os.kill(os.getpid(), signal.SIGKILL)
        return torch.nn.functional.cross_entropy(out, y)


TRAIN, VAL = blobs(576, seed=1), blobs(192, seed=2)
STEPS = 2 * (576 // (2 * 16))  # 2 epochs of 18 steps on 2 ranks x 16 samples


def options(tmp: Path, **overrides) -> TrainingOptions:
    base = dict(max_epochs=2, batch_size=16, execution_environment="cpu", devices=2, ddp="torch", log_every=4,
                validation_data=VAL, output_dir=str(tmp / "out"), progress_bar=False)  # fmt: skip
    return TrainingOptions(**{**base, **overrides})


def fit(tmp: Path, loss_fn=torch.nn.functional.cross_entropy, **overrides):
    return Trainer(make_model, make_optimizer, loss_fn, TRAIN, options=options(tmp, **overrides)).fit()


def assert_same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), f"{name} differs: max |diff| {(x - y).abs().max().item():.3g}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    return fit(tmp, plots="training-progress")


# --- 2-rank runs ----------------------------------------------------------------------------------
def test_run_learns_and_writes_metrics_and_plot(reference):
    history = reference.history
    assert reference.steps == STEPS and not reference.stopped_early
    assert history[-1]["loss"] < 0.7 * history[0]["loss"]
    assert reference.last("val_accuracy") > 1 / CLASSES + 0.35  # chance is 1/3
    lines = [json.loads(line) for line in Path(reference.metrics_path).read_text().splitlines()]
    assert lines == history
    logged = [r["iteration"] for r in lines]
    assert logged == sorted(set(range(4, STEPS + 1, 4)) | {18, 36})  # every 4th step and both epoch ends
    assert [r["iteration"] for r in lines if "val_loss" in r] == [18, 36]
    for record in lines:
        assert {"epoch", "iteration", "loss", "accuracy", "lr", "elapsed", "samples_per_s"} <= set(record)
    png = Path(reference.plot_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    with Image.open(png) as image:
        image.verify()
        assert min(image.size) > 200


def test_fastpar_ddp_gives_the_same_result_as_torch_ddp(reference, tmp_path):
    ddp = pytest.importorskip("fastpar.ddp")
    if not hasattr(ddp, "DistributedDataParallel"):
        pytest.skip("fastpar.DistributedDataParallel is not in this tree yet")
    result = fit(tmp_path, ddp="fastpar")
    for (name, x), (_, y) in zip(result.model.state_dict().items(), reference.model.state_dict().items(), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=f"{name} differs between fastpar and torch DDP")
    assert result.last("val_accuracy") == pytest.approx(reference.last("val_accuracy"), abs=0.02)


def test_output_function_stops_and_resume_matches_uninterrupted_run(reference, tmp_path):
    log = tmp_path / "calls.jsonl"
    ckdir = tmp_path / "ck"
    stopped = fit(tmp_path, output_fns=[StopAt(12, str(log))], checkpoint_dir=str(ckdir), checkpoint_every=4,
                  keep_checkpoints=2)  # fmt: skip
    assert stopped.stopped_early and stopped.steps == 12
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls[0]["state"] == "start" and calls[-1]["state"] == "done"
    assert [c["iteration"] for c in calls if c["state"] == "iteration"] == [4, 8, 12]
    assert [Path(p).name for p in stopped.checkpoints] == ["ckpt-000000008.pt", "ckpt-000000012.pt"]  # last 2 kept

    resumed = fit(tmp_path, checkpoint_dir=str(ckdir), checkpoint_every=4, resume=True)
    assert resumed.steps == STEPS
    assert_same_parameters(resumed.model, reference.model)
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in reference.history]


def test_killed_worker_restarts_and_ends_bit_identical(reference, tmp_path):
    loss = KillingLoss(at=10, marker=str(tmp_path / "killed-once"))  # dies in step 10, mid-epoch 1
    result = fit(tmp_path, loss_fn=loss, checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=4, max_restarts=1)
    assert (tmp_path / "killed-once").exists()
    assert result.steps == STEPS
    assert_same_parameters(result.model, reference.model)


# --- one process, in this process -------------------------------------------------------------------
def test_single_process_trains_the_given_module_in_place(tmp_path):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opts = options(tmp_path, devices=1, max_epochs=1, grad_accum_steps=2, grad_clip_norm=1.0, mixed_precision=True)
    result = Trainer(model, optimizer, torch.nn.functional.cross_entropy, TRAIN, options=opts).fit()
    assert result.model is model
    assert result.steps == 576 // 16 // 2
    assert result.last("val_accuracy") > 0.6


# --- errors before any worker starts -----------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_gpu_without_gpu_is_a_clear_error(tmp_path):
    with pytest.raises(ExecutionEnvironmentError, match="needs a CUDA GPU"):
        fit(tmp_path, execution_environment="gpu", devices=None)


def test_more_devices_than_gpus_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(environment, "gpu_count", lambda: 2)
    with pytest.raises(ExecutionEnvironmentError, match="devices=4, but only 2 GPU"):
        fit(tmp_path, execution_environment="multi-gpu", devices=4)


def test_cluster_without_torchrun_names_missing_variables(monkeypatch, tmp_path):
    for name in environment.TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ExecutionEnvironmentError, match="RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_PORT"):
        fit(tmp_path, execution_environment="cluster")


def test_missing_data_folder_is_a_clear_error(tmp_path):
    opts = options(tmp_path)
    with pytest.raises(FileNotFoundError, match="no-such-folder"):
        Trainer(make_model, make_optimizer, torch.nn.functional.cross_entropy, str(tmp_path / "no-such-folder"),
                options=opts).fit()  # fmt: skip


def test_unwritable_checkpoint_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(PermissionError, match="checkpoint_dir=.*not a writable folder"):
        fit(tmp_path, checkpoint_dir=str(blocker / "ck"))


def test_old_checkpoints_need_resume(tmp_path):
    (tmp_path / "ck").mkdir()
    torch.save({}, tmp_path / "ck" / "ckpt-000000004.pt")
    with pytest.raises(FileExistsError, match="resume=True"):
        fit(tmp_path, checkpoint_dir=str(tmp_path / "ck"))


def test_unpicklable_factory_is_a_clear_error(tmp_path):
    opts = options(tmp_path)
    with pytest.raises(TypeError, match="model can't be sent to the worker processes.*module level"):
        Trainer(lambda: make_model(), make_optimizer, torch.nn.functional.cross_entropy, TRAIN, options=opts).fit()


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("execution_environment", "tpu", "execution_environment must be one of"),
        ("batch_size", 0, "batch_size must be an integer >= 1"),
        ("ddp", "apex", "ddp must be one of"),
        ("grad_dtype", torch.int8, "grad_dtype must be"),
    ],
)
def test_options_are_validated(field, value, match):
    with pytest.raises(ValueError, match=match):
        TrainingOptions(**{field: value})


# --- checkpoint files ------------------------------------------------------------------------------
def test_truncated_newest_checkpoint_is_reported_and_skipped(tmp_path):
    good = {"format": ckpt.FORMAT, "step": 4, "epoch": 0, "model": {"w": torch.ones(3)}, "optimizer": {}, "ranks": []}
    ckpt.save_atomic(good, ckpt.checkpoint_path(tmp_path, 4))
    ckpt.save_atomic({**good, "step": 8}, ckpt.checkpoint_path(tmp_path, 8))
    newest = ckpt.checkpoint_path(tmp_path, 8)
    newest.write_bytes(newest.read_bytes()[:100])  # as if the machine died mid-write without the atomic rename
    reports = []
    state, path = ckpt.load_newest_valid(tmp_path, report=reports.append)
    assert path == ckpt.checkpoint_path(tmp_path, 4) and state["step"] == 4
    assert len(reports) == 1 and "ckpt-000000008.pt" in reports[0]
    assert not list(tmp_path.glob(".*tmp*"))  # atomic writes leave no temp files
    ckpt.prune(tmp_path, keep=1)
    assert ckpt.list_checkpoints(tmp_path) == [newest]
