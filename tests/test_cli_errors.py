"""Every user error of the ``fastpar`` command is one line on stderr with exit status 2; bugs keep their traceback.

In-process through ``fastpar.cli.main`` (fast), plus one real subprocess for the exit status a shell sees.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from fastpar import cli
from fastpar.user_errors import OptionError, UserError, describe

ROOT = Path(__file__).resolve().parent.parent


def run_cli(argv: list[str], capsys) -> tuple[int, list[str]]:
    code = cli.main(argv)
    return code, capsys.readouterr().err.splitlines()


def _not_a_folder(tmp_path: Path) -> str:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    return str(blocker / "runs")  # a folder inside a file can't be created


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["demo", "--devices", "0"], "fastpar demo: error: argument --devices: must be at least 1, got 0"),
        (["demo", "--epochs", "x"], "fastpar demo: error: argument --epochs: expected an integer, got 'x'"),
        (["demo", "--lr", "0"], "argument --lr: must be above 0, got 0"),
        (["demo", "--per-class", "1"], "raise --per-class or lower --batch-size"),
        (["demo", "--environment", "tpu"], "argument --environment: invalid choice: 'tpu'"),
        (["demo", "--dir", "NOT_A_FOLDER"], "can't write there"),
        (["info", "--bogus"], "fastpar info: error: unrecognized arguments: --bogus (see 'fastpar info --help')"),
        (["bench", "pack", "--bogus"], "fastpar bench pack: error: unrecognized arguments: --bogus"),
        (["topo", "--from", "/nonexistent/node.txt"], "fastpar topo: error:"),
        (["nope"], "fastpar: error: unknown command 'nope'; choose one of"),
    ],
)
def test_user_errors_are_one_line_with_status_2(argv, expected, capsys, tmp_path):
    argv = [_not_a_folder(tmp_path) if a == "NOT_A_FOLDER" else a for a in argv]
    code, err = run_cli(argv, capsys)
    assert code == 2 and len(err) == 1, err
    assert expected in err[0]
    assert argparse.ArgumentParser.error.__module__ == "argparse"  # the one-line patch is undone


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_environment_without_gpu_is_one_line(capsys):
    code, err = run_cli(["demo", "--environment", "gpu"], capsys)
    assert code == 2 and len(err) == 1 and "needs a CUDA GPU" in err[0]


def test_missing_optional_dependency_is_one_line_naming_the_extra(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    code, err = run_cli(["demo", "--dir", str(tmp_path / "d")], capsys)
    assert code == 2 and len(err) == 1 and "pip install 'fastpar[plot]'" in err[0], err
    assert not (tmp_path / "d" / "data").exists()  # refused before writing anything


def _fake_command(monkeypatch, error: BaseException) -> None:
    module = types.ModuleType("fastpar_test_fake_command")

    def main(argv):
        raise error

    module.main = main
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(cli.COMMANDS, "fake", (module.__name__, "raises what the test gives it"))


def test_bugs_keep_their_traceback(monkeypatch):
    _fake_command(monkeypatch, RuntimeError("an internal invariant broke"))
    with pytest.raises(RuntimeError, match="internal invariant"):
        cli.main(["fake"])


@pytest.mark.parametrize("how", ["flag", "env"])
def test_debug_shows_the_traceback_of_user_errors(monkeypatch, capsys, how):
    _fake_command(monkeypatch, UserError("the thing is wrong; do this instead"))
    if how == "env":
        monkeypatch.setenv("FASTPAR_DEBUG", "1")
    code, err = run_cli(["--debug", "fake"] if how == "flag" else ["fake"], capsys)
    assert code == 2 and err[0] == "Traceback (most recent call last):"
    assert err[-1] == "fastpar fake: error: the thing is wrong; do this instead"


def test_option_errors_name_the_flag_the_user_typed():
    exc = OptionError("devices", "TrainingOptions.devices must be an integer >= 1, got 0")
    assert describe(exc, ["--devices", "0"]) == "--devices must be an integer >= 1, got 0"
    assert describe(exc, ["--devices=0"]) == "--devices must be an integer >= 1, got 0"
    assert describe(exc, []) == "TrainingOptions.devices must be an integer >= 1, got 0"  # not a flag here
    assert isinstance(exc, ValueError)  # code that catches ValueError keeps working


def test_which_exceptions_are_user_errors(tmp_path):
    missing = tmp_path / "nope" / "x.txt"
    with pytest.raises(FileNotFoundError) as info:
        missing.read_text()
    line = describe(info.value)
    assert line is not None and str(missing) in line and "\n" not in line
    assert describe(ImportError("matplotlib is needed ... Install it: pip install 'fastpar[plot]'")) is not None
    assert describe(ImportError("cannot import name 'x' from 'fastpar'")) is None  # a broken install: traceback
    assert describe(ValueError("Tried to step 73 times")) is None  # a bug, not the user's
    assert describe(UserError("two\nlines")) == "two lines"


def test_shell_sees_one_line_and_status_2():
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, "-m", "fastpar", "demo", "--devices", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "fastpar demo: error: argument --devices: must be at least 1, got 0 (see 'fastpar demo --help')"
    ]


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once it is closed


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["bench", "data", "--root", "/nonexistent/images"], "fastpar bench data: error: --root: image folder"),
        (["bench", "data", "--images", "/nonexistent/images"], "fastpar bench data: error: --images: image folder"),
        (["bench", "calibrate", "--nproc", "2", "--profile", "/proc/fastpar-profile.json"], "not writable"),
        (["bench", "calibrate", "--nproc", "2", "--profile", "NOT_A_FOLDER/p.json"], "does not exist; create it"),
        (["bench", "pack", "--json", "NOT_A_FOLDER/pack.json"], "fastpar bench pack: error: --json"),
    ],
)
def test_bench_mistakes_are_one_line_with_status_2_before_measuring(argv, expected, capsys, tmp_path):
    argv = [a.replace("NOT_A_FOLDER", str(tmp_path / "missing")) for a in argv]
    code, err = run_cli(argv, capsys)
    assert code == 2 and len(err) == 1, err
    assert expected in err[0]
    assert not (tmp_path / "missing").exists()  # a missing output folder is refused, not made


def test_s3_mistakes_are_one_line_with_status_2_and_leave_no_temporary_folders(capsys, monkeypatch, tmp_path):
    pytest.importorskip("boto3")
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    code, err = run_cli(["bench", "data", "--root", "s3://bucket/images"], capsys)
    assert code == 2 and len(err) == 1, err
    assert f"connection refused at {endpoint}" in err[0] and "throttl" not in err[0]

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    code, err = run_cli(["bench", "data", "--root", "s3://bucket/images"], capsys)
    assert code == 2 and len(err) == 1, err
    assert "no AWS credentials found" in err[0]
    assert list(scratch.iterdir()) == []  # the bench's scratch folder went with the failed run


def test_an_image_root_one_level_too_high_gets_a_warning_naming_the_folder(tmp_path):
    from fastpar.data import scan_image_folder

    for split in ("train", "val"):
        for label in ("cat", "dog"):
            (tmp_path / split / label).mkdir(parents=True)
            (tmp_path / split / label / "0.jpg").write_bytes(b"")
    with pytest.warns(UserWarning, match=f"use {tmp_path / 'train'} as the folder"):
        scan_image_folder(tmp_path)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the right level: no warning
        assert scan_image_folder(tmp_path / "train").classes == ["cat", "dog"]


def test_help_texts_carry_no_issue_numbers(capsys):
    assert cli.main(["bench", "data", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--root" in out and "issue" not in out.lower()


@pytest.mark.parametrize(
    "raised, expected",
    [
        (KeyboardInterrupt(), "fastpar fake: interrupted"),
        (
            KeyboardInterrupt("interrupted; the worker processes were stopped"),
            "fastpar fake: interrupted; the worker processes were stopped",
        ),
        (KeyboardInterrupt("the checkpoint was saved"), "fastpar fake: interrupted (the checkpoint was saved)"),
    ],
)
def test_ctrl_c_says_interrupted_once(monkeypatch, capsys, raised, expected):
    _fake_command(monkeypatch, raised)
    code, err = run_cli(["fake"], capsys)
    assert code == 130 and err == [expected]


def _parsers():
    from fastpar.jobs.cli import _parser as jobs_parser
    from fastpar.topology.cli import _parser as topo_parser
    from fastpar.train.demo import _parser as demo_parser

    return {"demo": demo_parser(), "jobs": jobs_parser(), "topo": topo_parser()}


@pytest.mark.parametrize("command", ["demo", "jobs", "topo"])
def test_help_is_plain_text_and_every_flag_says_what_it_does(command):
    parser = _parsers()[command]
    text = parser.format_help()
    assert "``" not in text and ":func:" not in text and ":class:" not in text, text
    silent = [a.option_strings[0] for a in parser._actions if a.option_strings and not a.help]
    assert not silent, f"fastpar {command} flags without help: {silent}"


@pytest.mark.parametrize("argv", [["--help"], ["plan", "--help"], ["jobs", "list"]])
def test_output_into_a_pipe_nobody_reads_ends_quietly(argv, tmp_path):
    """``fastpar ... | head``: the reader left before the output was written; no BrokenPipeError traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the command writes anything
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "FASTPAR_JOBS_DIR": str(tmp_path),
    }
    try:
        done = subprocess.run(
            [sys.executable, "-m", "fastpar", *argv],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            timeout=300,
        )
    finally:
        os.close(write_end)
    assert done.returncode in (0, cli.EXIT_PIPE_CLOSED) and done.stderr == "", done.stderr
