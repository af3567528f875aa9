"""``fastpar bench data --tokens``: a tiny run through the CLI prints every row, ratio and goal and writes the
JSON; every variant reads the same windows of the corpus; wrong batches are caught. No timing is asserted."""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest
import torch

from fastpar.bench.benchmarks import token_windows
from fastpar.bench.cli import main
from fastpar.bench.harness import WrongResultError

SHAPE = token_windows.WindowShape(seq_len=16, batch=4, vocab=1 << 16)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out_json = tmp_path_factory.mktemp("tokens") / "tokens.json"
    argv = ["data", "--tokens", "--corpus-mb", "1,2", "--seq-len", "64", "--batch-size", "4", "--batches", "3"]
    argv += ["--rounds", "2", "-w", "0", "--workers", "1", "--memory-batches", "5", "--json", str(out_json)]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = main(argv)
    return status, printed.getvalue(), json.loads(out_json.read_text())


def test_tiny_run_prints_floor_peers_ratios_and_goals(tiny_run):
    status, printed, _ = tiny_run
    assert status == 0
    assert "tokens/s" in printed and "of_floor" in printed and "x loader" in printed and "anon_MiB" in printed
    rows = [line.split() for line in printed.splitlines() if line and not line.startswith("#")][1:]
    variants = ["floor", "fastpar", "fastpar_vocab", "dataloader", "dataloader_w1"]
    if token_windows.streaming_problem() is None:
        variants.append("streaming")
    assert {(row[0], row[1]) for row in rows} == {(corpus, v) for corpus in ("1MB", "2MB") for v in variants}
    for corpus in ("1MB", "2MB"):
        assert f"goal: {corpus}: fastpar tokens/s >= 0.95x floor:" in printed
        assert f"goal: {corpus}: fastpar tokens/s >= 1.50x dataloader" in printed
        assert f"goal: {corpus}: fastpar tokens/s >= 1.00x streaming:" in printed
    assert "goal: fastpar anonymous memory <= 1.10x 2MB vs 1MB corpus:" in printed
    if token_windows.streaming_problem() is not None:
        assert "not measured (streaming does not import)" in printed and "note: streaming skipped" in printed


def test_tiny_run_json_has_rates_ratios_memory_and_goals(tiny_run):
    _, _, data = tiny_run
    assert data["benchmark"] == "data" and data["config"]["tokens"] is True
    assert data["config"]["corpus_mb"] == "1,2" and data["config"]["seq_len"] == 64
    rows = {(row["corpus"], row["variant"]): row for row in data["rows"]}
    for corpus in ("1MB", "2MB"):
        assert rows[corpus, "floor"]["of_floor"] == pytest.approx(1.0)
        for variant in ("floor", "fastpar", "dataloader"):
            row = rows[corpus, variant]
            assert row["tokens_per_s"] > 0 and row["x_dataloader"] > 0
            assert row["anon_mib"] > 0 and row["grew_mib"] is not None
        assert rows[corpus, "dataloader_w1"]["anon_mib"] is None  # its memory is in the worker
    summary = data["summary"]
    assert set(summary["tokens_per_s"]) >= {"1MB/floor", "1MB/fastpar", "2MB/dataloader"}
    assert "2MB/fastpar" in summary["anonymous_mib"]
    names = [goal["name"] for goal in summary["goals"]]
    assert "1MB: fastpar tokens/s >= 0.95x floor" in names
    assert any(name.startswith("fastpar anonymous memory") for name in names)
    assert all(isinstance(goal["met"], bool) for goal in summary["goals"])
    if token_windows.streaming_problem() is not None:
        assert len(summary["goals_not_measured"]) == 2


def _counting_corpus(path, windows: int):
    """Token i is i: the first token of a row says which window it is."""
    np.arange(windows * SHAPE.seq_len + 1, dtype=np.uint16).tofile(path)
    return path


@pytest.mark.parametrize("variant", ["floor", "fastpar", "fastpar_vocab", "dataloader"])
def test_every_variant_reads_each_window_once_per_epoch(tmp_path, variant):
    windows = 40
    path = _counting_corpus(tmp_path / "count.bin", windows)
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    heads = token_windows.window_heads(tokens, SHAPE.seq_len)
    stream = token_windows.make_stream(variant, path, SHAPE)
    seen = []
    for _ in range(windows // SHAPE.batch):
        x, y = next(stream)
        token_windows.check_batch(variant, x, y, tokens, heads, SHAPE)
        seen += (x[:, 0] // SHAPE.seq_len).tolist()
    assert sorted(seen) == list(range(windows))
    stream.close()


def test_a_batch_off_the_window_grid_or_the_vocabulary_is_wrong(tmp_path):
    path = _counting_corpus(tmp_path / "count.bin", 8)
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    heads = token_windows.window_heads(tokens, SHAPE.seq_len)
    rows = torch.from_numpy(np.stack([tokens[s : s + SHAPE.seq_len + 1] for s in (0, 16, 32, 48)]).astype(np.int64))
    x, y = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
    token_windows.check_batch("ok", x, y, tokens, heads, SHAPE)
    with pytest.raises(WrongResultError, match="contiguous"):
        token_windows.check_batch("views", rows[:, :-1], rows[:, 1:], tokens, heads, SHAPE)
    with pytest.raises(WrongResultError, match="not a window"):  # windows starting one token late
        token_windows.check_batch("shifted", x + 1, y + 1, tokens, heads, SHAPE)
    with pytest.raises(WrongResultError, match="shifted by one"):
        token_windows.check_batch("same", x, x, tokens, heads, SHAPE)
    small = token_windows.WindowShape(SHAPE.seq_len, SHAPE.batch, vocab=40)
    with pytest.raises(WrongResultError, match="outside"):
        token_windows.check_batch("vocab", x, y, tokens, heads, small)


def test_anonymous_memory_is_read_from_smaps_rollup():
    kib = token_windows.anonymous_kib()
    if kib is None:
        pytest.skip("no /proc/self/smaps_rollup here")
    assert kib > 0


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--corpus-mb", "0"], "positive sizes"),
        (["--corpus-mb", "ten"], "cannot read --corpus-mb"),
        (["--corpus-mb", "0.001", "--seq-len", "1024"], "fewer than --batch-size"),
        (["--vocab", "70000"], "--vocab"),
        (["--images", "somewhere"], "do not apply"),
    ],
)
def test_bad_token_flags_are_refused_in_one_line(flags, message, capsys):
    assert main(["data", "--tokens", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
