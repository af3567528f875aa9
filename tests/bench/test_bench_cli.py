"""``fastpar bench`` end to end through ``fastpar.bench.cli.main``: tiny real runs, outputs, errors.

No timing is asserted: only that runs finish, report every variant, and write valid JSON and PNG."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from fastpar.bench.cli import main
from fastpar.launcher import free_port

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


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
    # self-describing: what ran, when, where
    assert data["command"].startswith("fastpar bench allreduce --nproc 2") and data["created"]
    assert data["machine"]["cpu_count"] >= 1 and data["machine"]["cpu_model"] and data["machine"]["torch"]
    assert data["config"]["sizes"] == [1024, 2048, 4096] and data["config"]["backend"] == "gloo"
    assert {c["key"]: c["unit"] for c in data["columns"]}["busbw"] == "GB/s"


@pytest.mark.slow
def test_reducescatter_three_ranks_rounds_to_whole_elements_per_rank(tmp_path, capsys):
    out_json = tmp_path / "rs.json"
    argv = ["reducescatter", "--nproc", "3", "--dtype", "bfloat16", "-b", "1000", "-e", "4000", "-f", "2"]
    assert main([*argv, "-n", "1", "-w", "0", "--rounds", "1", "--json", str(out_json)]) == 0
    assert "world size: 3" in capsys.readouterr().out
    rows = json.loads(out_json.read_text())["rows"]
    # nccl-tests: count = elements per rank, size = the whole input (count x 3 ranks x 2 bytes)
    assert [(r["size"], r["count"], r["dtype"]) for r in rows] == [
        (996, 166, "bfloat16"),
        (1998, 333, "bfloat16"),
        (3996, 666, "bfloat16"),
    ]
    for row in rows:
        assert row["wrong"] == 0 and row["busbw"] == pytest.approx(row["algbw"] * 2 / 3)


@pytest.mark.slow
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
        "fastpar_call",
        "fastpar_views",
        "single",
    ]
    shares = data["summary"]["share_of_single"]
    assert shares["single"] == pytest.approx(1.0) and all(s > 0 for s in shares.values())
    assert "goal: fastpar_bucketed >= 90% of single:" in capsys.readouterr().out
    (goal,) = data["summary"]["goals"]
    assert goal["name"] == "fastpar_bucketed >= 90% of single" and goal["direction"] == "at_least"
    assert goal["value"] == pytest.approx(shares["fastpar_bucketed"]) and goal["threshold"] == 0.9
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


def _corrupting_rank_main(rank, world_size, ctx):
    """The allreduce benchmark with a collective that gets one element wrong on rank 1."""
    from fastpar.bench.benchmarks import collectives

    real_make_case = collectives.make_case

    def corrupted_case(*case_args):
        case = real_make_case(*case_args)
        real_call = case.call

        def call():
            real_call()
            if rank == 1:
                case.out.view(-1)[3] += 1

        case.call = call
        return case

    collectives.make_case = corrupted_case
    return collectives._rank_main(rank, world_size, ctx)


@pytest.mark.slow
def test_wrong_collective_result_raises_on_every_rank_before_any_timing():
    from fastpar.bench import launch
    from fastpar.bench.cli import prepare
    from fastpar.bench.harness import WrongResultError

    _, ctx = prepare("allreduce", ["--nproc", "2", "-b", "1K", "-e", "2K", "-n", "1", "-w", "0", "--rounds", "1"])
    ctx.backend = "gloo"
    with pytest.raises(WrongResultError, match=r"allreduce on 2 ranks gave wrong results at: 1K \(1 wrong"):
        launch.run_ranks(_corrupting_rank_main, launch.World(2, "gloo", False), ctx)


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


@pytest.mark.slow
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
        (["allreduce", "-b"], "argument -b/--minbytes: expected one argument"),
        (["allreduce", "-n"], "expected one argument"),
        (["allreduce", "-f", "2.5"], "invalid int value"),
        (["allreduce", "--bogus"], "unrecognized arguments: --bogus"),
        (["allreduce", "-n", "0"], "-n >= 1"),
        (["allreduce", "-w", "-1"], "-w >= 0"),
        (["allreduce", "--rounds", "0"], "--rounds >= 1"),
        (["allreduce", "--threads", "0"], "--threads must be at least 1"),
        (["allreduce", "--dtype", "float8"], "unknown dtype"),
        (["allreduce", "--dtype", "bool"], "unknown dtype"),
        (["allreduce", "--nproc", "1000"], "above"),
        (["allreduce", "--nproc", "0"], "at least 1"),
        (["allreduce", "--backend", "mpi"], "unknown backend"),
        (["allreduce", "--json", "/proc/no/such/dir/out.json"], "does not exist; create it first"),
        (["allreduce", "--json", "/proc/out.json"], "not writable"),
        (["allreduce", "--json", "/"], "is a directory"),
        (["fusion", "--variants", "one_by_one,teleport"], "unknown fusion variant"),
        (["fusion", "--dtype", "int32"], "float32, float16 or bfloat16"),
        (["pack", "--nproc", "2"], "--nproc 2 does not apply"),
        (["pack", "-b", "1K"], "-b/-e/-f do not apply"),
        (["pack", "--shapes", "3by4"], "COUNTxNUMEL"),
        (["pack", "--dtype", "int32"], "pack supports --dtype float32, float16, bfloat16"),
        (["pack", "--out-dtype", "int8"], "pack --out-dtype supports"),
        (["ddp", "--models", "resnet"], "unknown model"),
        (["ddp", "--dtype", "float16"], "ddp supports --dtype float32"),
        (["data", "--image-size", "big"], "WIDTHxHEIGHT"),
        (["data", "--images", "/no/such/folder", "-n", "1", "-w", "0", "--rounds", "1"], "does not exist"),
        (["all"], "needs --json DIR"),
        (["all", "--json", "/dev/null"], "not a directory"),
        (["allsum"], "unknown benchmark 'allsum'"),
    ],
)
def test_argument_errors_exit_2_with_one_line(argv, message, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert captured.err.strip().count("\n") == 0 and "Traceback" not in captured.err
    assert captured.out == ""


def test_all_refuses_a_bad_only_before_creating_its_json_folder(tmp_path, capsys):
    out_dir = tmp_path / "results"
    assert main(["all", "--json", str(out_dir), "--only", "pack,teleport"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        "fastpar bench all: error: unknown benchmark(s) ['teleport'] in --only; choose from allreduce, "
        "reducescatter, allgather, broadcast, alltoall, fusion, pack, ddp, zero, shard, data"
    )
    assert not out_dir.exists()


def test_help_lists_benchmarks_and_only_the_flags_that_apply(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("allreduce", "reducescatter", "allgather", "broadcast", "alltoall", "fusion", "pack", "ddp", "data"):
        assert f"  {name} " in out
    assert main(["fusion", "--help"]) == 0
    assert "--slow-iters" in capsys.readouterr().out
    assert main(["allreduce", "--help"]) == 0
    out = capsys.readouterr().out
    assert "-b SIZE" in out and "(default 1K)" in out and "int8" in out and "count = elements per rank" in out
    assert main(["pack", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--minbytes" not in out and "--nproc" not in out and "--shapes" in out


def test_one_process_benchmark_takes_nproc_1_and_runs_on_rank_0_only_under_torchrun(monkeypatch, capsys):
    argv = ["pack", "--shapes", "2x64", "-n", "1", "-w", "0", "--rounds", "1"]
    assert main([*argv, "--nproc", "1"]) == 0
    assert "fastpar.pack" in capsys.readouterr().out
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert main(argv) == 0  # torchrun's rank 1: nothing to do, nothing printed
    assert capsys.readouterr() == ("", "")


@pytest.mark.slow
def test_torchrun_launch_prints_one_table(tmp_path):
    """torchrun --nproc_per_node=2 -m fastpar bench allreduce: the process group comes from the environment,
    rank 0 prints and writes the JSON."""
    out_json = tmp_path / "ar.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", str(free_port())]
    command += ["-m", "fastpar", "bench", "allreduce", "-b", "1K", "-e", "2K", "-f", "2", "-n", "1", "-w", "0"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [*command, "--json", str(out_json)], capture_output=True, text=True, timeout=120, env=env, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("# fastpar bench allreduce:") == 1 and "world size: 2" in done.stdout
    assert [row["size"] for row in json.loads(out_json.read_text())["rows"]] == [1024, 2048]


@pytest.mark.slow
def test_all_passes_shared_flags_on_and_keeps_going_past_a_failure(tmp_path, capsys):
    out = tmp_path / "report"
    argv = ["all", "--json", str(out), "--only", "allreduce,fusion", "--dtype", "int8", "--nproc", "1"]
    assert main([*argv, "-b", "1K", "-e", "2K", "-n", "1", "-w", "0", "--rounds", "1"]) == 1
    assert "fusion: could not run" in capsys.readouterr().err  # fusion has no int8; allreduce still ran
    data = json.loads((out / "allreduce.json").read_text())
    assert [(r["size"], r["dtype"], r["wrong"]) for r in data["rows"]] == [(1024, "int8", 0), (2048, "int8", 0)]
    assert "-b 1K -e 2K -f 2" in data["command"] and data["config"]["iters"] == 1
    assert not (out / "fusion.json").exists()
    summary = (out / "summary.md").read_text()
    for fact in ("## Machine", "| CPU |", "logical cores", "| GPUs |", "| torch |", "| NCCL |"):
        assert fact in summary
    assert "**fusion**: could not run" in summary and "Avg bus bandwidth" in summary
    assert "world size: 1" in summary and "busbw is 0 by definition" in summary  # --nproc 1 works
    assert json.loads((out / "machine.json").read_text())["cpu_count"] >= 1


def test_ddp_variants_skip_only_what_torch_lacks():
    from fastpar.bench.benchmarks.ddp_step import VARIANTS, available_variants, build_model

    names, notes = available_variants()
    assert names[:3] == ["no_comm", "no_overlap", "ddp"] and set(names) <= set(VARIANTS)
    assert len(names) + len(notes) - ("fastpar" in " ".join(notes)) == len(VARIANTS)
    mlp = build_model("mlp")
    assert sum(p.numel() for p in mlp.parameters()) == 16 * (1024 * 1024 + 1024)
    assert mlp(torch.zeros(2, 1024)).shape == (2, 1024)


def test_ddp_goals_compare_with_the_best_fp32_torch_variant_and_the_best_fixed_cap():
    from fastpar.bench.benchmarks.ddp_step import step_goals

    seconds = {
        "no_comm": 0.5,
        "ddp": 2.0,
        "ddp_bucket_view": 1.8,
        "ddp_fp16_hook": 1.0,
        "fastpar_fp32": 1.62,
        "fastpar_bf16": 0.86,
        "fastpar_cap_1": 1.7,
        "fastpar_cap_4": 1.6,
        "fastpar_cap_25": 1.9,
        "fastpar_auto": 1.61,
    }
    goals = step_goals("m", seconds)
    lines = [g.line() for g in goals]
    # the fp16 hook is not an fp32 variant: the best fp32 torch variant is ddp_bucket_view (1.62 / 1.8 = 0.90)
    assert "goal: m: fastpar_fp32 step <= 0.95x the best fp32 torch variant (ddp_bucket_view): 0.90x -> MET" in lines
    assert "goal: m: fastpar_bf16 step <= 0.85x ddp_fp16_hook: 0.86x -> NOT MET" in lines
    assert "goal: m: fastpar_auto step <= 1.00x the best fixed cap (fastpar_cap_4): 1.01x -> NOT MET" in lines
    assert [(g.met, g.flagged) for g in goals] == [(True, False), (False, False), (False, False)]


def test_ddp_goals_on_the_fastpar_backend_compare_each_wire_with_its_own_torch_variants_and_no_comm():
    from fastpar.bench.benchmarks.ddp_step import step_goals

    seconds = {
        "no_comm": 1.0,
        "ddp": 1.3,
        "ddp_view_cap": 1.2,
        "fastpar_fp32": 1.1,
        "ddp_gloo": 2.0,
        "ddp_bucket_view_gloo": 1.9,
        "fastpar_fp32_gloo": 1.9,
    }
    lines = [g.line() for g in step_goals("m", seconds, "fastpar")]
    # each wire's best: ddp_view_cap on the fastpar backend (1.1 / 1.2), ddp_bucket_view_gloo on gloo (1.9 / 1.9)
    assert lines == [
        "goal: m: fastpar_fp32 step <= 0.95x the best fp32 torch variant (ddp_view_cap): 0.92x -> MET",
        "goal: m: fastpar_fp32_gloo step <= 0.95x the best fp32 torch variant on gloo (ddp_bucket_view_gloo): "
        "1.00x -> NOT MET",
        "goal: m: fastpar_fp32 step <= 1.15x no_comm: 1.10x -> MET",
        "goal: m: fastpar_fp32 step <= 0.80x ddp_gloo: 0.55x -> MET",
    ]
    assert not any("no_comm" in g.line() for g in step_goals("m", seconds, "gloo"))  # the floor goal: fastpar wire


@pytest.mark.slow
def test_ddp_auto_variant_settles_before_timing(capsys):
    argv = ["ddp", "--nproc", "2", "--models", "blocks", "--variants", "fastpar_auto,fastpar_cap_4,fastpar_cap_25"]
    assert main([*argv, "--batch", "8", "-n", "1", "-w", "0", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "goal: blocks: fastpar_auto step <= 1.00x the best fixed cap" in out
    assert "auto: blocks fastpar_auto: chose " in out and "kept " in out
