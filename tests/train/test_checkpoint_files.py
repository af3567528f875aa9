"""What the Trainer leaves on disk is its user's alone, and nothing another local user plants can redirect it.

- A symlink planted at a name the Trainer used to write through (the folder's write test, a checkpoint's or
  the plot's temporary file, metrics.jsonl) is never followed: the file it points at stays as it was.
- Checkpoints are 0600 and a checkpoint folder the Trainer creates 0700, unless ``checkpoint_mode`` shares
  them with a group.
- An output or checkpoint folder that belongs to another user is refused before anything is written (the
  default ``output_dir`` is relative: in ``/tmp`` another user could have made it first).
"""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

import pytest
import torch
from test_train import TRAIN, make_model, make_optimizer, options

from fastpar.safe_files import FolderOwnedByAnotherUserError
from fastpar.train import Trainer, TrainingOptions
from fastpar.train import checkpoint as ckpt
from fastpar.train.progress import MetricsLog
from fastpar.user_errors import OptionError

PRECIOUS = b"the victim's own data\n"


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_bytes(PRECIOUS)
    return victim


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _record(step: int) -> dict:
    return {
        "format": ckpt.FORMAT,
        "step": step,
        "epoch": 0,
        "model": {"w": torch.ones(3)},
        "optimizer": {},
        "ranks": [],
    }


# --- planted symlinks --------------------------------------------------------------------------------
def test_the_write_test_does_not_follow_a_planted_symlink(tmp_path):
    victim, folder = _victim(tmp_path), tmp_path / "ck"
    folder.mkdir()
    (folder / f".fastpar-write-test-{os.getpid()}").symlink_to(victim)
    ckpt.check_writable(folder, "checkpoint_dir")
    assert victim.read_bytes() == PRECIOUS


def test_a_checkpoint_is_not_written_through_a_planted_symlink(tmp_path):
    victim, path = _victim(tmp_path), ckpt.checkpoint_path(tmp_path, 4)
    (tmp_path / f".{path.name}.tmp-{os.getpid()}").symlink_to(victim)
    ckpt.save_atomic(_record(4), path)
    assert victim.read_bytes() == PRECIOUS
    assert not path.is_symlink() and torch.load(path, weights_only=True)["step"] == 4


RECORD = {"iteration": 1, "epoch": 0, "loss": 0.5, "lr": 0.1, "elapsed": 1.0, "samples_per_s": 10.0}


def test_metrics_are_not_written_through_a_planted_symlink(tmp_path):
    victim, metrics = _victim(tmp_path), tmp_path / "metrics.jsonl"
    metrics.symlink_to(victim)
    log = MetricsLog(metrics, resume_at_step=None)
    log.append(RECORD)
    log.close()
    assert victim.read_bytes() == PRECIOUS
    assert not metrics.is_symlink() and metrics.read_text().count("\n") == 1


def test_the_plot_is_not_written_through_a_planted_symlink(tmp_path):
    pytest.importorskip("matplotlib")
    from fastpar.train.plot import write_progress_plot

    victim, plot = _victim(tmp_path), tmp_path / "training-progress.png"
    (tmp_path / f".{plot.name}.tmp-{os.getpid()}.png").symlink_to(victim)
    write_progress_plot([RECORD], plot)
    assert victim.read_bytes() == PRECIOUS and plot.read_bytes().startswith(b"\x89PNG")


# --- modes -------------------------------------------------------------------------------------------
def test_checkpoint_files_are_private_by_default_and_shared_on_request(tmp_path):
    private = ckpt.save_atomic(_record(4), ckpt.checkpoint_path(tmp_path, 4))
    shared = ckpt.save_atomic(_record(8), ckpt.checkpoint_path(tmp_path, 8), mode=0o640)
    assert (_mode(private), _mode(shared)) == (0o600, 0o640)


def test_the_trainer_makes_a_private_checkpoint_folder_and_files(tmp_path):
    opts = options(tmp_path, devices=1, max_epochs=1, checkpoint_dir=str(tmp_path / "runs" / "ck"))
    result = Trainer(make_model, make_optimizer, torch.nn.functional.cross_entropy, TRAIN, options=opts).fit()
    assert _mode(tmp_path / "runs" / "ck") == 0o700
    assert result.checkpoints and all(_mode(Path(p)) == 0o600 for p in result.checkpoints)


def test_a_shared_checkpoint_mode_is_checked():
    assert TrainingOptions(checkpoint_mode=0o640).checkpoint_mode == 0o640
    for wrong in (0o666, 0o700, 0o620, True, "640"):
        with pytest.raises(OptionError, match="checkpoint_mode must be 0o600.*0o640"):
            TrainingOptions(checkpoint_mode=wrong)


# --- folders of another user -------------------------------------------------------------------------
def _nobody() -> int:
    if os.geteuid() != 0:
        pytest.skip("making a folder that belongs to another user needs root (chown); run the suite as root")
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        pytest.skip("this machine has no 'nobody' user to own the folder")


def _folder_of_nobody(path: Path) -> Path:
    path.mkdir(mode=0o777)
    os.chmod(path, 0o777)  # as another user would leave it for us to fall into
    os.chown(path, _nobody(), -1)
    return path


def test_a_folder_of_another_user_is_refused(tmp_path):
    folder = _folder_of_nobody(tmp_path / "theirs")
    with pytest.raises(FolderOwnedByAnotherUserError, match=r"checkpoint_dir=.*belongs to another user \(nobody"):
        ckpt.check_writable(folder, "checkpoint_dir")
    assert list(folder.iterdir()) == []


def test_a_symlink_of_another_user_is_refused(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    link = tmp_path / "link"
    link.symlink_to(mine)
    os.chown(link, _nobody(), -1, follow_symlinks=False)
    with pytest.raises(FolderOwnedByAnotherUserError, match="belongs to another user"):
        ckpt.check_writable(link, "output_dir")


def test_the_default_output_dir_made_first_by_another_user_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # like /tmp: the default output_dir is relative
    _folder_of_nobody(tmp_path / TrainingOptions().output_dir)
    opts = options(tmp_path, devices=1, max_epochs=1, output_dir=TrainingOptions().output_dir)
    trainer = Trainer(make_model, make_optimizer, torch.nn.functional.cross_entropy, TRAIN, options=opts)
    with pytest.raises(FolderOwnedByAnotherUserError, match=r"output_dir='fastpar-output'.*belongs to another"):
        trainer.fit()
    assert list((tmp_path / "fastpar-output").iterdir()) == []
