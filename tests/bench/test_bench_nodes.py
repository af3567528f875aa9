"""``fastpar bench nodes``: a small run on 2 nodes x 2 ranks through the CLI prints the peer, the link floor, the
DDP rows and every goal, and writes the JSON; the link arithmetic; flags it refuses. No timing is asserted."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from fastpar.bench.benchmarks.nodes import _crossing
from fastpar.bench.cli import main
from fastpar.nodes import available

pytestmark = pytest.mark.timeout(600)
needs_nodes = pytest.mark.skipif(not available()[0], reason=available()[1] or "node namespaces are available")


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    return status, out.getvalue(), err.getvalue()


@needs_nodes
def test_small_run_prints_peer_floor_goals_and_json(tmp_path):
    path = tmp_path / "nodes.json"
    argv = ["nodes", "--size", "1M", "--model", "blocks", "--batch", "8", "--steps", "1"]
    plot = tmp_path / "nodes.png"
    status, printed, err = _run(
        [*argv, "--rounds", "2", "-n", "2", "-w", "1", "--json", str(path), "--plot", str(plot)]
    )
    assert status == 0, err
    for row in ("all-reduce gloo (peer)", "all-reduce fastpar", "all-reduce link-rate floor"):
        assert row in printed
    for row in ("torch DDP on gloo (peer)", "fastpar fp32", "fastpar bf16 grads", "no communication (floor)"):
        assert f"DDP step: {row}" in printed
    for row in ("torch ZeRO on gloo (peer)", "fastpar ZeRO-1", "fastpar ZeRO-2"):
        assert f"ZeRO step: {row}" in printed
    for variant in ("torch DDP on gloo (peer)", "fastpar fp32", "fastpar bf16 grads"):  # the profile
        assert f"profile, rank 0, median ms: {variant}: forward " in printed
    assert "of it waiting for the wire after the compute:" in printed
    assert "fastpar_fp32: 24.3 MiB of gradients out of each node's link per step (204 ms at the link's rate" in printed
    assert '"nodes": 2' in printed  # the backend ran hierarchically
    assert (
        "the hierarchy 1.00 MiB, gloo's ring 1.50 MiB; by the wire alone the speed-up over gloo is at most 1.50x"
        in printed
    )
    for goal in (
        "goal: fastpar all-reduce speed >= 1.60x gloo's:",
        "goal: fastpar all-reduce >= 80% of the link-rate bound:",
        "goal: fastpar_fp32 step <= 0.75x torch DDP on gloo:",
        "goal: fastpar_bf16 step <= 0.55x torch DDP on gloo:",
    ):
        assert goal in printed
    assert plot.stat().st_size > 0
    data = json.loads(path.read_text())
    assert data["benchmark"] == "nodes" and len(data["summary"]["goals"]) == 4
    assert data["summary"]["link_floor_ms"] == pytest.approx(2**20 * 8 / 1e9 * 1e3)  # 1 MiB over 1 Gbit/s
    assert set(data["summary"]["allreduce_ms"]) == {"fastpar", "gloo"}


def test_link_arithmetic():
    assert _crossing(2, 2, 100) == (100.0, 150.0)  # ring 0-1-2-3: one edge out of each node, 2*3/4 each
    assert _crossing(2, 1, 100) == (100.0, 100.0)  # nothing to gain with one rank per node
    leaders, ring = _crossing(3, 2, 600)
    assert leaders == pytest.approx(800.0) and ring == pytest.approx(1000.0)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--nodes", "0"], "--nodes 0: choose 1 to 16"),
        (["--link", "fast"], "is not a tc rate"),
        (["--model", "resnet"], "--model 'resnet': choose one of"),
    ],
)
def test_bad_flags_are_refused(flags, message):
    status, _, err = _run(["nodes", *flags])
    assert status == 2 and message in err, err
