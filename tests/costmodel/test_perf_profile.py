"""The profile: JSON round trip, interpolation of measured collectives, per-reducer costs."""

from __future__ import annotations

import json

import pytest

from fastpar.costmodel.collective_costs import ring_seconds
from fastpar.costmodel.perf_profile import SCHEMA, CollectiveTable, Profile
from fastpar.costmodel.step_simulator import GradArrival, StepTimeline


def profile() -> Profile:
    grads = [GradArrival(1, 400, "float32", 0.001), GradArrival(0, 800, "bfloat16", 0.002)]
    return Profile(
        backend="gloo",
        device="cpu",
        world_size=2,
        collectives={"allreduce": CollectiveTable([1000, 4000, 2000], [0.002, 0.005, 0.003])},
        moves_gbs={"torch_pack": 2.0, "torch_unpack": 4.0, "fastpar_pack": 8.0, "fastpar_unpack": 10.0},
        contention={"compute_slowdown": 0.25, "wire_slowdown": 1.5},
        overheads={"fsdp_unit_s": 0.004, "fsdp_regather_s": 0.001, "fsdp_unit_bytes": 16640.0},
        timeline=StepTimeline(grads, backward_s=0.003, forward_s=0.001, optimizer_s=0.0005),
        model={"name": "tiny"},
        measured=[{"variant": "torch_ddp", "bucket_cap_mb": 4, "world_size": 2, "step_s": 0.01}],
    )


def test_collective_table_interpolates_and_extrapolates():
    table = profile().collectives["allreduce"]
    assert table.nbytes == [1000, 2000, 4000]  # sorted
    assert table.seconds_at(500) == pytest.approx(0.002)  # below the sweep: the smallest (latency)
    assert table.seconds_at(1500) == pytest.approx(0.0025)  # linear between points
    assert table.seconds_at(6000) == pytest.approx(0.005 + 2000 * 0.001 / 1000)  # the last slope beyond
    assert list(table.seconds_at([1000, 3000])) == pytest.approx([0.002, 0.004])


def test_comm_at_other_world_sizes_uses_the_fitted_ring():
    p = profile()
    assert p.comm()(2000) == pytest.approx(0.003)
    fabric = p.fitted_fabric()
    assert p.comm(5)(2000) == pytest.approx(ring_seconds("allreduce", 2000, 5, fabric))
    assert p.comm(1)(2000) == 0.0


def test_sync_costs_per_reducer():
    p = profile()
    torch_costs = p.sync_costs("torch")
    assert torch_costs.pack_s_per_byte == pytest.approx(1 / 2e9)
    assert torch_costs.unpack_s_per_byte == pytest.approx(1 / 4e9)
    assert (torch_costs.compute_slowdown, torch_costs.wire_slowdown) == (0.25, 1.5)
    views = p.sync_costs("fastpar_views", comm_bytes_per_byte=0.5, contention=False)
    assert views.pack_s_per_byte == 0.0 and views.unpack_s_per_byte == pytest.approx(1 / 10e9)
    assert views.comm_bytes_per_byte == 0.5 and views.compute_slowdown == 0.0
    assert p.sync_costs("torch_views").unpack_s_per_byte == 0.0


def test_json_round_trip(tmp_path):
    path = profile().save(tmp_path / "p.json")
    data = json.loads(path.read_text())
    assert data["schema"] == SCHEMA and data["timeline"]["grads"][0]["index"] == 1
    again = Profile.load(path)
    assert again.to_json() == profile().to_json()
    assert again.timeline.grads == profile().timeline.grads
    assert again.overheads["fsdp_unit_s"] == 0.004
    del data["overheads"]  # a profile written before the overheads were measured: none priced
    path.write_text(json.dumps(data))
    assert Profile.load(path).overheads == {}


def test_not_a_profile_is_refused(tmp_path):
    (tmp_path / "bench.json").write_text(json.dumps({"schema": "fastpar.bench/1"}))
    with pytest.raises(ValueError, match="not a fastpar profile"):
        Profile.load(tmp_path / "bench.json")
    (tmp_path / "junk.json").write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        Profile.load(tmp_path / "junk.json")
    with pytest.raises(ValueError, match="no 'fastpar_pack' bandwidth"):
        Profile("gloo", "cpu", 2, profile().collectives).sync_costs("fastpar_packed")
