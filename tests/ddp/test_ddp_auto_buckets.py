"""``bucket_cap_mb="auto"``: the decision's arithmetic against hand-computed cases, and end to end on spawned gloo
ranks -- every rank builds the same layout, with torch DDP's bits at 2 ranks (where a layout cannot change
them) and the same bits on every rank at 3, alone and with find_unused_parameters, static_graph, no_sync
and a comm hook; a prediction that does not hold is rolled back; join() stops it.

The end-to-end runs shorten the phases (1 warm-up step, 2 measured) and, where a test needs a layout change,
replace the planner's answer with one bucket per parameter and the verification's measurement with a faster
step, so the rebuild path runs whatever this machine's timings would decide.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from fastpar.costmodel.step_simulator import GradArrival, StepTimeline, SyncCosts
from fastpar.ddp import auto_buckets
from fastpar.ddp.auto_buckets import fit_wire, monotone, sweep_sizes
from fastpar.ddp.step_recorder import StepRecorder
from fastpar.launcher import spawn

sys.path.insert(0, __file__.rsplit("/", 1)[0])

MB = 1024 * 1024


def test_sweep_sizes_go_up_by_four_to_all_the_gradients():
    assert sweep_sizes(64 * MB) == [64 * 1024, 256 * 1024, MB, 4 * MB, 16 * MB, 64 * MB]
    assert sweep_sizes(100_000) == [65536, 100_000]
    assert sweep_sizes(7400) == [1848, 7400]  # below 64 KiB: a quarter and the whole
    assert sweep_sizes(10**12)[-1] == 256 * MB  # capped


def test_monotone_pools_adjacent_violators():
    assert monotone([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert monotone([5.0, 1.0, 0.0]) == [2.0, 2.0, 2.0]
    assert monotone([0.5, 1.0]) == [0.5, 1.0]


def _one_bucket(backward_s: float) -> StepTimeline:
    return StepTimeline([GradArrival(0, 1000, "float32", 0.0)], backward_s)


def test_fit_wire_slowdown_by_hand():
    # ready at 0, backward 1 s, 0.5 s on the wire. Slowed by k while backward runs, the wire has done 1/(1+k)
    # by t = 1 and the rest alone: the sync ends at 1 + 0.5 - 1/(1+k). Measured end 1.25 s -> k = 3.
    comm, costs, fit = fit_wire(_one_bucket(1.0), [[0]], lambda n: 0.5 + 0 * np.asarray(n), SyncCosts(), 1.25)
    assert fit["wire_slowdown"] == pytest.approx(3.0, rel=1e-6) and fit["comm_scale"] == 1.0
    assert costs.wire_slowdown == pytest.approx(3.0, rel=1e-6)


def test_fit_wire_scale_by_hand():
    # backward 0.1 s, 0.5 s on the wire uncontended: the sync would end at 0.5 s; measured 0.3 s -> 0.6 x comm
    comm, costs, fit = fit_wire(_one_bucket(0.1), [[0]], lambda n: 0.5 + 0 * np.asarray(n), SyncCosts(), 0.3)
    assert fit["comm_scale"] == pytest.approx(0.6, rel=1e-6) and fit["wire_slowdown"] == 0.0
    assert comm(123) == pytest.approx(0.3, rel=1e-6)


def test_shortlist_tries_the_predicted_best_and_a_layout_with_half_its_buckets():
    from fastpar.costmodel.bucket_optimizer import BucketPlan
    from fastpar.ddp.auto_buckets import shortlist

    current = [[0], [1], [2], [3]]
    layouts = {
        "current layout": current,
        "split": [[0, 1], [2], [3]],  # 3 buckets, predicted best
        "cap 4 MB": [[0], [1], [2], [3]],  # the current layout again
        "cap 25 MB": [[0, 1, 2, 3]],  # 1 bucket <= 3 // 2
    }
    predicted = {"current layout": 1.0, "split": 0.9, "cap 4 MB": 1.0, "cap 25 MB": 1.5}
    plan = BucketPlan(layouts["split"], None, "split", predicted, layouts)
    assert shortlist(plan, current) == [("split", layouts["split"]), ("cap 25 MB", layouts["cap 25 MB"])]
    # a best within KEEP_MARGIN of the current layout is not worth measuring; half of 4 buckets is 2
    plan = BucketPlan(layouts["split"], None, "split", predicted | {"split": 0.99}, layouts)
    assert shortlist(plan, current) == [("cap 25 MB", layouts["cap 25 MB"])]
    # nothing with fewer buckets that differs from what is listed: only the best
    plan = BucketPlan(current, None, "current layout", {"current layout": 1.0}, {"current layout": current})
    assert shortlist(plan, current) == []


class _ScriptedClock:
    """Host stamps taken from a script: the recorder's arithmetic without real time."""

    def __init__(self, stamps: list[float]) -> None:
        self.stamps = iter(stamps)

    def stamp(self) -> float:
        return next(self.stamps)

    def seconds(self, stamps: list[float]) -> list[float]:
        return [s - stamps[0] for s in stamps]


def test_step_recorder_subtracts_the_reducers_own_work():
    rec = StepRecorder(torch.device("cpu"))
    rec._clock = _ScriptedClock([100.0, 110.0, 111.0, 113.0, 120.0, 125.0, 126.0, 127.0, 130.0])
    rec.forward()  # 100
    rec.ready(1)  # 110: the first arrival, the origin
    with rec.timed("pack", 400):  # 111-113: 2 s of packing during backward
        pass
    rec.ready(0)  # 120: 10 s after the origin, 8 s of it compute
    rec.backward_end()  # 125
    with rec.timed("finish", 800):  # 126-127, after backward
        pass
    rec.end()  # 130
    (step,) = rec.steps
    assert step.ready == {1: 0.0, 0: 8.0}
    assert step.backward_s == 13.0 and step.sync_s == 20.0 and step.step_s == 30.0
    assert step.work_s == {"pack": 2.0, "finish": 1.0} and step.work_bytes == {"pack": 400, "finish": 800}
    ready0, ready1, backward, sync, total, pack, finish = rec.summary(2)
    assert (ready0, ready1, backward, sync, total) == (8.0, 0.0, 13.0, 20.0, 30.0)
    assert pack == pytest.approx(2.0 / 400) and finish == pytest.approx(1.0 / 800)


def test_a_step_without_gradients_is_not_recorded():
    rec = StepRecorder(torch.device("cpu"))
    rec.forward()
    rec.backward_end()
    rec.end()
    assert rec.steps == []


def test_bad_bucket_cap_values_are_refused(no_process_group):
    import fastpar

    with pytest.raises(ValueError, match="bucket_cap_mb must be a number of MiB or 'auto'"):
        fastpar.DDP(torch.nn.Linear(2, 2), bucket_cap_mb="fast")
    with pytest.raises(ValueError, match="leave bucket_cap_mb_list unset"):
        fastpar.DDP(torch.nn.Linear(2, 2), bucket_cap_mb="auto", bucket_cap_mb_list=[1, 2])


# ---- end to end ------------------------------------------------------------------------------------------


def _short_phases() -> None:
    auto_buckets.WARMUP_STEPS, auto_buckets.MEASURE_STEPS = 1, 2


def _force_one_bucket_per_parameter(keep: bool = True) -> None:
    from fastpar.costmodel.bucket_optimizer import BucketPlan

    def plan(timeline, comm, costs=None, caps_mb=(), extra=None):
        buckets = [[g.index] for g in timeline.grads]  # arrival order
        candidates = {"current layout": 1.0, "one per parameter": 0.5}
        layouts = {"current layout": extra["current layout"], "one per parameter": buckets}
        return BucketPlan(buckets, None, "one per parameter", candidates, layouts)

    auto_buckets.plan_buckets = plan
    if keep:  # the new layout's steps "measure" 0 s: the verification keeps it
        auto_buckets.StepRecorder.median_step_s = lambda self: 0.0


def _auto_rank(rank: int, world_size: int, forced: bool) -> dict:
    from ddp_models import train

    import fastpar

    _short_phases()
    if forced:
        _force_one_bucket_per_parameter()
    torch_ddp = torch.nn.parallel.DistributedDataParallel
    out = {}
    cases = {
        "mlp": ("mlp", {}, {}),
        "find_unused": ("unused", {"find_unused_parameters": True}, {}),
        "static_graph": ("mlp", {"static_graph": True}, {}),
        "no_sync": ("mlp", {}, {"accumulate": "no_sync"}),
        "fp16_hook": ("mlp", {}, {}),
    }
    for name, (kind, ddp_args, train_args) in cases.items():
        models = []

        def wrap(module, cls, name=name, ddp_args=ddp_args, models=models):
            model = cls(module, **ddp_args)
            if name == "fp16_hook":
                from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

                model.register_comm_hook(None, fp16_compress_hook)
            models.append(model)
            return model

        ref = train(lambda m: wrap(m, torch_ddp), kind, rank, steps=14, **train_args)
        got = train(
            lambda m: wrap(m, lambda mod, **kw: fastpar.DDP(mod, bucket_cap_mb="auto", **kw)),
            kind,
            rank,
            steps=14,
            **train_args,
        )
        reducer = models[-1].reducer
        out[name] = {
            "differ": [k for k in ref if not torch.equal(ref[k], got[k])],
            "params": torch.cat([v.reshape(-1).float() for v in got.values()]),
            "layout": reducer.layout(),
            "auto": reducer.auto.summary(),
        }
    return out


def _check_agreement(results: list[dict], case: str) -> dict:
    first = results[0][case]
    for other in results[1:]:
        assert other[case]["layout"] == first["layout"], f"{case}: ranks built different layouts"
        assert torch.equal(other[case]["params"], first["params"]), f"{case}: ranks hold different parameters"
        assert other[case]["auto"]["kept"] == first["auto"]["kept"]
    assert first["auto"]["phase"] == "done", first["auto"]
    return first


@pytest.fixture(scope="module")
def two_ranks_forced():
    return spawn(_auto_rank, 2, True, timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["mlp", "find_unused", "static_graph", "no_sync", "fp16_hook"])
def test_auto_rebuild_keeps_torchs_bits_at_two_ranks(two_ranks_forced, case):
    result = _check_agreement(two_ranks_forced, case)
    for rank_result in two_ranks_forced:
        assert rank_result[case]["differ"] == [], f"{case}: differs from torch DDP"
    assert result["auto"]["chosen"] == result["auto"]["kept"] == "one per parameter"
    assert len(result["layout"]) > 1 and all(len(b) == 1 for b in result["layout"])


@pytest.mark.slow
def test_auto_decides_on_its_own_and_every_rank_agrees():
    results = spawn(_auto_rank, 2, False, timeout=900)
    for case in ("mlp", "find_unused", "static_graph", "no_sync", "fp16_hook"):
        result = _check_agreement(results, case)
        assert all(r[case]["differ"] == [] for r in results)
        assert "current layout" in result["auto"]["predicted_ms"] and result["auto"]["sweep_ms"]


def _three_rank(rank: int, world_size: int) -> dict:
    _short_phases()
    _force_one_bucket_per_parameter()
    return {
        name: {k: v for k, v in r.items() if k != "differ"} for name, r in _auto_rank(rank, world_size, True).items()
    }


@pytest.mark.slow
def test_auto_at_three_ranks_every_rank_ends_with_the_same_bits():
    results = spawn(_three_rank, 3, timeout=900)
    for case in ("mlp", "find_unused", "static_graph", "no_sync", "fp16_hook"):
        result = _check_agreement(results, case)
        assert result["auto"]["kept"] == "one per parameter" and all(len(b) == 1 for b in result["layout"])


def _rollback_rank(rank: int, world_size: int) -> dict:
    from ddp_models import MLP, make_input

    import fastpar

    _short_phases()
    _force_one_bucket_per_parameter(keep=False)
    torch.manual_seed(0)
    model = fastpar.DDP(MLP(), bucket_cap_mb="auto")
    gen = torch.Generator().manual_seed(rank)
    before = None
    for _ in range(12):
        auto = model.reducer.auto
        if auto.phase == "verify" and before is None:
            before = auto._measured["current layout"][1]
            auto._measured["current layout"] = (0.0, before)  # "measured" infinitely fast: must be kept
        model(make_input("mlp", gen)).sum().backward()
    return {"before": before, "after": model.reducer.layout(), "auto": model.reducer.auto.summary()}


@pytest.mark.slow
def test_a_prediction_that_does_not_hold_is_rolled_back():
    for result in spawn(_rollback_rank, 2, timeout=300):
        assert result["auto"]["kept"] == "current layout" and result["auto"]["phase"] == "done"
        assert result["before"] is not None and result["after"] == result["before"]


def _join_rank(rank: int, world_size: int) -> dict:
    from ddp_models import MLP

    import fastpar

    _short_phases()
    torch.manual_seed(0)
    model = fastpar.DDP(MLP(), bucket_cap_mb="auto")
    gen = torch.Generator().manual_seed(rank)
    with model.join():
        for _ in range(3 + 2 * rank):  # uneven inputs
            model(torch.randn(8, 16, generator=gen)).square().mean().backward()
    return model.reducer.auto.summary()


@pytest.mark.slow
def test_join_stops_auto_where_it_is():
    for summary in spawn(_join_rank, 2, timeout=300):
        assert summary["phase"] == "off" and "join()" in summary["stopped"]


@pytest.mark.slow
def test_guide_example_runs_as_written():
    import os
    import re
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    example = root / "examples" / "ddp_auto_buckets.py"
    guide = (root / "docs" / "guide" / "ddp.md").read_text()
    shown = re.search(r"```python\n(\"\"\"fastpar DDP choosing its own buckets.*?)```", guide, flags=re.S)
    assert shown is not None and shown.group(1) == example.read_text(), (
        "docs/guide/ddp.md shows examples/ddp_auto_buckets.py"
    )
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=600, env=env, cwd=root)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "bucket_cap_mb='auto': done; chose " in run.stdout and "predicted sync per step (ms):" in run.stdout


def _failing_plan_rank(rank: int, world_size: int) -> dict:
    from ddp_models import MLP, make_input

    import fastpar

    _short_phases()

    def broken(*args, **kwargs):
        raise ArithmeticError("planner bug")

    auto_buckets.plan_buckets = broken  # only rank 0 plans: the others must not wait for it forever
    torch.manual_seed(0)
    model = fastpar.DDP(MLP(), bucket_cap_mb="auto")
    gen = torch.Generator().manual_seed(rank)
    for _ in range(10):
        model(make_input("mlp", gen)).sum().backward()
    return {"auto": model.reducer.auto.summary()}


@pytest.mark.slow
def test_a_planning_error_on_rank0_keeps_the_layout_on_every_rank():
    results = spawn(_failing_plan_rank, 2, timeout=300)
    for result in results:
        assert result["auto"]["phase"] == "done" and result["auto"]["kept"] == "current layout"
        assert "planner bug" in result["auto"]["error"]


def _stateful_hook_rank(rank: int, world_size: int) -> dict:
    """PowerSGD (error feedback and warm start keyed by bucket index) under "auto", forced to want one bucket per
    parameter: registering the hook stops "auto", so PowerSGD runs on the layout torch's DDP uses too."""
    from ddp_models import train
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    import fastpar

    _short_phases()
    _force_one_bucket_per_parameter()
    models = []

    def wrap(cls, **kwargs):
        def build(module):
            model = cls(module, **kwargs)
            state = powersgd.PowerSGDState(
                process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2, random_seed=0
            )
            model.register_comm_hook(state, powersgd.powerSGD_hook)
            models.append(model)
            return model

        return build

    ref = train(wrap(torch.nn.parallel.DistributedDataParallel), "mlp", rank, steps=14)
    got = train(wrap(fastpar.DDP, bucket_cap_mb="auto"), "mlp", rank, steps=14)
    return {
        "differ": [k for k in ref if not torch.equal(ref[k], got[k])],
        "auto": models[-1].reducer.auto.summary(),
        "layout": models[-1].reducer.layout(),
    }


@pytest.mark.slow
def test_a_stateful_comm_hook_stops_auto_with_the_layout_it_started_on():
    for result in spawn(_stateful_hook_rank, 2, timeout=300):
        assert result["differ"] == [], "differs from torch DDP with the same PowerSGD hook"
        assert result["auto"]["phase"] == "off" and "comm hook" in result["auto"]["stopped"]
        assert len(result["layout"]) == 1  # fastpar's default layout for this model, as torch's: one bucket
