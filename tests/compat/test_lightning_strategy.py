"""fastpar's Lightning strategy, shipped (fastpar/integrations/lightning.py): ``Trainer(strategy="fastpar")`` by
name trains bit-identically to Lightning's own DDPStrategy; ``FastparStrategy(sharding="zero1" | "zero2")``
bit-identically to DDP with the unsharded optimizer (AdamW with a learning-rate schedule, so the scheduler must
reach the sharded optimizer); a zero2 checkpoint saved after one epoch resumes to the same parameters as two
uninterrupted epochs. 2 spawned processes on CPU; the fastpar strategy picks fastpar's backend there."""

from __future__ import annotations

import tempfile

import pytest
import torch

from fastpar.launcher import spawn

pytestmark = pytest.mark.slow
STEPS_PER_EPOCH, WORLD = 4, 2


def _data(world_size: int):
    g = torch.Generator().manual_seed(7)
    n = STEPS_PER_EPOCH * 8 * world_size
    return torch.utils.data.TensorDataset(torch.randn(n, 12, generator=g), torch.randn(n, 3, generator=g))


def _fit(strategy, root: str, epochs: int, resume_from: str | None = None, save_to: str | None = None) -> dict:
    import lightning.pytorch as pl

    class Regression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
            self.losses: list[torch.Tensor] = []
            self.wrapper = self.optimizer = ""

        def on_train_start(self):
            self.wrapper = type(self.trainer.strategy.model).__module__
            self.optimizer = type(self.trainer.optimizers[0]).__name__

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.losses.append(loss.detach().clone())
            return loss

        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(self.parameters(), lr=0.01)
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)]

    module = Regression()
    loader = torch.utils.data.DataLoader(_data(WORLD), batch_size=8, shuffle=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    trainer.fit(module, loader, ckpt_path=resume_from)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return {
        "wrapper": module.wrapper,
        "optimizer": module.optimizer,
        "losses": module.losses,
        "params": [p.detach().clone() for p in module.net.parameters()],
    }


def _rank(rank: int, world_size: int, root: str) -> dict:
    from lightning.pytorch.strategies import DDPStrategy

    import fastpar.integrations.lightning as integration

    out = {"torch": _fit(DDPStrategy(process_group_backend="gloo"), root, 2), "fastpar": _fit("fastpar", root, 2)}
    for sharding in ("zero1", "zero2"):
        out[sharding] = _fit(integration.FastparStrategy(sharding=sharding), root, 2)
    ckpt = f"{root}/zero2-epoch1.ckpt"
    _fit(integration.FastparStrategy(sharding="zero2"), root, 1, save_to=ckpt)
    out["resumed"] = _fit(integration.FastparStrategy(sharding="zero2"), root, 2, resume_from=ckpt)
    return out


def test_fastpar_strategy_by_name_and_sharded_match_lightning_ddp():
    pytest.importorskip("lightning")
    with tempfile.TemporaryDirectory() as root:
        results = spawn(_rank, WORLD, root, backend=None, timeout=600)
    for rank, r in enumerate(results):
        ref = r["torch"]
        assert ref["wrapper"] == "torch.nn.parallel.distributed"
        for case in ("fastpar", "zero1", "zero2", "resumed"):
            got = r[case]
            assert got["wrapper"] == "fastpar.ddp.distributed", f"rank {rank} {case}: {got['wrapper']}"
            assert all(torch.equal(a, b) for a, b in zip(got["params"], ref["params"], strict=True)), (
                f"rank {rank} {case}: parameters differ from Lightning's DDPStrategy"
            )
        for case in ("fastpar", "zero1", "zero2"):
            assert all(torch.equal(a, b) for a, b in zip(r[case]["losses"], ref["losses"], strict=True)), case
        assert r["fastpar"]["optimizer"] == "AdamW"
        assert r["zero1"]["optimizer"] == r["zero2"]["optimizer"] == "ShardedOptimizer"
        # the resumed run trained the second epoch only: its losses are the reference's last epoch's
        assert all(
            torch.equal(a, b) for a, b in zip(r["resumed"]["losses"], ref["losses"][STEPS_PER_EPOCH:], strict=True)
        )


def test_cpu_processes_use_fastpars_backend_unless_told():
    pytest.importorskip("lightning")
    from fastpar.comm.backend import cpu_backend
    from fastpar.integrations.lightning import FastparStrategy

    strategy = FastparStrategy(parallel_devices=[torch.device("cpu")])
    assert strategy._get_process_group_backend() == cpu_backend("auto")  # "fastpar" where the extension is built
    told = FastparStrategy(parallel_devices=[torch.device("cpu")], process_group_backend="gloo")
    assert told._get_process_group_backend() == "gloo"
    with pytest.raises(ValueError, match=r"sharding='zero3'\): choose one of ddp, zero1, zero2"):
        FastparStrategy(sharding="zero3")


def test_the_strategy_is_registered_by_name_in_either_import_order():
    pytest.importorskip("lightning")
    import subprocess
    import sys

    for first, second in (("fastpar", "lightning.pytorch"), ("lightning.pytorch", "fastpar")):
        code = (
            f"import {first}, {second}; from lightning.pytorch.strategies import StrategyRegistry; "
            "assert 'fastpar' in StrategyRegistry, sorted(StrategyRegistry)"
        )
        subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
