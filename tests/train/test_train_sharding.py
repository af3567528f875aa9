"""``TrainingOptions(sharding=...)``: every strategy resumes exactly from a mid-run checkpoint (parameters and
loss curve equal to the run that was never stopped), sharded checkpoints written at 2 processes load at 3 and
the other way round, the consolidated export loads into the plain model, and a checkpoint of another model or
a contradictory option is refused before the first step.

Runs are small (192 samples, 2 epochs) and shared through module-scoped fixtures: each Trainer launch starts
worker processes, so every test here but the option checks is marked slow.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from test_train import CLASSES, assert_same_parameters, blobs

from fastpar.shard import checkpoint as sharded
from fastpar.train import Trainer, TrainingOptions
from fastpar.train import checkpoint as ckpt
from fastpar.train.options import parse_bytes
from fastpar.train.resume import single_file_state
from fastpar.user_errors import OptionError

ROOT = Path(__file__).resolve().parents[2]

DATA = blobs(192, seed=3)  # 2 ranks x 16: 6 steps per epoch; 3 ranks: 4
VALIDATION = blobs(100, seed=4)
BATCH = 16


def make_blocks(hidden: tuple[int, int] = (32, 32)) -> torch.nn.Sequential:
    """Four linear layers in a Sequential: units for FSDP2, layers to split into pipeline stages."""
    a, b = hidden
    return torch.nn.Sequential(
        torch.nn.Linear(8, a),
        torch.nn.ReLU(),
        torch.nn.Linear(a, b),
        torch.nn.ReLU(),
        torch.nn.Linear(b, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, CLASSES),
    )


def make_wider() -> torch.nn.Sequential:
    """Another hidden size: a checkpoint of make_blocks' model must be refused for it."""
    return make_blocks((48, 32))


def make_adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.05)


def fit(tmp: Path, devices: int = 2, model=make_blocks, **overrides):
    base = dict(
        max_epochs=2,
        batch_size=BATCH,
        execution_environment="cpu",
        devices=devices,
        cpu_backend="gloo",
        log_every=1,
        output_dir=str(tmp / "out"),
        progress_bar=False,
        grad_clip_norm=0.5,
    )
    options = TrainingOptions(**{**base, **overrides})
    return Trainer(model, make_adamw, torch.nn.functional.cross_entropy, DATA, options=options).fit()


def losses(result, after: int = 0) -> list[float]:
    return [r["loss"] for r in result.history if r["iteration"] > after]


def copy_checkpoint(source: Path, step: int, into: Path) -> Path:
    """``into/ckpt-<step>`` (folder or file) copied from ``source``: a checkpoint dir holding only that step."""
    into.mkdir(parents=True)
    for path in ckpt.list_checkpoints(source):
        if path.name.startswith(f"ckpt-{step:09d}"):
            (shutil.copytree if path.is_dir() else shutil.copy2)(path, into / path.name)
            return into / path.name
    raise AssertionError(f"no checkpoint of step {step} in {source}: {ckpt.list_checkpoints(source)}")


# --- options -----------------------------------------------------------------------------------------
def test_bad_sharding_options_are_refused_naming_the_option():
    cases = [
        (dict(sharding="zero3"), "sharding"),
        (dict(sharding="fsdp", shard_optimizer=True), "shard_optimizer"),
        (dict(sharding="zero2", ddp="torch"), "ddp"),
        (dict(sharding="ddp", pipeline_stages=2), "pipeline_stages"),
        (dict(sharding="zero1", fsdp_wrap="blocks"), "fsdp_wrap"),
        (dict(sharding="fsdp", fsdp_wrap="layers"), "fsdp_wrap"),
        (dict(sharding="fsdp", fsdp_blocks_per_unit=0), "fsdp_blocks_per_unit"),
        (dict(sharding="zero1", fsdp_blocks_per_unit=2), "fsdp_blocks_per_unit"),
        (dict(sharding="pipeline", pipeline_schedule="zigzag"), "pipeline_schedule"),
        (dict(sharding="pipeline", grad_accum_steps=2), "grad_accum_steps"),
        (dict(sharding="pipeline", microbatches=0), "microbatches"),
        (dict(sharding="pipeline", batch_size=32, microbatches=5), "microbatches"),
        (dict(sharding="pipeline", validation_data=DATA), "validation_data"),
        (dict(memory_budget="8 parsecs"), "memory_budget"),
        (dict(memory_budget=-1), "memory_budget"),
    ]
    for kwargs, option in cases:
        with pytest.raises(OptionError, match=option) as caught:
            TrainingOptions(**kwargs)
        assert caught.value.option == option, kwargs


def test_shard_optimizer_is_zero1_and_sizes_parse():
    assert TrainingOptions(shard_optimizer=True).strategy == "zero1"
    assert TrainingOptions(shard_optimizer=True, sharding="zero1").strategy == "zero1"
    assert TrainingOptions().strategy == "ddp"
    assert parse_bytes("8GB") == 8 * 10**9 and parse_bytes("1.5 GiB") == 3 * 2**29 and parse_bytes(4096) == 4096
    assert TrainingOptions(sharding="auto", memory_budget="512MiB").memory_budget_bytes == 512 * 2**20


# --- the fast smoke test: one launch ------------------------------------------------------------------------
def test_zero1_run_writes_a_sharded_checkpoint_that_exports_the_trained_model(tmp_path):
    result = fit(tmp_path, sharding="zero1", max_epochs=1, checkpoint_dir=str(tmp_path / "ck"))
    folder = tmp_path / "ck" / "ckpt-000000006"
    assert result.checkpoints == [str(folder)] and (folder / ".metadata").is_file()
    record = sharded.read_trainer_record(folder)
    assert (record["sharding"], record["world_size"], record["step"], len(record["ranks"])) == ("zero1", 2, 6, 2)
    model = make_blocks()
    model.load_state_dict(torch.load(sharded.export_consolidated(folder, tmp_path / "model.pt"), weights_only=True))
    assert_same_parameters(model, result.model)
    flat = sharded.consolidated_state(folder)["optim"]["state"]["2.weight"]["exp_avg"]
    assert flat.shape == (32 * 32,)  # ZeRO's optimizer state: flat, in the parameter's memory order


# --- exact resume, every strategy --------------------------------------------------------------------
STRATEGIES = ["ddp", "zero1", "zero2", "fsdp", "pipeline"]


@pytest.fixture(scope="module", params=STRATEGIES)
def straight_run(request, tmp_path_factory):
    """2 epochs without a stop, writing a checkpoint every 4 (mid-epoch: step 4 of 6), validating at each epoch's
    end (not in a pipeline: no process holds the whole model)."""
    tmp = tmp_path_factory.mktemp(request.param)
    validation = VALIDATION if request.param != "pipeline" else None
    result = fit(
        tmp,
        sharding=request.param,
        checkpoint_dir=str(tmp / "ck"),
        checkpoint_every=4,
        keep_checkpoints=9,
        validation_data=validation,
    )
    return request.param, result, tmp


@pytest.mark.slow
def test_resume_is_exact_for_every_strategy(straight_run, tmp_path):
    strategy, straight, tmp = straight_run
    assert straight.steps == (24 if strategy == "pipeline" else 12)  # 2 stages: one data-parallel replica
    saved = copy_checkpoint(tmp / "ck", 4, tmp_path / "ck")
    assert saved.is_dir() == (strategy != "ddp")  # sharded strategies write DCP folders
    validation = VALIDATION if strategy != "pipeline" else None
    resumed = fit(
        tmp_path, sharding=strategy, checkpoint_dir=str(tmp_path / "ck"), resume=True, validation_data=validation
    )
    assert resumed.start_step == 4 and resumed.steps == straight.steps
    if validation is not None:
        assert resumed.last("val_loss") == straight.last("val_loss") and 0 < straight.last("val_accuracy") <= 1
    assert_same_parameters(resumed.model, straight.model)
    assert losses(resumed, 4) == losses(straight, 4)


@pytest.mark.slow
def test_consolidated_export_loads_into_the_plain_model(straight_run, tmp_path):
    strategy, straight, tmp = straight_run
    if strategy == "ddp":
        pytest.skip("ddp writes single files, already plain state dicts")
    newest = ckpt.list_checkpoints(tmp / "ck")[-1]
    out = sharded.export_consolidated(newest, tmp_path / "model.pt")
    model = make_blocks()
    model.load_state_dict(torch.load(out, weights_only=True))
    assert_same_parameters(model, straight.model)  # the final checkpoint is the end of the run
    x = DATA[0][:32]
    assert torch.equal(model(x), straight.model(x))


# --- resharding: written at N processes, loaded at M ---------------------------------------------------
@pytest.fixture(scope="module")
def two_and_three_rank_runs(tmp_path_factory):
    """For each sharded strategy, checkpoints at the first epoch's end written by 2 and by 3 processes."""
    runs = {}
    for strategy in ("zero1", "zero2", "fsdp"):
        for devices, epoch_end in ((2, 6), (3, 4)):
            tmp = tmp_path_factory.mktemp(f"{strategy}-{devices}")
            fit(tmp, devices, sharding=strategy, max_epochs=1, checkpoint_dir=str(tmp / "ck"))
            runs[strategy, devices] = tmp / "ck" / f"ckpt-{epoch_end:09d}"
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "fsdp"])
@pytest.mark.parametrize(("written", "loaded"), [(2, 3), (3, 2)])
def test_checkpoint_reshards_to_another_world_size(two_and_three_rank_runs, strategy, written, loaded, tmp_path):
    """A run at M processes resumed from an N-process checkpoint continues as an M-process run, so it can't be
    compared with the N-process run that went on (the global batch differs). It is compared with an M-process
    run resumed from the same state consolidated into one file (the whole model and optimizer state, loaded
    through the unsharded path and cut by each rank for itself): equal parameters and loss curve show that
    DCP's resharding put every element of the weights and the optimizer state where the whole state puts it."""
    folder = two_and_three_rank_runs[strategy, written]
    step = int(folder.name[5:])
    copy_checkpoint(folder.parent, step, tmp_path / "dcp")
    through_dcp = fit(tmp_path / "a", loaded, sharding=strategy, checkpoint_dir=str(tmp_path / "dcp"), resume=True)
    (tmp_path / "file").mkdir()
    ckpt.save_atomic(single_file_state(folder), ckpt.checkpoint_path(tmp_path / "file", step))
    through_file = fit(tmp_path / "b", loaded, sharding=strategy, checkpoint_dir=str(tmp_path / "file"), resume=True)
    assert through_dcp.start_step == through_file.start_step == step
    assert through_dcp.steps == through_file.steps > step
    assert_same_parameters(through_dcp.model, through_file.model)
    assert losses(through_dcp, step) == losses(through_file, step)


@pytest.mark.slow
def test_zero1_checkpoint_resumes_as_zero2(two_and_three_rank_runs, tmp_path):
    """ZeRO-1 and ZeRO-2 keep the same optimizer slices: a ZeRO-1 checkpoint resumes a ZeRO-2 run (at 3 processes
    from 2), equal to resuming ZeRO-1 itself -- their steps are bit-identical."""
    folder = two_and_three_rank_runs["zero1", 2]
    runs = []
    for strategy in ("zero1", "zero2"):
        copy_checkpoint(folder.parent, 6, tmp_path / strategy / "ck")
        runs.append(
            fit(tmp_path / strategy, 3, sharding=strategy, checkpoint_dir=str(tmp_path / strategy / "ck"), resume=True)
        )
    assert_same_parameters(runs[0].model, runs[1].model)
    assert losses(runs[0]) == losses(runs[1])


# --- refusals ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_checkpoint_of_another_model_is_refused_before_the_first_step(two_and_three_rank_runs, tmp_path):
    folder = two_and_three_rank_runs["zero1", 2]
    copy_checkpoint(folder.parent, 6, tmp_path / "ck")
    with pytest.raises(
        sharded.IncompatibleCheckpointError,
        match=r"different model .*2\.weight: checkpoint \[32, 32\], model \[32, 48\]",
    ):
        fit(tmp_path, model=make_wider, sharding="zero1", checkpoint_dir=str(tmp_path / "ck"), resume=True)
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # refused in the launching process: nothing ran
    with pytest.raises(sharded.IncompatibleCheckpointError, match="sharding='zero1', this run uses sharding='fsdp'"):
        fit(tmp_path, sharding="fsdp", checkpoint_dir=str(tmp_path / "ck"), resume=True)


@pytest.mark.slow
def test_fsdp_blocks_grouped_into_units_train_as_one_block_a_unit(tmp_path):
    """fsdp_blocks_per_unit=2 wraps make_blocks' four Linear layers as two FSDP2 units: the same run, bit for bit,
    as one layer a unit (gloo, 2 processes: a sum of two is order-free)."""
    grouped = fit(tmp_path / "grouped", sharding="fsdp", fsdp_blocks_per_unit=2, max_epochs=1)
    single = fit(tmp_path / "single", sharding="fsdp", fsdp_blocks_per_unit=1, max_epochs=1)
    assert losses(grouped) == losses(single) and grouped.steps == single.steps == 6
    assert_same_parameters(grouped.model, single.model)


# --- sharding="auto" and memory_budget -------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gloo", "fastpar"])
def test_auto_prints_the_plan_then_trains_with_its_choice(tmp_path, capfd, backend):
    result = fit(tmp_path, sharding="auto", memory_budget="2GB", max_epochs=1, cpu_backend=backend)
    out = capfd.readouterr().out
    assert "fastpar: memory plan" in out and "strategy" in out and "fastpar: sharding='auto' chose" in out
    assert f"communication: profile {backend} x2" in out  # priced with what was measured on this backend
    chosen = out.split("sharding='auto' chose '")[1].split("'")[0]
    assert chosen in ("ddp", "zero1", "zero2", "fsdp", "pipeline")
    assert result.steps == (12 if chosen == "pipeline" else 6)


@pytest.mark.slow
def test_a_strategy_that_cannot_fit_the_budget_is_refused_before_the_first_step(tmp_path):
    # one OptionError in the launching process, not each worker's traceback
    with pytest.raises(
        OptionError, match=r"sharding='ddp' needs .* per process, more than the .* usable of memory_budget"
    ):
        fit(tmp_path, sharding="ddp", memory_budget="8KB")  # the model state alone is ~40 KB
    with pytest.raises(OptionError, match="no sharding strategy fits"):
        fit(tmp_path, sharding="auto", memory_budget="1KB")
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


class WithUnusedLayer(torch.nn.Module):
    """``unused`` never gets a gradient: ZeRO keeps per-parameter ``step`` counts inside a slice, and the
    parameter has no optimizer state at all, as in a plain optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.unused, self.last = torch.nn.Linear(8, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.relu(self.first(x)))


@pytest.mark.slow
def test_zero_checkpoint_of_a_parameter_never_stepped_resumes_exactly_and_reshards(tmp_path):
    common = dict(model=WithUnusedLayer, sharding="zero1", find_unused_parameters=True)
    straight = fit(tmp_path / "a", **common, checkpoint_dir=str(tmp_path / "a" / "ck"), checkpoint_every=4)
    folder = copy_checkpoint(tmp_path / "a" / "ck", 8, tmp_path / "b" / "ck")
    saved = sharded.consolidated_state(folder)["optim"]["state"]
    assert "unused.weight" not in saved and "first.weight" in saved  # never stepped: no state
    resumed = fit(tmp_path / "b", **common, checkpoint_dir=str(tmp_path / "b" / "ck"), resume=True)
    assert_same_parameters(resumed.model, straight.model)
    assert losses(resumed, 8) == losses(straight, 8)
    (tmp_path / "c" / "ck").mkdir(parents=True)
    ckpt.save_atomic(single_file_state(folder), ckpt.checkpoint_path(tmp_path / "c" / "ck", 8))
    copy_checkpoint(tmp_path / "a" / "ck", 8, tmp_path / "d" / "ck")
    runs = [  # at 3 processes: d reshards the folder, c loads the same state whole
        fit(tmp_path / d, 3, **common, checkpoint_dir=str(tmp_path / d / "ck"), resume=True) for d in ("d", "c")
    ]
    assert_same_parameters(runs[0].model, runs[1].model)


@pytest.mark.slow
def test_pipeline_checkpoint_resumes_with_another_split_exactly(tmp_path):
    """Stages keep the model's own parameter names, so 3 stages on 3 processes load what 2 stages on 2 wrote.
    Both pipelines are one replica reading the same batches in the same micro-batches, and a pipeline's
    gradients are those of the micro-batches accumulated in one process whatever the split: the resumed run is
    bit-identical to the 2-stage run that went on. (No clipping here: the global norm sums the stages' squares,
    in an order that depends on the split.)"""
    common = dict(sharding="pipeline", microbatches=4, grad_clip_norm=None)
    straight = fit(tmp_path / "a", 2, **common, checkpoint_dir=str(tmp_path / "a" / "ck"))  # at each epoch's end
    copy_checkpoint(tmp_path / "a" / "ck", 12, tmp_path / "b" / "ck")
    resumed = fit(
        tmp_path / "b", 3, **common, pipeline_stages=3, checkpoint_dir=str(tmp_path / "b" / "ck"), resume=True
    )
    assert resumed.start_step == 12 and resumed.steps == straight.steps == 24
    assert_same_parameters(resumed.model, straight.model)
    assert losses(resumed, 12) == losses(straight, 12)


def _fsdp_wrap_comment() -> str:
    """The comment at TrainingOptions.fsdp_wrap in options.py: from "fsdp units:" to its last comment line."""
    source = (ROOT / "fastpar" / "train" / "options.py").read_text()
    first, *rest = source[source.index("fsdp units:") + len("fsdp units:") :].splitlines()
    lines = [first]
    for line in rest:
        if not line.strip().startswith("#"):
            break
        lines.append(line.strip().lstrip("#"))
    return " ".join(lines)


def _a_value_for(alternative: str):
    """An fsdp_wrap value for one listed alternative: the word itself, or an example of a described kind."""
    words = re.sub(r"\(.*\)", "", alternative).replace("`", "").split()
    if len(words) == 1:  # a value: "auto", or a bare word
        return words[0].strip("\"'")
    if "parameter count" in alternative:
        return 1000
    if "class names" in alternative:
        return ("Linear",)
    raise AssertionError(f"fsdp_wrap: cannot tell what {alternative!r} stands for")


def test_the_fsdp_wrap_values_the_comment_and_the_reference_list_are_accepted():
    """What TrainingOptions.fsdp_wrap's comment and the options reference list is what validation accepts."""
    reference = (ROOT / "docs" / "reference" / "train.md").read_text().splitlines()
    # the sharding options' table (the last row naming it; "Every option" above it says it in words)
    cell = [line for line in reference if line.startswith("| `fsdp_wrap`")][-1].split("|")[3]
    listed = {
        "options.py": _fsdp_wrap_comment().split("|"),
        "docs/reference/train.md": re.split(r",(?: or)? | or ", cell),
    }
    for where, alternatives in listed.items():
        assert len(alternatives) >= 4, (where, alternatives)
        for alternative in alternatives:
            value = _a_value_for(alternative)
            assert TrainingOptions(sharding="fsdp", fsdp_wrap=value).fsdp_wrap == value, (where, alternative)
