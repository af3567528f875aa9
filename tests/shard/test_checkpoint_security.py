"""A checkpoint folder is data, never code: a planted ``.metadata`` or non-tensor entry whose pickle would run
something (here: write a marker file) runs nothing and stops the read with one error naming the file, on
every way fastpar reads a folder (the launcher's check, resume, the ZeRO/FSDP load, export). What torch
writes for each strategy loads as before (tests/train/test_train_sharding.py, tests/shard/test_checkpoint.py)."""

from __future__ import annotations

import pickle
import stat
import types
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fastpar.launcher import spawn
from fastpar.shard import checkpoint as sharded
from fastpar.train import checkpoint as ckpt
from fastpar.train import resume
from fastpar.train.trainer import check_resumable

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class _WritesMarker:
    """Unpickling this writes ``marker``: the proof that a load ran the file's code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


RECORD = {"format": sharded.SHARDED_FORMAT, "sharding": "zero1", "world_size": 1, "step": 4, "epoch": 0, "ranks": []}


def _model_state() -> dict[str, torch.Tensor]:
    return {"weight": torch.arange(6.0).view(2, 3), "bias": torch.zeros(2)}


def _folder(root: Path, hyper: object = 0.01) -> Path:
    """A sharded checkpoint folder as one process writes it: model tensors, a non-tensor entry, trainer.pt."""
    folder = root / "ckpt-000000004"
    dcp.save({"model": _model_state(), "optim": {"lr": hyper}}, checkpoint_id=str(folder), no_dist=True)
    torch.save(RECORD, folder / sharded.TRAINER_RECORD)
    return folder


def _poison_metadata(folder: Path, marker: Path) -> None:
    (folder / ".metadata").write_bytes(pickle.dumps(_WritesMarker(marker)))


def _expect_refused(where: str):
    return pytest.raises(sharded.UntrustedCheckpointError, match=rf"{where}.*not a checkpoint that fastpar or torch")


def test_a_clean_folder_reads_as_before(tmp_path):
    folder = _folder(tmp_path)
    assert sharded.model_shapes_in(folder) == {"weight": torch.Size([2, 3]), "bias": torch.Size([2])}
    whole = sharded.consolidated_state(folder)
    assert torch.equal(whole["model"]["weight"], _model_state()["weight"]) and whole["optim"]["lr"] == 0.01
    state = {"model": {k: torch.empty_like(v) for k, v in _model_state().items()}, "optim": {"lr": None}}
    sharded.load_sharded(state, folder)
    assert torch.equal(state["model"]["weight"], _model_state()["weight"]) and state["optim"]["lr"] == 0.01


def test_poisoned_metadata_runs_nothing_in_the_launchers_check(tmp_path):
    folder, marker = _folder(tmp_path / "ck"), tmp_path / "marker"
    _poison_metadata(folder, marker)
    with _expect_refused(r"ckpt-000000004/\.metadata") as raised:
        check_resumable(torch.nn.Linear(3, 2), folder, "zero1")
    assert not marker.exists()
    assert "builtins.exec" in str(raised.value) and "\n" not in str(raised.value)


def test_poisoned_metadata_runs_nothing_when_resuming(tmp_path):
    folder, marker = _folder(tmp_path / "ck"), tmp_path / "marker"
    _poison_metadata(folder, marker)
    strategy = types.SimpleNamespace(
        name="zero1",
        sharded_checkpoints=True,
        model_shapes=lambda: {k: v.shape for k, v in _model_state().items()},
        load_checkpoint=lambda path: None,
    )
    reports = []
    with _expect_refused(r"\.metadata"):
        resume.restore(
            folder.parent,
            strategy=strategy,
            scheduler=None,
            rank=0,
            world_size=1,
            batches_per_epoch=4,
            total_steps=8,
            max_epochs=2,
            report=reports.append,
        )
    assert not marker.exists()


@pytest.mark.parametrize("read", ["export", "consolidate", "load"])
def test_poisoned_metadata_runs_nothing_when_exporting_or_loading(tmp_path, read):
    folder, marker = _folder(tmp_path), tmp_path / "marker"
    _poison_metadata(folder, marker)
    with _expect_refused(r"\.metadata"):
        if read == "export":
            sharded.export_consolidated(folder, tmp_path / "model.pt")
        elif read == "consolidate":
            sharded.consolidated_state(folder)
        else:
            sharded.load_sharded({"model": {k: torch.empty_like(v) for k, v in _model_state().items()}}, folder)
    assert not marker.exists() and not (tmp_path / "model.pt").exists()


@pytest.mark.parametrize("read", ["consolidate", "load"])
def test_a_non_tensor_entry_that_is_not_plain_data_is_refused(tmp_path, read):
    """DCP saves non-tensor values (an optimizer's lr, betas) as pickles; torch loads them weights_only=False."""
    marker = tmp_path / "marker"
    folder = _folder(tmp_path, hyper=_WritesMarker(marker))
    assert not marker.exists()  # saving only pickled it
    with pytest.raises(
        sharded.UntrustedCheckpointError,
        match=r"__0_0\.distcp.*'optim\.lr' is not plain data \(it asks for \w*\.?exec\)",
    ):
        if read == "consolidate":
            sharded.consolidated_state(folder)
        else:
            sharded.load_sharded({"optim": {"lr": None}}, folder)
    assert not marker.exists()


def test_metadata_pointing_at_a_file_outside_the_folder_is_refused(tmp_path):
    folder = _folder(tmp_path)
    metadata = sharded.read_metadata(folder)
    for info in metadata.storage_data.values():
        info.relative_path = "../../elsewhere.distcp"
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(sharded.UntrustedCheckpointError, match="outside its folder"):
        sharded.read_metadata(folder)


# --- what a sharded save leaves on disk --------------------------------------------------------------
def _save(rank: int, world_size: int, directory: str, mode: int) -> None:
    state = {"model": {"w": torch.full((4,), float(rank))}, "optim": {"lr": 0.5}}
    sharded.save_sharded(state, directory, 3, {"format": 2, "step": 3} if rank == 0 else None, keep=2, mode=mode)


@pytest.mark.parametrize("mode", [0o600, 0o640])
def test_a_sharded_checkpoint_is_private_unless_shared(tmp_path, mode):
    spawn(_save, 2, str(tmp_path), mode)
    folder = tmp_path / "ckpt-000000003"
    assert stat.S_IMODE(folder.stat().st_mode) == (0o700 if mode == 0o600 else 0o750)
    files = list(folder.iterdir())
    assert {".metadata", "trainer.pt"} <= {f.name for f in files}
    assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in files} == {f.name: mode for f in files}
    assert not list(tmp_path.glob(".ckpt-*"))  # the temporary folder was renamed
    assert sharded.read_trainer_record(folder)["step"] == 3
    assert sharded.consolidated_state(folder)["optim"]["lr"] == 0.5


def test_a_planted_symlink_at_the_old_temporary_name_is_not_followed(tmp_path):
    """The temporary folder's name was fixed (``.ckpt-<step>.tmp``): a link there led the ranks' files elsewhere."""
    victim = tmp_path / "victim"
    victim.mkdir()
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / ".ckpt-000000003.tmp").symlink_to(victim)
    spawn(_save, 1, str(ck), 0o600)
    assert list(victim.iterdir()) == []
    assert (ck / "ckpt-000000003" / ".metadata").is_file()
    ckpt.remove_stale_temp_files(ck)  # the link goes, what it pointed at stays
    assert victim.is_dir() and not (ck / ".ckpt-000000003.tmp").is_symlink()
