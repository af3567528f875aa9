"""The memory planner's predictions against real tensors in this process: model state counted from a trained
module, activations from the tensors autograd saves, the pipeline split against every split, the choice and
the advice, and ``fastpar plan``'s output and errors. (On spawned ranks: test_memory_planner_measured.py.)"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fastpar.costmodel.memory_planner import STRATEGIES, parse_bytes, plan, plan_for_module
from fastpar.costmodel.model_probe import _SavedTensorCounter, probe
from fastpar.costmodel.model_spec import Layer, ModelSpec, model_layers
from fastpar.costmodel.pipeline_split import balanced_split
from fastpar.costmodel.reference_transformer import ReferenceTransformer
from fastpar.user_errors import UserError

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(layers=3, hidden=64, vocab=500, seq_len=32)


@pytest.fixture(scope="module")
def small_probe():
    return probe(ModelSpec.transformer(**SMALL), batch_size=2, seq_len=SMALL["seq_len"])


def _plan(probe_result, **kwargs):
    args = dict(devices=2, device_memory="1GB", batch_size=4, seq_len=SMALL["seq_len"], probe_result=probe_result)
    return plan(ModelSpec.transformer(**SMALL), **{**args, **kwargs})


def _storage_bytes(tensors) -> int:
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ddp_model_state_is_what_a_trained_module_holds(small_probe, dtype):
    """DDP keeps every rank's model whole: the bytes of one module trained a step with AdamW, exactly."""
    torch.manual_seed(0)
    model = ReferenceTransformer(**SMALL).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = model.example_batch(2)
    model.loss(model(ids).float(), ids).backward()
    opt.step()
    state = [v for s in opt.state.values() for v in s.values()]
    name = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    ddp = _plan(small_probe, param_dtype=name).best("ddp").memory
    assert ddp.parameters == _storage_bytes(model.parameters())
    assert ddp.gradients == _storage_bytes(p.grad for p in model.parameters())
    assert ddp.optimizer_state == _storage_bytes(state)


def test_sharding_divides_what_it_shards(small_probe):
    p = _plan(small_probe, devices=4)
    ddp, zero1, zero2 = (p.best(s).memory for s in ("ddp", "zero1", "zero2"))
    fsdp = next(e for e in p.estimates if e.options == {"reshard_after_forward": True}).memory
    assert zero1.parameters >= ddp.parameters and zero1.gradients == zero1.parameters  # padded buckets, whole
    assert zero1.optimizer_state == pytest.approx(ddp.optimizer_state / 4, rel=0.01)
    assert zero2.gradients == zero2.parameters // 4
    # the same state, plus a step count (and a padding element) per bucket ZeRO-2 splits off to fit its staging
    assert zero1.optimizer_state <= zero2.optimizer_state <= zero1.optimizer_state * 1.001
    # fully_shard pads each parameter's dim 0 to a multiple of the world size: vocab 500 rows -> 125 per rank
    assert fsdp.parameters >= ddp.parameters / 4 and fsdp.parameters < ddp.parameters / 4 * 1.05
    assert ddp.activations == zero1.activations == fsdp.activations
    keep = next(e for e in p.estimates if e.strategy == "fsdp" and not e.options["reshard_after_forward"]).memory
    assert keep.buffers > fsdp.buffers  # every unit stays gathered from forward to backward


def _saved_bytes_at(batch, seq_len):
    torch.manual_seed(0)
    model = ReferenceTransformer(**{**SMALL, "seq_len": 128})
    ids = model.example_batch(batch, seq_len)
    layers = model_layers(model)
    counter = _SavedTensorCounter(model, layers, exclude=[*model.parameters(), ids])
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        loss = model.loss(model(ids), ids)
    counter.close()
    del loss
    return sum(counter.bytes)


def test_activations_measured_small_scale_to_the_real_batch_and_length():
    """Measured at 2 samples of 32 and 64 tokens, predicted at 8 samples of 128 tokens: within 3% of the
    saved tensors counted at that size (the difference: per-sample rounding of tiny tensors)."""
    result = probe(ModelSpec.transformer(**{**SMALL, "seq_len": 128}), batch_size=2, seq_len=64)
    predicted = sum(result.activation_bytes(8, 128))
    assert predicted == pytest.approx(_saved_bytes_at(8, 128), rel=0.03)


def test_pipeline_split_is_the_best_contiguous_split():
    costs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    for stages in (2, 3, 4):
        starts = balanced_split(costs, stages)
        worst = max(sum(costs[a:b]) for a, b in itertools.pairwise([*starts, len(costs)]))
        best = min(
            max(sum(costs[a:b]) for a, b in itertools.pairwise((0, *cut, len(costs))))
            for cut in itertools.combinations(range(1, len(costs)), stages - 1)
        )
        assert starts[0] == 0 and worst == best


def test_one_f_one_b_holds_fewer_microbatches_than_gpipe(small_probe):
    p = _plan(small_probe, strategies=["pipeline"], schedules=["1f1b"], microbatches=[8])
    q = _plan(small_probe, strategies=["pipeline"], schedules=["gpipe"], microbatches=[8])
    one, gpipe = p.estimates[0], q.estimates[0]
    assert one.options["microbatches"] == gpipe.options["microbatches"] == 8
    assert one.memory.model_state == gpipe.memory.model_state
    assert one.memory.activations < gpipe.memory.activations / 2  # 2 of 8 microbatches held at the first stage


def test_the_split_with_a_memory_check_is_the_best_of_the_splits_that_fit():
    """One split rule for the planner and the runtime: with ``fits`` it is the best contiguous split among those whose
    every stage fits, None when none does; the runtime's choose_split gives the same points."""
    from fastpar.shard.pipeline_profile import LayerCost
    from fastpar.shard.pipeline_split import choose_split

    costs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    size = [5, 1, 1, 1, 1, 1, 1, 9]

    def fits(_stage, lo, hi):
        return sum(size[lo:hi]) <= 10

    for stages in (2, 3, 4):
        starts = balanced_split(costs, stages, fits)
        cuts = [
            cut
            for cut in itertools.combinations(range(1, len(costs)), stages - 1)
            if all(fits(k, a, b) for k, (a, b) in enumerate(itertools.pairwise((0, *cut, len(costs)))))
        ]
        worst = max(sum(costs[a:b]) for a, b in itertools.pairwise([*starts, len(costs)]))
        assert worst == min(max(sum(costs[a:b]) for a, b in itertools.pairwise((0, *c, len(costs)))) for c in cuts)
        layers = [LayerCost(f"l{i}", c, 0, 0, (1,), torch.float32) for i, c in enumerate(costs)]
        runtime = choose_split(layers, stages=stages, microbatches=stages, schedule="1f1b")
        assert list(runtime.points) == balanced_split(costs, stages)[1:]
    assert balanced_split(costs, 2, lambda *_: False) is None


def test_interleaved_one_f_one_b_is_priced_per_rank_over_its_stages(small_probe):
    """The planner prices interleaved 1F1B (two stages per rank, torch's placement): each rank holds the layers of its
    two stages, and the split has S x 2 - 1 points."""
    spec = dict(layers=6, hidden=64, vocab=500, seq_len=32)
    result = probe(ModelSpec.transformer(**spec), batch_size=2, seq_len=32)
    args = dict(devices=2, device_memory="1GB", batch_size=4, seq_len=32, probe_result=result, strategies=["pipeline"])
    inter = plan(ModelSpec.transformer(**spec), schedules=["interleaved-1f1b"], microbatches=[4], **args)
    one = plan(ModelSpec.transformer(**spec), schedules=["1f1b"], microbatches=[4], **args)
    e, f = inter.estimates[0], one.estimates[0]
    assert e.options["schedule"] == "interleaved-1f1b" and e.options["virtual_stages"] == 2
    assert len(e.options["split"]) == 3 and e.label == "pipeline 2x2 il m4"
    numel = [layer.numel for layer in ModelSpec.transformer(**spec).layers()]
    bounds = [0, *e.options["split"], len(numel)]
    stage_numel = [sum(numel[a:b]) for a, b in itertools.pairwise(bounds)]
    per_rank = [sum(n for k, n in enumerate(stage_numel) if k % 2 == r) for r in range(2)]
    for r, bounds_r in enumerate(per_rank):
        assert bounds_r > 0, f"rank {r} holds no layer"
    assert e.memory.parameters == max(per_rank) * 4  # fp32, the larger rank
    assert f.memory.parameters == max(sum(numel[: f.options["split"][0]]), sum(numel[f.options["split"][0] :])) * 4


def test_the_choice_is_the_fastest_that_fits(small_probe):
    p = _plan(small_probe)
    assert {e.strategy for e in p.estimates} == set(STRATEGIES)
    fitting = [e for e in p.estimates if e.fits]
    fastest = min(e.step_s for e in fitting)
    chosen = next(e for e in fitting if (e.strategy, e.options) == (p.choice, p.choice_options))
    assert chosen.step_s <= fastest * 1.03  # a tie within 3% goes to the simpler strategy
    assert all(
        STRATEGIES.index(e.strategy) >= STRATEGIES.index(p.choice) for e in fitting if e.step_s <= fastest * 1.03
    )
    ddp_total = p.best("ddp").memory.total
    smaller = _plan(small_probe, device_memory=int(ddp_total / 0.9) - 1)
    plain_ddp = next(e for e in smaller.estimates if e.strategy == "ddp" and not e.options)
    assert not plain_ddp.fits and (smaller.choice, smaller.choice_options) != ("ddp", {})
    assert all(e.memory.total <= smaller.usable_memory for e in smaller.estimates if e.fits)


def test_when_nothing_fits_the_plan_says_what_would(small_probe):
    p = _plan(small_probe, device_memory="2MB", batch_size=8)
    assert p.choice is None and p.choice_options == {}
    assert "nothing fits" in p.table() and p.suggestions, p.advice
    asked = dict(device_memory="2MB", batch_size=8)
    for change, value in p.suggestions.items():  # each suggestion, tried alone, fits
        assert _plan(small_probe, **{**asked, change: value}).choice is not None, (change, value)
    if "devices" in p.suggestions:  # and it is the least such change
        assert _plan(small_probe, **{**asked, "devices": p.suggestions["devices"] // 2}).choice is None


def test_plan_for_module_measures_the_given_batch_and_leaves_the_random_streams(small_probe):
    torch.manual_seed(0)
    model = ReferenceTransformer(**SMALL)
    batch = model.example_batch(3)
    before = torch.get_rng_state()
    p = plan_for_module(model, batch, loss=ReferenceTransformer.loss, devices=2, device_memory="1GB")
    assert torch.equal(torch.get_rng_state(), before)
    assert p.batch_size == 3 and p.choice in STRATEGIES
    assert all(param.grad is None for param in model.parameters())
    reference = _plan(small_probe, batch_size=3).best("ddp").memory
    assert p.best("ddp").memory.model_state == reference.model_state


@pytest.mark.parametrize(
    "text,value", [("80GB", 80 * 10**9), ("80GiB", 80 << 30), ("512MiB", 512 << 20), ("1.5G", 3 << 29), ("4096", 4096)]
)
def test_memory_sizes(text, value):
    assert parse_bytes(text) == value


def test_fastpar_plan_prints_the_table_and_json(capsys):
    from fastpar import cli

    argv = ["plan", "--transformer", "layers=2,hidden=32,vocab=100", "--seq-len", "16", "--devices", "2"]
    assert cli.main([*argv, "--device-memory", "1GB"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[2].split()[:3] == ["strategy", "params", "grads"] and "pick:" in out
    assert cli.main([*argv, "--device-memory", "1GB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["choice"] in STRATEGIES and len(data["estimates"]) >= 5


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--model", "no_such_package.mod:build"], "cannot import 'no_such_package.mod'"),
        (["--model", "torch.nn:NoSuchLayer"], "has no 'NoSuchLayer'"),
        (["--transformer", "layers=2,hidden=32"], "needs vocab"),
        (["--transformer", "layers=2,hidden=32,vocab=10", "--device-memory", "lots"], "cannot read 'lots'"),
        (["--transformer", "layers=2,hidden=32,vocab=10", "--stages", "3"], "must divide the 2 devices"),
    ],
)
def test_fastpar_plan_bad_input_is_one_line(capsys, extra, message):
    from fastpar import cli

    argv = ["plan", "--devices", "2", *extra]
    if "--device-memory" not in extra:
        argv += ["--device-memory", "1GB"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_a_model_path_that_is_not_a_module_is_refused():
    with pytest.raises(UserError, match="not 'package.module:function'"):
        ModelSpec.from_path("torch.nn.Linear")


def test_cpu_collectives_without_a_calibrated_profile_use_the_stated_loopback_fabric(monkeypatch):
    from fastpar.costmodel import planner_comm

    monkeypatch.setattr(planner_comm, "_shipped_profile", lambda backend: None)
    comm, costs, text = planner_comm.comm_model(on_gpu=False)
    shipped = planner_comm.Profile.load(
        planner_comm.Path(__file__).resolve().parents[2] / "bench" / "results" / "profile-cpu-2rank-mlp.json"
    )
    assert "assumed" in text and costs.compute_slowdown == 0.0
    for nbytes in (1 << 16, 1 << 20, 1 << 24):  # the fallback is the shipped profile's fit, to within 20%
        assert comm("allreduce", nbytes, 2) == pytest.approx(shipped.comm(2, "allreduce")(nbytes), rel=0.2)


def test_cpu_ranks_are_priced_with_the_profile_of_their_backend():
    from fastpar.costmodel import planner_comm

    gloo, _, gloo_text = planner_comm.comm_model(on_gpu=False)
    shm, _, shm_text = planner_comm.comm_model(on_gpu=False, backend="fastpar")
    assert "profile gloo x2" in gloo_text and "profile fastpar x2" in shm_text
    for nbytes in (1 << 20, 1 << 24):  # shared memory beats loopback TCP
        assert shm("allreduce", nbytes, 2) < gloo("allreduce", nbytes, 2)
    with pytest.raises(UserError, match="backend must be one of gloo, fastpar, got 'mpi'"):
        planner_comm.comm_model(on_gpu=False, backend="mpi")


# four 4 MiB blocks, 1 and 2 ms of forward and backward each: what the pricing tests below price
BLOCKS = [Layer(f"b{i}", 1 << 20, True, ((1024, 1024),)) for i in range(4)]


def _priced(strategy, comm, costs, *, on_gpu=False, options=None) -> float:
    """The planner's step seconds of ``strategy`` over :data:`BLOCKS` at 2 ranks, fp32, no optimizer time."""
    from fastpar.costmodel.strategy_time import strategy_step_seconds

    return strategy_step_seconds(
        strategy,
        BLOCKS,
        [0.001] * 4,
        [0.002] * 4,
        devices=2,
        comm=comm,
        costs=costs,
        optimizer_s_per_element=0.0,
        reduce_itemsize=4,
        param_itemsize=4,
        caps=(1 << 20, 25 << 20),
        on_gpu=on_gpu,
        options=options or {},
    )


def test_each_fsdp_unit_costs_the_profiles_fixed_time_on_cpu_ranks():
    """A unit's fixed cost (FSDP2's hooks and its collectives' latency among busy ranks, measured with small
    units by calibrate) is added per unit, less what the tables already price for a unit that small; the
    shipped profiles carry it; GPUs and DDP are priced as before."""
    from fastpar.costmodel import planner_comm

    comm, costs, _ = planner_comm.comm_model(on_gpu=False, backend="gloo")
    assert costs.fsdp_unit_s > 0 and costs.fsdp_unit_bytes > 0  # bench/results/profile-cpu-2rank-mlp.json

    def step(strategy, sync, on_gpu=False, reshard=False):
        options = {"reshard_after_forward": reshard, "point_to_point": True}  # gloo: fastpar's exchanges
        return _priced(strategy, comm, sync, on_gpu=on_gpu, options=options)

    none = replace(costs, fsdp_unit_s=0.0, fsdp_regather_s=0.0)
    small = int(costs.fsdp_unit_bytes) // 4
    one_way = comm("allreduce", small * 4, 2) / 2 + small * 4 * 1.5 * costs.pack_s_per_byte  # wire + copies
    fixed = costs.fsdp_unit_s - 2 * one_way
    assert fixed > 0.001  # gloo among busy ranks: milliseconds per unit beyond the tables
    assert step("fsdp", costs) - step("fsdp", none) == pytest.approx(4 * fixed)
    regather = max(0.0, costs.fsdp_regather_s - one_way)
    assert step("fsdp", costs, reshard=True) - step("fsdp", none, reshard=True) == pytest.approx(4 * (fixed + regather))
    assert step("fsdp", costs, on_gpu=True) == step("fsdp", none, on_gpu=True)
    assert step("ddp", costs) == step("ddp", none)


def test_a_pipeline_slot_costs_the_profiles_fixed_time_and_microbatches_accumulate():
    """Per slot of the schedule the profile's fixed time (less the table's price of its two small messages), and
    each microbatch after the first adds the stage's gradients at the copy bandwidth."""
    from fastpar.costmodel import planner_comm

    comm, costs, _ = planner_comm.comm_model(on_gpu=False, backend="gloo")
    assert costs.pipeline_slot_s > 0 and costs.pipeline_message_bytes > 0  # the shipped profile's
    options = dict(stage_layers=[[0, 1], [2, 3]], stages=2, microbatches=4, stage_batch_scale=0.5, boundary_bytes=4096)

    def step(sync, on_gpu=False):
        return _priced("pipeline", comm, sync, on_gpu=on_gpu, options=options)

    bare = replace(costs, pipeline_slot_s=0.0, pack_s_per_byte=0.0)
    slots = 4 + 2 - 1
    fixed = costs.pipeline_slot_s - 2 * comm("p2p", costs.pipeline_message_bytes, 2)
    accumulate = 3 * (2 << 20) * 4 * costs.pack_s_per_byte  # 3 microbatches add 2 layers' gradients
    assert step(costs) - step(bare) == pytest.approx(slots * max(0.0, fixed) + accumulate)
    assert step(costs, on_gpu=True) - step(bare, on_gpu=True) == pytest.approx(accumulate)


def test_zero2_is_priced_with_the_copy_of_each_gradient_into_its_staging():
    """ZeRO-1's gradients are bucket views; ZeRO-2 copies each into its staging buffer in its hook: at least the
    gradient bytes at the profile's copy bandwidth more, nothing more without a copy cost."""
    from fastpar.costmodel import planner_comm
    from fastpar.costmodel.bucket_optimizer import size_capped_buckets
    from fastpar.costmodel.strategy_time import _timeline

    comm, costs, _ = planner_comm.comm_model(on_gpu=False, backend="fastpar")
    copy = 4 * (1 << 20) * 4 * costs.pack_s_per_byte
    free = replace(costs, pack_s_per_byte=0.0)
    assert _priced("zero2", comm, costs) - _priced("zero2", comm, free) >= copy * 0.999 > 0
    assert _priced("zero1", comm, costs) == _priced("zero1", comm, free)
    # each bucket costs the profile's fixed time beyond its two exchanges' table price
    assert costs.zero_bucket_s > 0 and costs.zero_bucket_bytes > 0
    extra = replace(free, zero_bucket_s=free.zero_bucket_s + 0.01)
    buckets = len(size_capped_buckets(_timeline(BLOCKS, [0.002] * 4, 4).grads, [1 << 20, 25 << 20]))
    assert _priced("zero1", comm, extra) - _priced("zero1", comm, free) == pytest.approx(buckets * 0.01)
    # ZeRO-2 reduces in the runs that fit its staging buffers (zero_staging.py): here min(2 x cap, G / 4) over
    # 3 buffers and their scratch is 0.9 MiB, so each 4 MiB gradient is a run of its own, 4 in all
    assert buckets < 4
    assert _priced("zero2", comm, extra) - _priced("zero2", comm, free) == pytest.approx(4 * 0.01)


def test_the_probe_times_the_optimizer_in_the_models_loop_and_leaves_the_model_as_it_was():
    """On CPU ranks the probe times forward, backward and the optimizer's step in a forked child (its allocator set
    as a warmed-up rank's): the plan uses that step, and the caller's parameters, gradients and random streams are
    untouched."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(3)))
    before = [p.detach().clone() for p in model.parameters()]
    spec = ModelSpec.from_module(model, torch.randn(8, 64), loss=lambda out, _batch: out.square().mean())
    rng = torch.get_rng_state()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = probe(spec, batch_size=8, seq_len=None, alongside=1, optimizer="adamw")
        alone = probe(spec, batch_size=8, seq_len=None, alongside=0)
    finally:
        torch.set_num_threads(threads)
    assert result.optimizer == "adamw" and 0 < result.optimizer_s_per_element < 1e-6
    assert alone.optimizer is None and alone.optimizer_s_per_element is None
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    p = plan_for_module(
        model,
        torch.randn(8, 64),
        loss=lambda out, _b: out.square().mean(),
        devices=2,
        device_memory="1GB",
        optimizer="adamw",
    )
    assert p.probe.optimizer == "adamw"
    assert all(torch.equal(q, b) for q, b in zip(model.parameters(), before, strict=True))


ENCODER_LAYER = ["--model", "torch.nn:TransformerEncoderLayer", "--kwargs"]
ENCODER_KWARGS = '{"d_model": 32, "nhead": 2, "dim_feedforward": 64, "batch_first": true}'


def test_fastpar_plan_runs_any_module_given_its_input_shape():
    """A module without an example_batch method (torchvision's models, torch.nn's layers) is planned from one
    sample's shape and dtype; the command runs in a fresh process and says nothing about the backend."""
    argv = [*ENCODER_LAYER, ENCODER_KWARGS, "--input-shape", "5,32", "--input-dtype", "float32"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "fastpar", "plan", *argv, "--devices", "2", "--device-memory", "1GB"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "pick: " in done.stdout and "batch 8/device" in done.stdout, done.stdout
    assert done.stderr == "", done.stderr  # no "could not register the 'fastpar' torch.distributed backend"


def test_an_input_shape_the_module_refuses_is_one_line(capsys):
    from fastpar import cli

    argv = ["plan", *ENCODER_LAYER, ENCODER_KWARGS, "--input-shape", "5,31", "--devices", "2", "--device-memory", "1GB"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "refused an input of shape (batch, 5, 31)" in err, err
    assert "--input-shape" in err


def test_integer_inputs_are_valid_indices():
    spec = ModelSpec.from_path(
        "torch.nn:Embedding", {"num_embeddings": 7, "embedding_dim": 4}, input_shape=(3,), input_dtype="int64"
    )
    module = spec.build("cpu")
    batch = spec.batch(module, 2, None, "cpu")
    assert batch.shape == (2, 3) and batch.dtype == torch.int64
    assert module(batch).shape == (2, 3, 4)
    with pytest.raises(UserError, match="not a torch dtype"):
        ModelSpec.from_path("torch.nn:Embedding", input_shape=(3,), input_dtype="int65")


def test_a_budget_nothing_fits_says_so_in_words(capsys):
    from fastpar import cli

    argv = ["plan", "--transformer", "layers=2,hidden=32,vocab=100", "--seq-len", "16", "--devices", "2"]
    assert cli.main([*argv, "--device-memory", "100KB"]) == 1
    last = capsys.readouterr().out.strip().splitlines()[-2]
    assert last.startswith("nothing fits: the smallest is ") and "would fit with ;" not in last, last


def test_grouped_fsdp_units_pay_the_fixed_cost_once_per_group():
    """Spans of two blocks are two units' fixed costs fewer than four one-block spans, and the same bytes."""
    from fastpar.costmodel import planner_comm

    comm, costs, _ = planner_comm.comm_model(on_gpu=False, backend="gloo")
    one = {"reshard_after_forward": False, "point_to_point": True, "unit_spans": [(i, i) for i in range(4)]}
    two = {"reshard_after_forward": False, "point_to_point": True, "unit_spans": [(0, 1), (2, 3)]}
    none = replace(costs, fsdp_unit_s=0.0, fsdp_regather_s=0.0)
    saved = _priced("fsdp", comm, costs, options=one) - _priced("fsdp", comm, costs, options=two)
    saved_without_fixed = _priced("fsdp", comm, none, options=one) - _priced("fsdp", comm, none, options=two)
    small = int(costs.fsdp_unit_bytes) // 4
    one_way = comm("allreduce", small * 4, 2) / 2 + small * 4 * 1.5 * costs.pack_s_per_byte  # wire + copies
    assert costs.fsdp_unit_s - 2 * one_way > 0.001
    assert saved - saved_without_fixed == pytest.approx(2 * (costs.fsdp_unit_s - 2 * one_way))


def _stack(width: int, depth: int = 8) -> torch.nn.Module:
    from torch import nn

    return nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)))


def _stack_plan(width: int, **kwargs):
    return plan_for_module(
        _stack(width),
        torch.zeros(4, width),
        loss=lambda out, *_: out.square().mean(),
        devices=2,
        device_memory="8GB",
        backend="gloo",
        strategies=("ddp", "fsdp"),
        activation_checkpointing=False,
        **kwargs,
    )


def test_the_plan_groups_small_blocks_into_units_within_the_cpu_cap():
    """On CPU ranks the planner prices groupings of blocks (each unit costs milliseconds on gloo) and keeps one
    per resharding choice, the fastest; a unit never exceeds CPU_UNIT_BYTES; fsdp_blocks_per_unit=1 prices one
    block a unit, and blocks of 21 MiB are not grouped (two would pass the cap)."""
    from fastpar.costmodel.fsdp_units import CPU_UNIT_BYTES

    grouped = _stack_plan(256)
    fsdp = [e for e in grouped.estimates if e.strategy == "fsdp"]
    assert sorted(e.options["reshard_after_forward"] for e in fsdp) == [False, True]  # one grouping each
    keep = next(e for e in fsdp if not e.options["reshard_after_forward"])
    assert keep.options.get("blocks_per_unit", 1) > 1, grouped.table()  # 8 units of 0.25 MiB: fixed costs win
    assert keep.label == f"fsdp keep x{keep.options['blocks_per_unit']}"
    assert keep.options["blocks_per_unit"] * (256 * 257 * 4) <= CPU_UNIT_BYTES

    single = _stack_plan(256, fsdp_blocks_per_unit=1)
    assert all("blocks_per_unit" not in e.options for e in single.estimates)
    by_mode = {e.options["reshard_after_forward"]: e for e in single.estimates if e.strategy == "fsdp"}
    assert keep.step_s < by_mode[False].step_s  # grouping is what made it faster
    assert keep.memory.buffers > by_mode[False].memory.buffers  # and a group's gradients are held unsharded

    large = _stack_plan(2304, fsdp_blocks_per_unit=None)
    assert all("blocks_per_unit" not in e.options for e in large.estimates if e.strategy == "fsdp")
    with pytest.raises(UserError, match="fsdp_blocks_per_unit"):
        _stack_plan(64, fsdp_blocks_per_unit=0)


def test_planning_for_gpus_keeps_one_block_a_unit():
    p = plan(
        ModelSpec.from_module(_stack(256), torch.zeros(4, 256), loss=lambda out, *_: out.square().mean()),
        devices=2,
        device_memory="8GB",
        batch_size=4,
        probe_batch=4,
        device="cuda",
        strategies=("fsdp",),
        activation_checkpointing=False,
    )
    assert [e.options for e in p.estimates] == [{"reshard_after_forward": True}, {"reshard_after_forward": False}]
