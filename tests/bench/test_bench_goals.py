"""Declared goals and what the tables may print: verdicts, precision, physical bounds, the machine's load, one
JSON summary schema, the package's import rules. Reports are built from given times; no timing is asserted."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fastpar.bench.cli import BENCHMARKS, main, prepare
from fastpar.bench.goals import AT_LEAST, AT_MOST, Goal, summary
from fastpar.bench.table import render_table

REPO = Path(__file__).resolve().parents[2]
SHARE = Goal("fastpar pack", "of memcpy", 0.85, AT_LEAST, unit="%")
RATIO = Goal("fastpar_fp32 step", "ddp", 0.92, AT_MOST)


@pytest.mark.parametrize(
    ("goal", "value", "printed", "state"),
    [
        (SHARE, 0.847, "84.7%", "NOT MET"),  # never "85%" next to NOT MET
        (SHARE, 0.8499, "84.99%", "NOT MET"),  # one decimal would print 85.0%
        (SHARE, 0.85, "85.0%", "MET"),
        (SHARE, 0.912, "91.2%", "MET"),
        (RATIO, 0.9249, "0.925x", "NOT MET"),  # two decimals would print 0.92x
        (RATIO, 0.9201, "0.9201x", "NOT MET"),
        (RATIO, 0.92, "0.92x", "MET"),
        (RATIO, 0.5, "0.50x", "MET"),
        (RATIO, float("nan"), "nan", "NOT MET"),
    ],
)
def test_a_value_is_printed_on_the_same_side_of_the_threshold_as_measured(goal, value, printed, state):
    verdict = goal.check(value)
    assert verdict.line() == f"goal: {verdict.name}: {printed} -> {state}"
    assert verdict.met == (state == "MET")


def test_claims_name_the_scope_the_reference_and_the_threshold_as_declared():
    assert SHARE.claim() == "fastpar pack >= 85% of memcpy"
    assert RATIO.claim("mlp", "the best torch variant (ddp_bucket_view)") == (
        "mlp: fastpar_fp32 step <= 0.92x the best torch variant (ddp_bucket_view)"
    )
    assert Goal("x", "", 0.875, AT_LEAST, unit="%").claim() == "x >= 87.5%"
    with pytest.raises(ValueError, match="direction"):
        Goal("x", "y", 1.0, "below")


def test_a_flagged_result_is_impossible_and_never_met():
    verdict = RATIO.check(0.5, scope="mlp", flag="mlp fastpar_fp32 0.900x no_comm: faster than the floor")
    assert verdict.goal.passes(0.5) and not verdict.met and verdict.state == "IMPOSSIBLE"
    assert verdict.line().endswith("-> IMPOSSIBLE (mlp fastpar_fp32 0.900x no_comm: faster than the floor)")
    fine = SHARE.check(0.9)
    assert summary([verdict, fine]) == {
        "goals": [
            {
                "name": "mlp: fastpar_fp32 step <= 0.92x ddp",
                "value": 0.5,
                "threshold": 0.92,
                "direction": "at_most",
                "unit": "x",
                "met": False,
                "flagged": True,
                "flag": verdict.flag,
            },
            {
                "name": "fastpar pack >= 85% of memcpy",
                "value": 0.9,
                "threshold": 0.85,
                "direction": "at_least",
                "unit": "%",
                "met": True,
                "flagged": False,
                "flag": None,
            },
        ],
        "goals_met": False,
    }
    assert summary([fine])["goals_met"] is True and summary([])["goals_met"] is None


def test_ddp_step_faster_than_no_communication_is_flagged():
    from fastpar.bench.benchmarks.ddp_step import step_goals

    seconds = {
        "no_comm": 1.0,
        "ddp": 1.5,
        "ddp_bucket_view": 1.4,
        "fastpar_fp32": 0.95,
        "fastpar_cap_4": 1.2,
        "fastpar_auto": 1.1,
    }
    fp32, auto = step_goals("mlp", seconds)
    assert fp32.goal.passes(fp32.value) and fp32.state == "IMPOSSIBLE" and "faster than the floor" in fp32.flag
    assert auto.state == "MET" and not auto.flagged  # both above the floor: a real comparison


def _pack_report(shares: dict[str, float]):
    """pack's report from given seconds: memcpy 1 s, fastpar at 1/share s (share of memcpy), the rest 1 s."""
    from fastpar.bench.benchmarks import pack

    _, ctx = prepare("pack", ["--shapes", "3x1K", "-n", "1", "-w", "0", "--rounds", "1"])
    seconds = {
        ("pack", "memcpy"): 1.0,
        ("pack", "torch.cat"): 1.0,
        ("unpack", "memcpy"): 1.0,
        ("unpack", "_foreach_copy_"): 1.0,
        ("pack", "fastpar.pack"): 1 / shares["pack"],
        ("unpack", "fastpar.unpack"): 1 / shares["unpack"],
    }
    return pack._report(ctx, *(2 * [pack.DTYPE_CHOICES[0]]), [((3, 1024), seconds)], "cpu", [])


def test_pack_above_memcpy_is_impossible_not_met():
    report = _pack_report({"pack": 22.45, "unpack": 0.9})
    (goal,) = report.goals
    assert goal.goal.passes(goal.value) and goal.state == "IMPOSSIBLE"
    assert "fastpar pack 3x1K at 2245.0% of memcpy" in goal.flag
    text = render_table(report)
    assert "-> IMPOSSIBLE (fastpar pack 3x1K at 2245.0% of memcpy" in text and "-> MET" not in text
    assert "# beyond a bound: fastpar pack 3x1K at 2245.0% of memcpy" in text
    assert report.to_json()["summary"]["goals_met"] is False


def test_pack_prints_shares_with_the_precision_of_the_verdict():
    report = _pack_report({"pack": 0.847, "unpack": 0.95})
    text = render_table(report)
    assert "fastpar pack 3x1K: 84.7% of memcpy" in text
    assert "goal: fastpar pack/unpack at the worst shape >= 85% of memcpy: 84.7% (pack 3x1K) -> NOT MET" in text
    assert "85%" not in text.replace(">= 85% of memcpy", "")


def test_fusion_faster_than_its_single_tensor_floor_is_flagged():
    import torch

    from fastpar.bench.benchmarks import fusion

    _, ctx = prepare("fusion", ["--count", "4", "--numel", "8", "--variants", "fastpar_bucketed"])
    ctx.backend = "gloo"
    report = fusion._report(ctx, 2, torch.float32, {"fastpar_bucketed": 0.5, "single": 1.0}, "1 MB")
    (goal,) = report.goals
    assert goal.state == "IMPOSSIBLE" and "fastpar_bucketed 0.500x single: faster than the floor" in goal.flag


def test_allreduce_above_the_in_place_bound_is_flagged_only_for_buffers_that_leave_the_caches():
    from fastpar.bench.benchmarks.collectives import _fastpar_goals

    rows = [dict(size=s, dtype="float32", busbw=12.0, x_gloo=5.0) for s in (4 << 10, 16 << 20, 64 << 20)]
    goals = {g.name: g for g in _fastpar_goals("allreduce", rows, memcpy_gbs=20.0, bound=10.0, floor_bytes=64 << 20)}
    assert goals["64M: all-reduce speed >= 4.00x gloo's"].state == "IMPOSSIBLE"
    assert goals["64M: all-reduce busbw >= 40% of memcpy"].state == "IMPOSSIBLE"
    assert (
        "64M busbw at 120.0% of the in-place all-reduce bound" in goals["64M: all-reduce busbw >= 40% of memcpy"].flag
    )
    assert goals["16M: all-reduce speed >= 4.00x gloo's"].state == "MET"  # 16M may sit in a cache
    assert goals["4K: all-reduce time <= 0.50x gloo's"].state == "MET"


def test_sweep_faster_than_two_trials_in_a_row_is_flagged():
    from fastpar.jobs import bench_sweep

    _, ctx = prepare("sweep", ["--steps", "1"], {**BENCHMARKS, "sweep": "fastpar.jobs.bench_sweep"})
    report = bench_sweep._report(ctx, 2, 4, {"sequential": 10.0, "sweep": 9.0, "submitit": 12.0})
    (goal,) = report.goals
    assert goal.state == "IMPOSSIBLE" and "sweep 0.900x sequential: faster than the floor" in goal.flag
    report = bench_sweep._report(ctx, 2, 4, {"sequential": 10.0, "sweep": 11.0, "submitit": 12.0})
    assert report.goals[0].line() == "goal: sweep <= 1.15x sequential: 1.10x -> MET"


def test_zero_table_has_one_state_column_and_fixed_width_lines():
    from fastpar.bench.benchmarks import zero

    _, ctx = prepare("zero", ["--models", "tiny"])
    ctx.backend = "gloo"
    times = dict(zip(zero.VARIANTS, (1.0, 1.5, 1.5, 1.9, 1.6, 1.7), strict=True))
    state = {
        "no_comm": [8000, 8000],
        "ddp": [8000, 8000],
        "ddp_fastpar": [8000, 8000],
        "zero_torch": [4000, 4000],
        "zero_fastpar": [4100, 3900],
        "zero2_fastpar": [4100, 3900],
        "_bucket": 100,
        "_numel": 1000,
        "_buckets": 2,
        "_pool": [800, 800],
        "_grads": {v: [4000, 4000] for v in zero.VARIANTS} | {"zero2_fastpar": [2700, 2700]},
    }
    report = zero._report(ctx, zero.ZeroSettings(["tiny"], 8), 2, {"tiny": times}, {"tiny": state})
    table = [line for line in render_table(report).splitlines() if not line.startswith("#")]
    titles = re.split(r"\s{2,}", table[0].strip())
    assert len(titles) == len(set(titles)) == len(report.columns)
    assert sum("state" in title for title in titles) == 1
    assert len({len(line) for line in table}) == 1  # every row lines up under the titles
    # state per rank, ZeRO-2's gradients (2700 <= 1000 * 4 / 2 + 800 + 8), then 1.6/1.5, 1.6/1.9, 1.7/1.6
    assert [g.state for g in report.goals] == ["MET", "MET", "NOT MET", "MET", "NOT MET"]


def test_a_machine_busier_than_its_cores_is_reported_with_a_warning(monkeypatch, capsys, tmp_path):
    from fastpar.bench import cli
    from fastpar.host import usable_cpu_count

    argv = ["pack", "--shapes", "2x64", "-n", "1", "-w", "0", "--rounds", "1"]
    monkeypatch.setattr(cli, "load_average", lambda: usable_cpu_count() + 0.5)
    assert main([*argv, "--json", str(tmp_path / "busy.json")]) == 0
    out = capsys.readouterr().out
    assert f"# load average: {usable_cpu_count() + 0.5:.2f} before" in out
    assert f"# warning: the machine was busier than its {usable_cpu_count()} usable CPU(s)" in out
    data = json.loads((tmp_path / "busy.json").read_text())
    assert data["warnings"] and data["machine"]["load_before"] == usable_cpu_count() + 0.5
    monkeypatch.setattr(cli, "load_average", lambda: 0.25)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "# load average: 0.25 before, 0.25 after" in out and "warning" not in out


@pytest.mark.parametrize("name", [*BENCHMARKS, "sweep"])
def test_every_benchmark_help_works_and_names_no_issue(name, capsys):
    from fastpar.cli import main as fastpar_main

    assert fastpar_main(["bench", name, "--help"]) == 0
    text = capsys.readouterr().out
    assert f"usage: fastpar bench {name}" in text
    assert not re.search(r"issue|#\d", text, re.IGNORECASE), text


def test_benchmark_only_without_pytest_benchmark_is_one_line(tmp_path):
    """Where pytest-benchmark is not installed, ``pytest bench --benchmark-only`` ends with the hint alone."""
    missing = tmp_path / "pytest_benchmark"
    missing.mkdir()
    (missing / "__init__.py").write_text("raise ModuleNotFoundError('No module named pytest_benchmark')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:benchmark", "-p", "no:cacheprovider", "bench", "--benchmark-only"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    output = (done.stdout + done.stderr).strip()
    assert output == "Exit: the bench/ entry points need pytest-benchmark: pip install 'fastpar[bench]'"
    assert done.returncode == pytest.ExitCode.USAGE_ERROR


def _imports(path: Path) -> set[str]:
    """Absolute names of the fastpar modules a file imports (relative imports resolved)."""
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, node.module] if node.module else base)
            names |= {f"{module}.{alias.name}" for alias in node.names} | ({module} if node.module else set())
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
    return {n for n in names if n == "fastpar" or n.startswith("fastpar.")}


def test_bench_imports_no_layer_above_it_and_no_benchmark_imports_another():
    files = sorted((REPO / "fastpar" / "bench").rglob("*.py"))
    above = ("fastpar.jobs", "fastpar.train", "fastpar.cli")
    upward = {f.name: sorted(n for n in _imports(f) if n == "fastpar" or n.startswith(above)) for f in files}
    assert {k: v for k, v in upward.items() if v} == {}
    benchmarks = set(BENCHMARKS.values()) - {"fastpar.bench.report"}
    for path in files:
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        if module in benchmarks:
            assert _imports(path) & (benchmarks - {module}) == set(), module
