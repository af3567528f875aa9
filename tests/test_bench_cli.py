"""``fastpar bench`` end to end through ``fastpar.bench.cli.main``: tiny real runs, outputs, errors.

No timing is asserted: only that runs finish, report every variant, and write valid JSON and PNG."""

from __future__ import annotations

import json

import pytest
import torch

from fastpar.bench.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _not_under_torchrun(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def test_allreduce_two_ranks_writes_json_and_png(tmp_path, capsys):
    out_json, out_png = tmp_path / "ar.json", tmp_path / "ar.png"
    argv = ["allreduce", "--nproc", "2", "--backend", "gloo", "-b", "1K", "-e", "4K", "-f", "2"]
    argv += ["-n", "2", "-w", "1", "--rounds", "1", "--json", str(out_json), "--plot", str(out_png)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "busbw(GB/s)" in printed and "#wrong" in printed and "Avg bus bandwidth" in printed
    assert "floor: memcpy" in printed and "world size: 2" in printed
    data = json.loads(out_json.read_text())
    assert data["schema"] == "fastpar.bench/1" and data["benchmark"] == "allreduce"
    assert [row["size"] for row in data["rows"]] == [1024, 2048, 4096]
    assert all(row["wrong"] == 0 and row["time_us"] > 0 for row in data["rows"])
    for row in data["rows"]:  # busbw = algbw x 2(n-1)/n = algbw for 2 ranks
        assert row["busbw"] == pytest.approx(row["algbw"])
    assert out_png.read_bytes()[:8] == PNG_MAGIC


def test_fusion_two_ranks_reports_share_of_single(tmp_path, capsys):
    out_json, out_png = tmp_path / "fusion.json", tmp_path / "fusion.png"
    argv = ["fusion", "--nproc", "2", "--count", "40", "--numel", "64", "--bucket-cap-mb", "0.004"]
    argv += ["-n", "1", "-w", "0", "--rounds", "1", "--json", str(out_json), "--plot", str(out_png)]
    assert main(argv) == 0
    data = json.loads(out_json.read_text())
    variants = [row["variant"] for row in data["rows"]]
    assert variants == [
        "one_by_one",
        "async_one_wait",
        "torch_coalesced",
        "fastpar_bucketed",
        "fastpar_views",
        "single",
    ]
    shares = data["summary"]["share_of_single"]
    assert shares["single"] == pytest.approx(1.0) and all(s > 0 for s in shares.values())
    assert "goal: fastpar_bucketed" in capsys.readouterr().out
    assert out_png.read_bytes()[:8] == PNG_MAGIC


def test_pack_prints_memcpy_and_peers(tmp_path, capsys):
    out_json = tmp_path / "pack.json"
    argv = ["pack", "--shapes", "3x1K,50x100", "--out-dtype", "bfloat16", "-n", "1", "-w", "0", "--rounds", "1"]
    assert main([*argv, "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert "ext backend:" in printed and "float32 -> bfloat16" in printed
    rows = json.loads(out_json.read_text())["rows"]
    impls = {(r["shape"], r["op"], r["impl"]) for r in rows}
    for shape in ("3x1K", "50x100"):
        for impl in ("memcpy", "fastpar.pack", "torch.cat", "_flatten_dense", "loop copy_"):
            assert (shape, "pack", impl) in impls
        assert (shape, "unpack", "fastpar.unpack") in impls
    assert all(r["of_memcpy"] == pytest.approx(1.0) for r in rows if r["impl"] == "memcpy")


def test_wrong_pack_result_exits_nonzero_without_a_speed(monkeypatch, capsys):
    import fastpar.ops

    real_pack = fastpar.ops.pack

    def corrupted_pack(tensors, out, scale=1.0):
        real_pack(tensors, out, scale)
        out[5] += 1.0
        return out

    monkeypatch.setattr(fastpar.ops, "pack", corrupted_pack)
    assert main(["pack", "--shapes", "4x256", "-n", "1", "-w", "0", "--rounds", "1"]) == 1
    captured = capsys.readouterr()
    assert (
        "WRONG RESULTS" in captured.err and "4x256: fastpar.pack differs from torch.cat in 1 elements" in captured.err
    )
    assert "GB/s" not in captured.out


def test_data_benchmark_on_a_tiny_folder(tmp_path, capsys):
    from fastpar.data.synthetic import make_image_folder

    root = make_image_folder(tmp_path / "imgs", classes=2, per_class=4, size=(64, 48))
    argv = ["data", "--images", str(root), "--batch", "4", "--workers", "1", "--size", "32"]
    assert main([*argv, "-n", "1", "-w", "0", "--rounds", "1", "--json", str(tmp_path / "d.json")]) == 0
    rows = json.loads((tmp_path / "d.json").read_text())["rows"]
    names = [r["pipeline"] for r in rows]
    assert "fastpar_torch" in names and all(r["images"] == 8 and r["images_per_s"] > 0 for r in rows)
    from fastpar._optional import available

    assert ("dali_bare" in names) == available("nvidia.dali")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["allreduce", "-b", "1M", "-e", "1K"], "out of order"),
        (["allreduce", "-b", "1.5K"], "cannot read size"),
        (["allreduce", "--dtype", "float8"], "unknown dtype"),
        (["allreduce", "--nproc", "1000"], "above"),
        (["fusion", "--variants", "one_by_one,teleport"], "unknown fusion variant"),
        (["fusion", "--dtype", "int32"], "float32, float16 or bfloat16"),
        (["pack", "--nproc", "2"], "--nproc does not apply"),
        (["pack", "-b", "1K"], "-b/-e/-f do not apply"),
        (["pack", "--shapes", "3by4"], "COUNTxNUMEL"),
        (["pack", "--dtype", "int32"], "pack supports"),
        (["ddp", "--models", "resnet"], "unknown model"),
        (["data", "--image-size", "big"], "WIDTHxHEIGHT"),
        (["all"], "needs --json DIR"),
        (["all", "--json", "x", "-n", "3"], "-n/-w/--rounds"),
    ],
)
def test_argument_errors_exit_2_with_a_message(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_unknown_benchmark_and_help(capsys):
    assert main(["allsum"]) == 2
    assert "unknown benchmark 'allsum'" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert "fusion" in capsys.readouterr().out
    assert main(["fusion", "--help"]) == 0
    assert "--slow-iters" in capsys.readouterr().out


def test_ddp_variants_skip_only_what_torch_lacks():
    from fastpar.bench.ddp_step import VARIANTS, available_variants, build_model

    names, notes = available_variants()
    assert names[:2] == ["no_comm", "ddp"] and set(names) <= set(VARIANTS)
    assert len(names) + len(notes) - ("fastpar" in " ".join(notes)) == len(VARIANTS)
    mlp = build_model("mlp")
    assert sum(p.numel() for p in mlp.parameters()) == 16 * (1024 * 1024 + 1024)
    assert mlp(torch.zeros(2, 1024)).shape == (2, 1024)
