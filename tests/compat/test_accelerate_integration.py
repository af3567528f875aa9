"""fastpar.integrations.accelerate, shipped: with ``enable()`` accelerate's own ``Accelerator.prepare`` builds
fastpar's DDP, bit-identical to the torch DDP it builds otherwise (gradient accumulation through
``accelerator.accumulate``); a Hugging Face ``transformers.Trainer`` run (accelerate underneath, a GPT-2 built from a
config) picks it up the same way and ends with the same parameters; ``FASTPAR_ACCELERATE_DDP=1`` enables it at
import. 2 spawned gloo ranks; each runs torch's first, then fastpar's."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest
import torch

from fastpar.launcher import spawn

pytestmark = pytest.mark.slow
STEPS = 6


def _accelerate_run(rank: int, fastpar_ddp: bool) -> dict:
    from accelerate import Accelerator

    import fastpar.integrations.accelerate as integration

    (integration.enable if fastpar_ddp else integration.disable)()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(8, 12, generator=g), torch.randn(8, 3, generator=g)
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.detach().clone())
    params = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]
    return {"wrapper": type(model).__module__, "losses": losses, "params": params}


def _hf_trainer_run(rank: int, root: str, fastpar_ddp: bool) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    import fastpar.integrations.accelerate as integration

    (integration.enable if fastpar_ddp else integration.disable)()
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(5)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (32, 16), generator=g)]
    args = TrainingArguments(
        output_dir=f"{root}/{'fastpar' if fastpar_ddp else 'torch'}",
        per_device_train_batch_size=4,
        max_steps=STEPS,
        learning_rate=1e-3,
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return {
        "wrapper": type(trainer.model_wrapped).__module__,
        "params": [p.detach().clone() for p in trainer.model.parameters()],
    }


def _rank(rank: int, world_size: int, root: str, with_transformers: bool) -> dict:
    out = {impl: _accelerate_run(rank, impl == "fastpar") for impl in ("torch", "fastpar")}
    if with_transformers:
        out["hf"] = {impl: _hf_trainer_run(rank, root, impl == "fastpar") for impl in ("torch", "fastpar")}
    return out


def test_accelerate_and_the_hf_trainer_build_fastpars_ddp_bit_identically():
    pytest.importorskip("accelerate")
    try:
        import transformers  # noqa: F401

        with_transformers = True
    except ImportError:  # the compat extra brings it
        with_transformers = False
    with tempfile.TemporaryDirectory() as root:
        results = spawn(_rank, 2, root, with_transformers, timeout=600)
    for rank, r in enumerate(results):
        assert r["torch"]["wrapper"] == "torch.nn.parallel.distributed"
        assert r["fastpar"]["wrapper"] == "fastpar.ddp.distributed"
        for key in ("losses", "params"):
            same = [torch.equal(a, b) for a, b in zip(r["torch"][key], r["fastpar"][key], strict=True)]
            assert all(same), f"rank {rank} accelerate {key}: {same}"
        if with_transformers:
            hf = r["hf"]
            assert hf["torch"]["wrapper"] == "torch.nn.parallel.distributed"
            assert hf["fastpar"]["wrapper"] == "fastpar.ddp.distributed"
            same = [torch.equal(a, b) for a, b in zip(hf["torch"]["params"], hf["fastpar"]["params"], strict=True)]
            assert all(same), f"rank {rank} transformers.Trainer parameters: {same}"


def test_the_environment_enables_it_at_import():
    pytest.importorskip("accelerate")
    code = (
        "import accelerate, fastpar; import fastpar.integrations.accelerate as a; assert a.is_enabled(); "
        "a.disable(); assert not a.is_enabled()"
    )
    env = {**os.environ, "FASTPAR_ACCELERATE_DDP": "1"}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=env)
    env.pop("FASTPAR_ACCELERATE_DDP")
    off = "import accelerate, fastpar; import fastpar.integrations.accelerate as a; assert not a.is_enabled()"
    subprocess.run([sys.executable, "-c", off], check=True, timeout=120, env=env)
