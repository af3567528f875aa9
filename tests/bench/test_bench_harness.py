"""The benchmark harness without timing: sizes, dtypes, bus factors, correctness checks, tables, JSON."""

from __future__ import annotations

import json

import pytest
import torch

from fastpar.bench import launch
from fastpar.bench.benchmarks.collective_cases import (
    NAMES,
    SPLIT,
    bus_factor,
    distinct_sizes,
    element_counts,
    make_case,
)
from fastpar.bench.benchmarks.pack import parse_shapes
from fastpar.bench.harness import (
    BenchUsageError,
    Plan,
    count_mismatches,
    format_bytes,
    interleaved_rounds,
    parse_bytes,
    parse_dtype,
    size_sweep,
)
from fastpar.bench.table import SCHEMA, BenchReport, Column, render_table, write_json


@pytest.mark.parametrize(
    ("name", "n", "factor"),
    [
        ("allreduce", 2, 1.0),
        ("allreduce", 4, 1.5),
        ("allreduce", 8, 1.75),
        ("reducescatter", 4, 0.75),
        ("allgather", 8, 0.875),
        ("alltoall", 2, 0.5),
        ("broadcast", 8, 1.0),
    ],
)
def test_bus_factors_match_nccl_tests(name, n, factor):
    assert bus_factor(name, n) == pytest.approx(factor)


def test_bus_factor_rejects_unknown_collective():
    with pytest.raises(ValueError, match="unknown collective"):
        bus_factor("allsum", 2)


@pytest.mark.parametrize(
    ("text", "nbytes"), [("64", 64), ("8K", 8192), ("1m", 1 << 20), ("2G", 2 << 30), ("4KB", 4096)]
)
def test_parse_bytes_accepts_nccl_tests_suffixes(text, nbytes):
    assert parse_bytes(text) == nbytes


@pytest.mark.parametrize("text", ["", "1.5M", "K", "-4K", "8T"])
def test_parse_bytes_rejects_garbage(text):
    with pytest.raises(BenchUsageError, match="cannot read size"):
        parse_bytes(text)


def test_size_sweep_multiplies_up_to_the_maximum():
    assert size_sweep(1024, 16384, 2) == [1024, 2048, 4096, 8192, 16384]
    assert size_sweep(parse_bytes("1K"), parse_bytes("1M"), 4) == [1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20]
    assert size_sweep(1000, 5000, 4) == [1000, 4000]  # stops below the maximum when it does not land on it
    assert size_sweep(4096, 4096, 2) == [4096]


def test_size_sweep_errors():
    with pytest.raises(BenchUsageError, match="out of order"):
        size_sweep(parse_bytes("1M"), parse_bytes("1K"), 2)
    with pytest.raises(BenchUsageError, match="factor"):
        size_sweep(1024, 4096, 1)
    with pytest.raises(BenchUsageError, match="positive"):
        size_sweep(0, 4096, 2)


def test_format_bytes_round_trips():
    for nbytes in (1, 1000, 1024, 3 << 20, 1 << 30):
        assert parse_bytes(format_bytes(nbytes)) == nbytes


def test_parse_dtype():
    assert parse_dtype("bf16") is torch.bfloat16
    assert parse_dtype("Float32") is torch.float32
    assert parse_dtype("int8") is torch.int8
    with pytest.raises(BenchUsageError, match="unknown dtype 'float8'"):
        parse_dtype("float8")
    with pytest.raises(BenchUsageError, match="pack supports --dtype float32, float16, bfloat16; got 'int32'"):
        parse_dtype("int32", (torch.float32, torch.float16, torch.bfloat16), user="pack")


def test_parse_shapes():
    assert parse_shapes("32x1M,384x16K, 3x5") == [(32, 1 << 20), (384, 16 << 10), (3, 5)]
    with pytest.raises(BenchUsageError, match="COUNTxNUMEL"):
        parse_shapes("32by1M")


def _simulate(name: str, cases: list) -> list[torch.Tensor]:
    """What each rank's output must hold, computed from every rank's input with plain torch."""
    n = len(cases)
    inputs = [c.inp.double() for c in cases]
    if name == "allreduce":
        return [sum(inputs)] * n
    if name == "broadcast":
        return [inputs[0]] * n
    if name == "reducescatter":
        return list(sum(inputs).chunk(n))
    if name == "allgather":
        return [torch.cat(inputs)] * n
    return [torch.cat([inputs[k].chunk(n)[r] for k in range(n)]) for r in range(n)]  # alltoall


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.uint8])
def test_collective_expected_values_are_what_the_collective_computes(name, world, dtype):
    cases = [make_case(name, 1000, dtype, torch.device("cpu"), rank, world) for rank in range(world)]
    for case, truth in zip(cases, _simulate(name, cases), strict=True):
        assert case.expected.dtype == dtype
        assert count_mismatches(case.expected.double(), truth) == 0
        assert case.nbytes == case.total * case.inp.element_size() <= 1000
        if name in SPLIT:  # nccl-tests: count is one rank's share, the size the whole buffer
            assert case.total == case.count * world
        else:
            assert case.total == case.count


@pytest.mark.parametrize("world", [64, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize("name", ["allreduce", "reducescatter"])
def test_reduction_check_values_stay_exact_at_any_world_size(name, world, dtype):
    """Summed one rank at a time in the dtype itself (as a ring does), every partial sum stays exact,
    so a large job never reports wrong results that are only rounding of the check values."""
    cases = [make_case(name, 512, dtype, torch.device("cpu"), rank, world) for rank in range(world)]
    total = cases[0].inp.clone()
    for case in cases[1:]:
        total += case.inp  # rounds (or wraps) in ``dtype`` after every step
    for rank in (0, world - 1):
        got = total if name == "allreduce" else total.chunk(world)[rank]
        assert count_mismatches(got, cases[rank].expected) == 0


def test_reduction_check_catches_a_wrong_reduce_op():
    cases = [make_case("allreduce", 4096, torch.float32, torch.device("cpu"), rank, 3) for rank in range(3)]
    maximum = torch.stack([c.inp for c in cases]).amax(dim=0)  # MAX instead of SUM
    assert count_mismatches(maximum, cases[0].expected) == cases[0].count
    partial = cases[0].inp + cases[1].inp  # one rank's contribution lost
    assert count_mismatches(partial, cases[0].expected) > 0


@pytest.mark.parametrize("name", NAMES)
def test_collective_check_catches_a_corrupted_result(name):
    case = make_case(name, 4096, torch.float32, torch.device("cpu"), 1, 2)
    result = case.expected.clone()
    assert count_mismatches(result, case.expected) == 0
    result[7] += 1
    result[-1] = float("nan")
    assert count_mismatches(result, case.expected) == 2


def test_split_collectives_round_counts_down_to_whole_elements_per_rank():
    assert element_counts("reducescatter", 1000, 4, 3) == (83, 249)  # 250 floats -> 83 per rank
    assert element_counts("alltoall", 1, 4, 4) == (1, 4)  # at least one element per rank
    assert element_counts("allreduce", 1001, 4, 3) == (250, 250)
    assert element_counts("broadcast", 3, 2, 2) == (1, 1)
    case = make_case("reducescatter", 1000, torch.float32, torch.device("cpu"), 0, 3)
    assert (case.count, case.total, case.nbytes, case.out.numel()) == (83, 249, 996, 83)
    # 1K..4K by 2 with 3 ranks and bf16 share no buffer; 2 and 3 bytes of float32 both round to one element
    assert distinct_sizes("allgather", [1024, 2048, 4096], 2, 3) == [1024, 2048, 4096]
    assert distinct_sizes("allreduce", [2, 3, 4, 8], 4, 2) == [2, 8]


def test_count_mismatches_with_tolerance_and_shape():
    a = torch.tensor([1.0, 2.0, 3.0])
    assert count_mismatches(a + 1e-3, a, rtol=1e-2) == 0
    assert count_mismatches(a + 1e-3, a) == 3
    assert count_mismatches(a[:2], a) == 3


def test_interleaved_rounds_runs_every_variant_each_round():
    calls = []
    variants = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    times = interleaved_rounds(variants, Plan(warmup=1, rounds=3, iters=2), torch.device("cpu"), iters={"b": 1})
    assert calls == ["a", "b"] + ["a", "a", "b"] * 3
    assert set(times) == {"a", "b"} and all(len(t) == 3 and min(t) >= 0 for t in times.values())
    with pytest.raises(BenchUsageError):
        Plan(warmup=0, rounds=0, iters=1)


def _report() -> BenchReport:
    return BenchReport(
        benchmark="demo",
        title="a table",
        columns=[Column("name", "name", 6), Column("t", "time(us)", 9, ".1f", "us"), Column("r", "share", 7, ".1%")],
        rows=[{"name": "x", "t": 12.345, "r": 0.5}, {"name": "yy", "t": float("inf"), "r": None, "extra": 3}],
        header={"backend": "gloo"},
        footer=["Avg bus bandwidth : 1.000 GB/s"],
        notes=["something skipped"],
        summary={"best": 1.5, "by_shape": {"a": float("nan"), "b": [float("inf"), 2.0]}},
    )


def test_table_has_fixed_columns_header_and_footer():
    lines = render_table(_report()).splitlines()
    assert lines[0] == "# fastpar bench demo: a table"
    assert "# backend: gloo" in lines
    table = [line for line in lines if not line.startswith("#")]
    assert table == ["  name  time(us)   share", "     x      12.3   50.0%", "    yy       inf       -"]
    assert lines[-2:] == ["# Avg bus bandwidth : 1.000 GB/s", "# note: something skipped"]


def test_json_schema(tmp_path):
    path = write_json(_report(), tmp_path / "sub" / "demo.json")
    data = json.loads(path.read_text())
    assert data["schema"] == SCHEMA and data["benchmark"] == "demo"
    assert set(data) == {
        "schema",
        "benchmark",
        "title",
        "command",
        "created",
        "fastpar",
        "machine",
        "header",
        "columns",
        "rows",
        "summary",
        "footer",
        "warnings",
        "notes",
        "config",
    }
    assert [c["key"] for c in data["columns"]] == ["name", "t", "r"]
    assert data["rows"][0] == {"name": "x", "t": 12.345, "r": 0.5}
    assert data["rows"][1] == {"name": "yy", "t": None, "r": None, "extra": 3}  # inf is not JSON
    assert data["summary"]["by_shape"] == {"a": None, "b": [None, 2.0]}  # nor is nan, however deep
    assert data["summary"]["goals"] == [] and data["summary"]["goals_met"] is None  # no goal checked


def test_resolve_world_errors(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert launch.resolve_world(2, "gloo").backend == "gloo"
    with pytest.raises(BenchUsageError, match="CPU ranks"):
        launch.resolve_world(launch.max_cpu_ranks() + 1, "gloo")
    with pytest.raises(BenchUsageError, match="at least 1"):
        launch.resolve_world(0, "gloo")
    with pytest.raises(BenchUsageError, match="unknown backend"):
        launch.resolve_world(2, "mpi")
    if not torch.cuda.is_available():
        with pytest.raises(BenchUsageError, match="needs CUDA"):
            launch.resolve_world(1, "nccl")
    else:
        with pytest.raises(BenchUsageError, match="GPU"):
            launch.resolve_world(torch.cuda.device_count() + 1, "auto")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(BenchUsageError, match="WORLD_SIZE=4"):
        launch.resolve_world(2, "gloo")
    assert launch.resolve_world(None, "gloo") == launch.World(4, "gloo", True)
