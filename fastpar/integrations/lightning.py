"""Lightning's ``Trainer(strategy="fastpar")``: Lightning's DDP strategy with fastpar's DDP as the wrapper, and
optionally ZeRO on fastpar's buckets.

    import lightning.pytorch as pl
    trainer = pl.Trainer(strategy="fastpar", accelerator="cpu", devices=2)            # fastpar's DDP
    trainer = pl.Trainer(strategy=FastparStrategy(sharding="zero2"), devices=2)      # + sharded optimizer and gradients

The name "fastpar" is registered with Lightning's strategy registry when this module is imported, which
``import fastpar`` does as soon as Lightning is imported (in either order). Everything else is Lightning's
``DDPStrategy``: launching, samplers, precision, checkpoints. What changes:

- the model is wrapped in :class:`fastpar.DistributedDataParallel` (same arguments; bit-identical to torch's);
- on CPU the process group uses fastpar's shared-memory backend when its extension is built (else gloo; set
  ``process_group_backend=`` to choose);
- ``sharding="zero1"`` / ``"zero2"``: each optimizer becomes a :class:`fastpar.ShardedOptimizer` over the wrapped
  model (optimizer state, and with zero2 gradients, split over the ranks; the steps equal the unsharded
  optimizer's); learning-rate schedulers are pointed at it. A checkpoint holds the full optimizer state
  (gathered on rank 0, as a plain optimizer's), so it resumes on any number of processes, sharded or not.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

SHARDINGS = ("ddp", "zero1", "zero2")


class FastparStrategy(DDPStrategy):
    strategy_name = "fastpar"

    def __init__(self, *args: Any, sharding: str = "ddp", **kwargs: Any) -> None:
        if sharding not in SHARDINGS:
            raise ValueError(f"FastparStrategy(sharding={sharding!r}): choose one of {', '.join(SHARDINGS)}")
        super().__init__(*args, **kwargs)
        self.sharding = sharding

    def _get_process_group_backend(self) -> str:
        if self._process_group_backend is None and self.root_device.type == "cpu":
            from ..comm.backend import cpu_backend

            return cpu_backend("auto")
        return super()._get_process_group_backend()

    def _setup_model(self, model):
        from ..ddp.distributed import DistributedDataParallel

        return DistributedDataParallel(module=model, device_ids=self.determine_ddp_device_ids(), **self._ddp_kwargs)

    def setup_optimizers(self, trainer) -> None:
        super().setup_optimizers(trainer)
        if self.sharding == "ddp":
            return
        from ..zero import ShardedOptimizer

        sharded = []
        for optimizer in self.optimizers:
            wrapped = ShardedOptimizer.from_optimizer(self.model, optimizer, shard_gradients=self.sharding == "zero2")
            for config in self.lr_scheduler_configs:
                if getattr(config.scheduler, "optimizer", None) is optimizer:
                    config.scheduler.optimizer = wrapped
            sharded.append(wrapped)
        self.optimizers = sharded

    def _wait_for_params(self) -> None:
        """A sharded step all-gathers the updated parameters asynchronously (the next forward waits for each
        bucket as it needs it); whatever reads parameters outside a forward waits for all of them first."""
        for optimizer in self.optimizers:
            wait = getattr(optimizer, "wait_for_params", None)
            if wait is not None:
                wait()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._wait_for_params()  # a checkpoint holds the updated parameters
        return super().lightning_module_state_dict()

    def on_train_end(self) -> None:
        self._wait_for_params()  # the trained module the user reads afterwards
        super().on_train_end()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register("fastpar", cls, description="fastpar's DDP (and ZeRO with sharding=)", override=True)


FastparStrategy.register_strategies(StrategyRegistry)

__all__ = ["FastparStrategy"]
