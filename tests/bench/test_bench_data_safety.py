"""The data benchmark's safety: its generated image set in the shared temporary folder is reused only when this
user made it; a URL's credentials never reach its table or JSON."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import tempfile
import types

import pytest

pytest.importorskip("PIL")

from fastpar.bench.benchmarks.data import image_folder  # noqa: E402

COUNT, SIZE = 8, "16x12"  # 4 classes x 2 images: fastpar-bench-images-8-16x12


@pytest.fixture
def shared_tmp(tmp_path, monkeypatch):
    """A stand-in for /tmp (tempfile.gettempdir()), sticky and writable by all like the real one."""
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    yield shared
    shutil.rmtree(shared, ignore_errors=True)


def planted_set(shared, mode: int = 0o755):
    """A folder at the benchmark's fixed name that claims to be complete, holding no real images."""
    root = shared / f"fastpar-bench-images-{COUNT}-{SIZE}"
    (root / "00_fake").mkdir(parents=True)
    (root / "00_fake" / "0.jpg").write_bytes(b"chosen by someone else")
    (root / ".complete").write_text("ok\n")
    root.chmod(mode)
    return root


def test_own_set_is_generated_once_then_reused(shared_tmp):
    first = image_folder(None, COUNT, SIZE)
    assert first.name == f"fastpar-bench-images-{COUNT}-{SIZE}" and len(list(first.rglob("*.jpg"))) == COUNT
    assert oct(first.stat().st_mode & 0o777) == oct(0o700)  # private: nobody else may add or swap images
    marker = (first / ".complete").stat().st_mtime_ns
    assert image_folder(None, COUNT, SIZE) == first and (first / ".complete").stat().st_mtime_ns == marker


def test_a_set_others_may_write_to_is_not_used(shared_tmp):
    planted = planted_set(shared_tmp, 0o777)
    got = image_folder(None, COUNT, SIZE)
    assert got != planted and len(list(got.rglob("*.jpg"))) == COUNT  # a private copy of its own
    assert (planted / "00_fake" / "0.jpg").read_bytes() == b"chosen by someone else"  # left alone


@pytest.mark.skipif(os.geteuid() != 0, reason="making a folder of another user's needs root")
@pytest.mark.parametrize("what", ["folder", "marker"])
def test_a_set_made_or_marked_by_another_user_is_not_used(shared_tmp, what):
    nobody = pwd.getpwnam("nobody").pw_uid
    planted = planted_set(shared_tmp)
    os.chown(planted / ".complete", nobody, -1)
    if what == "folder":
        for path in [planted, *planted.rglob("*")]:
            os.chown(path, nobody, -1)
    got = image_folder(None, COUNT, SIZE)
    assert got != planted and len(list(got.rglob("*.jpg"))) == COUNT
    assert not (got / "00_fake").exists()


def test_a_secret_in_the_root_url_reaches_neither_table_nor_json(tmp_path):
    from fastpar.bench.benchmarks import data_remote
    from fastpar.bench.cli import finish, prepare
    from fastpar.bench.table import render_table, write_json

    url = "s3://imgs/train?X-Amz-Credential=AKIAEXAMPLE&X-Amz-Signature=s3cret"  # e.g. pasted from a presigned link
    _, ctx = prepare("data", ["--root", url, "--json", str(tmp_path / "data.json")])
    samples = {name: [(1.0, 0.5, 0.0, 8, -1)] for name in ("local_torch", "s3_torch", "fetch_only")}
    loaders = {"local_torch": types.SimpleNamespace(folder=[None] * 8)}
    report = finish(data_remote._report(ctx, url, tmp_path, "cpu", samples, loaders, False, []), ctx)
    shown = render_table(report) + write_json(report, ctx.json).read_text()
    assert "s3cret" not in shown and "AKIAEXAMPLE" not in shown
    written = json.loads((tmp_path / "data.json").read_text())
    assert written["config"]["root"] == "s3://imgs/train?X-Amz-Credential=***&X-Amz-Signature=***"
    assert "X-Amz-Signature=***" in written["command"] and "X-Amz-Signature=***" in written["header"]["store"]
