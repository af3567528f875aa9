"""TrainingOptions(mixed_precision="fp16"): float16 autocast with loss scaling. It runs on GPUs with ddp, zero1 or
zero2, and is refused elsewhere with the reason. The step's wiring (scale, unscale before clipping, skipped steps,
the scale's growth, its state in checkpoints) is checked here on the CPU, where torch's autocast and GradScaler also
run, with the GPU-only check lifted: bit-identical to a hand-written torch loop, and resumed exactly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastpar.train import Trainer, TrainingOptions
from fastpar.user_errors import OptionError


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    # large inputs: at the initial scale (65536) the float16 gradients overflow, so steps are skipped at first
    return [(100 * torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(12)]


DATA = batches()


def hand_loop(epochs: int) -> tuple[dict[str, torch.Tensor], float]:
    torch.manual_seed(0)  # the Trainer's seeding before it builds the model
    model, scaler = make_model(), torch.amp.GradScaler("cpu")
    opt = make_optimizer(model.parameters())
    for _ in range(epochs):
        for x, y in DATA:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    return model.state_dict(), scaler.get_scale()


@pytest.fixture
def fp16_on_cpu(monkeypatch):
    """Lift the GPU-only check: the same code path, on the CPU's float16 autocast."""
    import fastpar.train.loop as loop
    import fastpar.train.trainer as trainer

    monkeypatch.setattr(loop, "check_fp16", lambda device, strategy: None)
    monkeypatch.setattr(trainer, "check_fp16", lambda device, strategy: None)


def fit(tmp_path, epochs: int, **overrides):
    opts = TrainingOptions(
        execution_environment="cpu",
        devices=1,
        max_epochs=epochs,
        batch_size=16,
        mixed_precision="fp16",
        grad_clip_norm=1.0,
        progress_bar=False,
        output_dir=str(tmp_path / "out"),
        **overrides,
    )
    return Trainer(make_model, make_optimizer, F.cross_entropy, DATA, options=opts).fit()


def test_fp16_steps_like_torch_autocast_and_grad_scaler(tmp_path, fp16_on_cpu):
    expected, scale = hand_loop(epochs=2)
    assert scale < 65536.0  # overflows happened: steps were skipped and the scale backed off
    result = fit(tmp_path, epochs=2)
    for name, tensor in expected.items():
        assert torch.equal(result.model.state_dict()[name], tensor), name


def test_fp16_resumes_with_its_loss_scale(tmp_path, fp16_on_cpu):
    expected, _ = hand_loop(epochs=3)
    fit(tmp_path, epochs=1, checkpoint_dir=str(tmp_path / "ck"))
    resumed = fit(tmp_path, epochs=3, checkpoint_dir=str(tmp_path / "ck"), resume=True)
    assert resumed.start_step == len(DATA)
    for name, tensor in expected.items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), f"{name}: the loss scale was not resumed"


def test_fp16_on_the_cpu_is_refused_before_launch(tmp_path):
    opts = TrainingOptions(execution_environment="cpu", devices=2, mixed_precision="fp16", output_dir=str(tmp_path))
    with pytest.raises(OptionError, match=r"mixed_precision='fp16' is for GPUs.*use mixed_precision='bf16'"):
        Trainer(make_model, make_optimizer, F.cross_entropy, DATA, options=opts).fit()


@pytest.mark.parametrize("sharding", ["fsdp", "pipeline"])
def test_fp16_with_a_sharding_that_cannot_scale_is_refused(sharding):
    with pytest.raises(OptionError, match=rf"'fp16' needs loss scaling, which sharding='{sharding}'"):
        TrainingOptions(mixed_precision="fp16", sharding=sharding)
