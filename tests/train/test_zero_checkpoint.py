"""ZeRO optimizer state as reshardable checkpoint entries (fastpar/train/zero_checkpoint.py): slices written at N
ranks, read at M and written again hold the same state bit for bit (every element of every parameter's state, and
each parameter's ``step``), equal to what the ShardedOptimizer gathers whole -- with a parameter never stepped (no
state) and one that skipped steps (its own ``step`` inside a slice)."""

from __future__ import annotations

import pytest
import torch

from fastpar.launcher import spawn


class Partly(torch.nn.Module):
    """``late`` gets gradients only from the third step on; ``never`` never does."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.late, self.never, self.last = (
            torch.nn.Linear(8, 24),
            torch.nn.Linear(24, 24),
            torch.nn.Linear(24, 24),
            torch.nn.Linear(24, 5),
        )
        self.steps = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.first(x))
        if self.steps >= 2:
            h = torch.relu(self.late(h))
        return self.last(h)


def _build(stage: int):
    import fastpar

    torch.manual_seed(0)
    module = Partly()
    model = fastpar.DistributedDataParallel(module, find_unused_parameters=True, bucket_cap_mb=0.002)
    optimizer = fastpar.ShardedOptimizer(
        model, torch.optim.AdamW, lr=0.01, weight_decay=0.1, shard_gradients=stage == 2
    )
    return module, model, optimizer


def _train_and_save(rank: int, world_size: int, directory: str, stage: int) -> dict | None:
    from fastpar.shard.checkpoint import save_sharded
    from fastpar.train.zero_checkpoint import zero_state

    module, model, optimizer = _build(stage)
    g = torch.Generator().manual_seed(rank)
    for step in range(4):
        module.steps = step
        model(torch.randn(6, 8, generator=g)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    save_sharded({"model": module.state_dict(), "optim": zero_state(optimizer)}, directory, 4, None, keep=1)
    return optimizer.state_dict()  # the whole state on rank 0


def _load_and_save_again(rank: int, world_size: int, path: str, again: str, stage: int) -> None:
    from fastpar.shard.checkpoint import save_sharded
    from fastpar.train.zero_checkpoint import load_zero_state, zero_state

    module, _, optimizer = _build(stage)
    load_zero_state(optimizer, path)
    save_sharded({"model": module.state_dict(), "optim": zero_state(optimizer)}, again, 4, None, keep=1)


def _assert_equal_nested(a, b, where="") -> None:
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _assert_equal_nested(a[k], b[k], f"{where}.{k}")
    elif torch.is_tensor(a):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


@pytest.mark.slow  # four spawns; the fast suite's Trainer smoke test writes and exports ZeRO slices
@pytest.mark.parametrize(("stage", "written", "loaded"), [(1, 2, 3), (2, 3, 2)])
def test_zero_slices_written_at_one_world_size_are_the_same_state_at_another(tmp_path, stage, written, loaded):
    from fastpar.shard.checkpoint import consolidated_state

    gathered = spawn(_train_and_save, written, str(tmp_path / "n"), stage)[0]
    spawn(_load_and_save_again, loaded, str(tmp_path / "n" / "ckpt-000000004"), str(tmp_path / "m"), stage)
    first = consolidated_state(tmp_path / "n" / "ckpt-000000004")["optim"]
    second = consolidated_state(tmp_path / "m" / "ckpt-000000004")["optim"]
    _assert_equal_nested(first, second)
    state = first["state"]
    assert "never.weight" not in state and "never.bias" not in state  # no state, as in a plain optimizer
    assert float(state["first.weight"]["step"]) == 4 and float(state["late.weight"]["step"]) == 2  # late skipped 2
    names = ["first.weight", "first.bias", "late.weight", "late.bias", "never.weight", "never.bias", "last.weight"]
    for index, name in enumerate(names + ["last.bias"]):
        for key, value in gathered["state"].get(index, {}).items():
            if key != "step":  # the flat entries: the parameter's elements in order
                assert torch.equal(state[name][key], value.reshape(-1)), (name, key)
