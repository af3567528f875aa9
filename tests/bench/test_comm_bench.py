"""``fastpar bench ... --backend fastpar``: the shared-memory backend timed next to gloo in the same run (tiny
real runs; no timing is asserted, only that both are checked, timed and compared, with the goal lines)."""

from __future__ import annotations

import json

import pytest

from fastpar.bench.cli import main


@pytest.mark.slow
def test_allreduce_on_fastpar_prints_gloo_alongside_and_the_goals(tmp_path, capsys):
    out_json = tmp_path / "ar.json"
    argv = ["allreduce", "--nproc", "2", "--backend", "fastpar", "-b", "4K", "-e", "16K", "-f", "4"]
    assert main([*argv, "-n", "2", "-w", "1", "--rounds", "1", "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert "backend: fastpar" in printed and "gloo(us)" in printed and "x gloo" in printed
    assert "memcpy on all 2 ranks at once" in printed and "busbw <=" in printed
    assert "goal: 4K: all-reduce time <= 0.50x gloo's" in printed
    rows = json.loads(out_json.read_text())["rows"]
    assert [r["size"] for r in rows] == [4096, 16384]
    assert all(r["wrong"] == 0 and r["gloo_us"] > 0 and r["x_gloo"] > 0 for r in rows)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["reducescatter", "allgather", "broadcast"])
def test_other_collectives_on_fastpar_check_both_backends(name, capsys):
    argv = [name, "--nproc", "3", "--backend", "fastpar", "--dtype", "bfloat16", "-b", "6K", "-e", "6K"]
    assert main([*argv, "-n", "1", "-w", "0", "--rounds", "1"]) == 0
    assert "x gloo" in capsys.readouterr().out


@pytest.mark.slow
def test_ddp_step_on_fastpar_times_stock_ddp_on_gloo(capsys):
    argv = ["ddp", "--backend", "fastpar", "--models", "blocks", "--variants", "fastpar_fp32", "--batch", "8"]
    assert main([*argv, "-n", "1", "-w", "0", "--rounds", "1"]) == 0
    printed = capsys.readouterr().out
    assert "ddp_gloo" in printed and "goal: blocks: fastpar_fp32 step <= 0.80x ddp_gloo" in printed
    assert "fastpar_fp32_gloo" in printed and "no_overlap_gloo" not in printed  # only the selected wrappers twin
    assert "goal: blocks: fastpar_fp32 step <= 1.15x no_comm" in printed and "cpu x no_comm" in printed
