"""fastpar.Trainer on CPU: 2 gloo ranks started by torch's elastic launcher, and single in-process runs.

The 2-rank torch-DDP run is the reference: fastpar's DDP must give the same bits, a run resumed from
a mid-run checkpoint and a run whose rank 1 is SIGKILLed mid-epoch (restarted by the elastic agent)
must end with bit-identical parameters. Launches are few and shared through module-scoped fixtures;
everything that needs no second process runs in this one.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from fastpar.train import ExecutionEnvironmentError, Trainer, TrainingOptions, environment
from fastpar.train import checkpoint as ckpt
from fastpar.train.data import make_loader
from fastpar.train.loop import INFO_KEYS
from fastpar.user_errors import OptionError

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


class Blobs(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int) -> None:
        self.x, self.y = blobs(n, seed)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class StopAt:
    """Output function: logs every info record to a file and asks to stop at ``step``."""

    def __init__(self, step: int, log: str) -> None:
        self.step, self.log = step, log

    def __call__(self, info: dict):
        with open(self.log, "a") as fh:
            fh.write(json.dumps(info) + "\n")
        return np.bool_(info["state"] == "iteration" and info["iteration"] >= self.step)  # truthy, not `True`


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
    base = dict(
        max_epochs=2,
        batch_size=16,
        execution_environment="cpu",
        devices=2,
        ddp="torch",
        log_every=4,
        validation_data=VAL,
        output_dir=str(tmp / "out"),
        progress_bar=False,
    )
    return TrainingOptions(**{**base, **overrides})


def fit(tmp: Path, loss_fn=torch.nn.functional.cross_entropy, data=TRAIN, **overrides):
    return Trainer(make_model, make_optimizer, loss_fn, data, options=options(tmp, **overrides)).fit()


def assert_same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), f"{name} differs: max |diff| {(x - y).abs().max().item():.3g}"


def losses_after(result, step: int) -> list[float]:
    return [r["loss"] for r in result.history if r["iteration"] > step]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """2 ranks, torch DDP, the progress plot."""
    return fit(tmp_path_factory.mktemp("reference"), plots="training-progress")


@pytest.fixture(scope="module")
def fastpar_run(tmp_path_factory):
    """The same run on fastpar's DDP, keeping a checkpoint every 4 steps."""
    tmp = tmp_path_factory.mktemp("fastpar")
    result = fit(tmp, ddp="fastpar", checkpoint_dir=str(tmp / "ck"), checkpoint_every=4, keep_checkpoints=9)
    return result, tmp / "ck"


# --- 2-rank runs ----------------------------------------------------------------------------------
def test_run_learns_and_writes_metrics_and_plot(reference):
    history = reference.history
    assert isinstance(reference.model, torch.nn.Sequential)  # a trained module, not a state dict
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


@pytest.mark.slow
def test_fastpar_ddp_gives_bit_identical_results_to_torch_ddp(reference, fastpar_run):
    result, _ = fastpar_run
    assert result.steps == STEPS
    assert_same_parameters(result.model, reference.model)  # fp32 on gloo: same buckets' sums, same bits
    assert [r["loss"] for r in result.history] == [r["loss"] for r in reference.history]
    assert result.last("val_accuracy") == reference.last("val_accuracy")


@pytest.mark.slow
def test_resume_mid_run_from_a_dataloader_and_output_function_stops_every_rank(reference, fastpar_run, tmp_path):
    """Resume at step 12 of the fastpar run (now on torch DDP) with the same samples given as a torch DataLoader
    made in the launcher (re-planned per rank: 18 steps/epoch, not 36); an output function's truthy answer
    at step 24 stops both ranks there, with exactly the fastpar run's parameters of step 24."""
    _, ckdir = fastpar_run
    assert [p.name for p in ckpt.list_checkpoints(ckdir)] == [f"ckpt-{s:09d}.pt" for s in range(4, STEPS + 1, 4)]
    (tmp_path / "ck").mkdir()
    shutil.copy(ckdir / "ckpt-000000012.pt", tmp_path / "ck")  # as if the run had stopped at step 12
    log = tmp_path / "calls.jsonl"
    loader = torch.utils.data.DataLoader(Blobs(576, seed=1), batch_size=16, shuffle=True)
    resumed = fit(
        tmp_path,
        data=loader,
        output_fns=[StopAt(24, str(log))],
        checkpoint_dir=str(tmp_path / "ck"),
        checkpoint_every=8,
        resume=True,
    )
    assert resumed.stopped_early and resumed.steps == 24 and resumed.history[-1]["epoch"] == 1
    at_24 = torch.load(ckdir / "ckpt-000000024.pt", weights_only=True)["model"]
    for name, value in resumed.model.state_dict().items():
        assert torch.equal(value, at_24[name]), f"{name} differs from the uninterrupted run at step 24"
    assert losses_after(resumed, 12) == [r["loss"] for r in reference.history if 12 < r["iteration"] <= 24]
    assert [Path(p).name for p in resumed.checkpoints] == [f"ckpt-{s:09d}.pt" for s in (12, 16, 24)]

    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls[0]["state"] == "start" and calls[0]["iteration"] == 12 and calls[-1]["state"] == "done"
    assert [c["iteration"] for c in calls if c["state"] == "iteration"] == list(range(13, 25))  # every step
    for call in calls:
        assert set(call) == set(INFO_KEYS)
    at_18 = next(c for c in calls if c["iteration"] == 18)
    assert at_18["val_loss"] > 0 and 0 <= at_18["val_accuracy"] <= 1 and at_18["lr"] == 0.05
    assert at_18["loss"] > 0 and 0 <= at_18["accuracy"] <= 1 and at_18["elapsed"] > 0 and at_18["epoch"] == 0
    assert calls[-1]["iteration"] == 24 and calls[-1]["total_steps"] == STEPS


@pytest.mark.slow
def test_killed_worker_restarts_and_ends_bit_identical(reference, tmp_path):
    loss = KillingLoss(at=10, marker=str(tmp_path / "killed-once"))  # dies in step 10, mid-epoch 1
    result = fit(tmp_path, loss_fn=loss, checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=4, max_restarts=1)
    assert (tmp_path / "killed-once").exists()
    assert result.steps == STEPS
    assert_same_parameters(result.model, reference.model)


# --- one process, in this process -------------------------------------------------------------------
def single(
    tmp: Path,
    model=make_model,
    optimizer=make_optimizer,
    loss_fn=torch.nn.functional.cross_entropy,
    data=TRAIN,
    **overrides,
):
    opts = options(tmp, devices=1, **overrides)
    return Trainer(model, optimizer, loss_fn, data, options=opts).fit()


def test_single_process_trains_the_given_module_in_place(tmp_path):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    result = single(tmp_path, model, optimizer, max_epochs=1, grad_clip_norm=1.0, mixed_precision=True)
    assert result.model is model
    assert result.steps == 576 // 16
    assert result.last("val_accuracy") > 0.6


@pytest.mark.slow
def test_a_module_instance_on_two_processes_trains_like_a_factory(reference, tmp_path):
    """Each worker trains its own copy: through torch's pickler the workers would share one storage and every
    rank's step would land on it (parameters moved twice as far per step)."""
    torch.manual_seed(0)  # what the trainer does before it calls a factory
    result = Trainer(
        make_model(), make_optimizer, torch.nn.functional.cross_entropy, TRAIN, options=options(tmp_path)
    ).fit()
    assert_same_parameters(result.model, reference.model)


def test_private_copy_shares_no_storage_with_what_it_was_given():
    from fastpar.train.job import Job, OptimizerSpec, private_copy

    model = make_model()
    optimizer = make_optimizer(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()  # momentum buffers: state to copy
    job = Job(model, OptimizerSpec.from_optimizer(optimizer, model), None, TRAIN, TrainingOptions(), None)
    copied = private_copy(job)
    ptrs = {t.data_ptr() for t in model.state_dict().values()}
    ptrs |= {v.data_ptr() for s in optimizer.state_dict()["state"].values() for v in s.values() if torch.is_tensor(v)}
    mine = [t.data_ptr() for t in copied.model.state_dict().values()]
    mine += [v.data_ptr() for s in copied.optimizer.state["state"].values() for v in s.values() if torch.is_tensor(v)]
    assert len(mine) == 8 and not ptrs & set(mine)  # 4 parameters, 4 momentum buffers


def test_gradient_accumulation_equals_a_larger_batch(tmp_path):
    accumulated = single(tmp_path / "a", batch_size=8, grad_accum_steps=2, max_epochs=1)
    large = single(tmp_path / "b", batch_size=16, max_epochs=1)
    assert accumulated.steps == large.steps == 576 // 16
    for name, x in accumulated.model.state_dict().items():
        y = large.model.state_dict()[name]
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=f"{name}: accumulation differs from one batch")


def make_regressor() -> torch.nn.Module:
    return torch.nn.Linear(8, 1)


def test_regression_from_float64_numpy_arrays(tmp_path):
    """numpy's default float64 inputs and targets train a float32 model; no accuracy for regression."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 8))  # float64
    y = x @ np.arange(8.0)[:, None] + 0.01 * rng.standard_normal((512, 1))
    result = single(
        tmp_path,
        make_regressor,
        make_optimizer,
        torch.nn.functional.mse_loss,
        (x, y),
        validation_data=(x[:128], y[:128]),
        max_epochs=3,
    )
    assert result.history[-1]["loss"] < 0.01 * result.history[0]["loss"]
    assert result.last("val_loss") < 0.01 * y.var()
    assert all(r["accuracy"] is None for r in result.history) and result.last("val_accuracy") is None


def test_int32_numpy_labels_train_a_classifier(tmp_path):
    x, y = TRAIN
    result = single(tmp_path, data=(x.numpy(), y.numpy().astype(np.int32)), max_epochs=1)
    assert result.last("val_accuracy") > 0.6


def test_stopped_run_resumes_and_corrupt_newest_checkpoint_is_skipped(tmp_path, capsys):
    uninterrupted = single(tmp_path / "u")
    ck = str(tmp_path / "ck")
    stopped = single(
        tmp_path / "s", output_fns=[StopAt(40, str(tmp_path / "log"))], checkpoint_dir=ck, checkpoint_every=16
    )
    assert stopped.stopped_early and stopped.steps == 40
    assert [Path(p).name for p in stopped.checkpoints] == [f"ckpt-{s:09d}.pt" for s in (16, 32, 40)]
    newest = Path(stopped.checkpoints[-1])
    newest.write_bytes(newest.read_bytes()[:200])  # truncated: reported and skipped, step 32 is used
    resumed = single(tmp_path / "s", checkpoint_dir=ck, checkpoint_every=16, resume=True)
    out = capsys.readouterr().out
    assert "skipping checkpoint" in out and "ckpt-000000040.pt" in out and "ckpt-000000032.pt" in out
    assert resumed.steps == 72
    assert_same_parameters(resumed.model, uninterrupted.model)
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in uninterrupted.history]

    finished = single(tmp_path / "s", checkpoint_dir=ck, checkpoint_every=16, resume=True)  # nothing left to do
    assert finished.steps == 72 and not finished.stopped_early
    assert_same_parameters(finished.model, uninterrupted.model)
    assert finished.history == resumed.history and finished.checkpoints == resumed.checkpoints


def test_loaders_made_before_launch_are_sharded_per_rank():
    dataset = Blobs(100, seed=0)
    user_loader = torch.utils.data.DataLoader(dataset, batch_size=8, shuffle=True)
    from fastpar.data import array_loader

    for given in (user_loader, array_loader(*TRAIN, 8)):
        shards = []
        for rank in range(2):
            loader = make_loader(
                given,
                train=True,
                batch_size=99,
                rank=rank,
                world_size=2,
                seed=3,
                image_size=None,
                threads=0,
                device=torch.device("cpu"),
            )
            assert len(loader) == len(given) // 2
            shards.append([y for _, ys in loader for y in ys.tolist()])
        assert all(len(s) == 8 * (len(given) // 2) for s in shards)
    ids = []
    for rank in range(2):  # the DataLoader's samples: disjoint across ranks
        loader = make_loader(
            user_loader,
            train=False,
            batch_size=99,
            rank=rank,
            world_size=2,
            seed=3,
            image_size=None,
            threads=0,
            device=torch.device("cpu"),
        )
        ids += [tuple(x.tolist()) for xs, _ in loader for x in xs]
    assert len(ids) == len(set(ids)) == 100


def test_bf16_grad_dtype_with_torch_ddp_works_on_gloo(tmp_path, no_process_group):
    """torch's own bf16 hook refuses gloo; the trainer's compression hook reduces bf16 on any backend."""
    from fastpar.train.job import wrap_ddp

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    torch.manual_seed(0)
    model = make_model()
    ddp = wrap_ddp(model, TrainingOptions(ddp="torch", grad_dtype=torch.bfloat16), torch.device("cpu"))
    x, y = TRAIN
    torch.nn.functional.cross_entropy(ddp(x[:64]), y[:64]).backward()
    expected = torch.func.grad(
        lambda p: torch.nn.functional.cross_entropy(torch.func.functional_call(model, p, (x[:64],)), y[:64])
    )(dict(model.named_parameters()))
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name].to(torch.bfloat16).float(), rtol=0, atol=0)
        assert not torch.equal(p.grad, expected[name]), "the gradient was not reduced in bf16"


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
    with pytest.raises(FileNotFoundError, match="no-such-folder"):
        fit(tmp_path, data=str(tmp_path / "no-such-folder"))


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
        ("cpu_backend", "mpi", "cpu_backend must be one of"),
    ],
)
def test_options_are_validated(field, value, match):
    with pytest.raises(OptionError, match=match) as raised:
        TrainingOptions(**{field: value})
    assert raised.value.option == field  # the CLI and tools name the option from it
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
