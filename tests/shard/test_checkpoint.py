"""Sharded checkpoints (fastpar/shard/checkpoint.py): pieces written by 2 ranks with their global offsets load at 3
ranks cut differently (and the other way round), FSDP2's DTensor state saved at 2 ranks is the same state at 3,
the consolidated export is the plain model's state dict, and a checkpoint of another model is refused by name."""

from __future__ import annotations

import pytest
import torch

from fastpar.launcher import spawn
from fastpar.shard import checkpoint as sharded

NUMEL = 23  # odd: no cut is even


def _cut(numel: int, world_size: int) -> list[tuple[int, int, int]]:
    """Uneven contiguous pieces, like ZeRO's padded bucket slices: rank r's (rank, offset, length)."""
    bounds = [0] + [numel * r // world_size + r for r in range(1, world_size)] + [numel]
    return [(r, bounds[r], bounds[r + 1] - bounds[r]) for r in range(world_size)]


def _whole() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"exp_avg": torch.randn(NUMEL, generator=g), "weight": torch.randn(3, 5, generator=g)}


def _state(rank: int, world_size: int, fill: bool) -> dict:
    whole = _whole()
    ranges = _cut(NUMEL, world_size)
    _, offset, length = ranges[rank]
    piece = whole["exp_avg"][offset : offset + length].clone() if fill else torch.zeros(length)
    return {
        "model": {"weight": whole["weight"].clone() if fill else torch.zeros(3, 5)},
        "optim": {"state": {"weight": {"exp_avg": sharded.flat_pieces(piece, offset, ranges, NUMEL)}}},
    }


def _save(rank: int, world_size: int, directory: str) -> list[str] | None:
    return sharded.save_sharded(_state(rank, world_size, True), directory, 7, {"format": 2, "step": 7}, keep=2)


def _load(rank: int, world_size: int, path: str) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
    state = _state(rank, world_size, False)
    sharded.load_sharded(state, path)
    _, offset, length = _cut(NUMEL, world_size)[rank]
    return sharded.local_piece(state["optim"]["state"]["weight"]["exp_avg"]), state["model"]["weight"], (offset, length)


@pytest.mark.parametrize(("written", "loaded"), [(2, 3), pytest.param(3, 2, marks=pytest.mark.slow)])
def test_pieces_written_at_one_world_size_load_at_another(tmp_path, written, loaded):
    kept = spawn(_save, written, str(tmp_path))[0]
    folder = tmp_path / "ckpt-000000007"
    assert kept == [str(folder)] and sorted(p.name for p in folder.iterdir())[:2] == [".metadata", "__0_0.distcp"]
    assert not list(tmp_path.glob(".ckpt-*"))  # the temporary folder was renamed
    whole = _whole()
    for piece, weight, (offset, length) in spawn(_load, loaded, str(folder)):
        assert torch.equal(piece, whole["exp_avg"][offset : offset + length])
        assert torch.equal(weight, whole["weight"])
    assert sharded.read_trainer_record(folder)["step"] == 7
    consolidated = sharded.consolidated_state(folder)
    assert torch.equal(consolidated["optim"]["state"]["weight"]["exp_avg"], whole["exp_avg"])
    out = sharded.export_consolidated(folder, tmp_path / "export" / "model.pt")
    assert list(torch.load(out, weights_only=True)) == ["weight"]  # the model only: a plain state dict
    assert torch.equal(torch.load(out, weights_only=True)["weight"], whole["weight"])


def test_a_checkpoint_of_another_model_is_refused_naming_the_keys():
    saved = {"0.weight": torch.Size([32, 8]), "0.bias": torch.Size([32]), "2.weight": torch.Size([3, 32])}
    expected = {"0.weight": torch.Size([48, 8]), "0.bias": torch.Size([32]), "4.weight": torch.Size([3, 32])}
    with pytest.raises(sharded.IncompatibleCheckpointError) as caught:
        sharded.check_compatible(expected, saved, "ck/ckpt-000000007")
    message = str(caught.value)
    assert "missing from the checkpoint: 4.weight" in message and "not in the model: 2.weight" in message
    assert "0.weight: checkpoint [32, 8], model [48, 8]" in message and "empty checkpoint_dir" in message
    sharded.check_compatible({"0.bias": torch.Size([32])}, saved, "x", subset=True)  # a pipeline stage's share


def test_export_refuses_a_folder_that_is_not_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a sharded checkpoint"):
        sharded.export_consolidated(tmp_path, tmp_path / "model.pt")


# --- FSDP2: DTensor state through torch's get_state_dict / set_state_dict -------------------------------
def _fsdp_model_and_optimizer():
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _full(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    return {"model": model_state, "optim": optim_state["state"]}


def _fsdp_save(rank: int, world_size: int, directory: str) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = _fsdp_model_and_optimizer()
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        model(torch.randn(4, 8, generator=g)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    model_state, optim_state = get_state_dict(model, optimizer)
    sharded.save_sharded({"model": model_state, "optim": optim_state}, directory, 2, None, keep=1)
    return _full(model, optimizer)


def _fsdp_load(rank: int, world_size: int, path: str) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optimizer = _fsdp_model_and_optimizer()
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    sharded.load_sharded(state, path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _full(model, optimizer)


def _assert_equal_nested(a, b, where=""):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_equal_nested(a[k], b[k], f"{where}.{k}")
    else:
        assert torch.equal(a, b), where


@pytest.mark.slow
@pytest.mark.parametrize(("written", "loaded"), [(2, 3), (3, 2)])
def test_fsdp2_state_saved_at_one_world_size_is_the_same_state_at_another(tmp_path, written, loaded):
    saved = spawn(_fsdp_save, written, str(tmp_path))[0]
    for full in spawn(_fsdp_load, loaded, str(tmp_path / "ckpt-000000002")):
        _assert_equal_nested(full, saved)
