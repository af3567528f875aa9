"""The Trainer on any batch and any loss (fastpar/train/batches.py): dict, tuple and list batches; a model that
returns its own loss (GPT-2 from transformers, built from a config); ``fastpar.loss_from_batch`` with extra
metrics; tokens/s. The 2-process GPT-2 run is compared bit for bit with a hand-written torch DDP loop over the
same batches, and the three loss forms with each other."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fastpar
from fastpar.launcher import spawn
from fastpar.train import Trainer, TrainingOptions
from fastpar.train.batches import Objective, batch_size_of, loss_of_outputs, to_device, token_count
from fastpar.user_errors import OptionError

VOCAB, SEQ, BATCH, STEPS = 61, 12, 4, 6


# --- module level: the workers unpickle these by reference ----------------------------------------------------
def gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0
    )
    config.attn_pdrop = 0.0
    return GPT2LMHeadModel(config)


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3)


def token_batch(rank: int, i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + i)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


class TokenBatches:
    """This rank's fixed batches of a language-model run: what a hand-written loop reads too."""

    def __init__(self, rank: int, world_size: int, count: int = STEPS) -> None:
        self.rank, self.count = rank, count

    def __len__(self) -> int:
        return self.count

    def __iter__(self):
        return (token_batch(self.rank, i) for i in range(self.count))


def val_batches(rank: int, world_size: int) -> TokenBatches:
    return TokenBatches(rank + 100, world_size, count=2)


def lm_loss_with_metrics(model, batch):
    out = model(input_ids=batch["input_ids"])
    logits = out.logits[:, :-1]
    targets = batch["labels"][:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
    top1 = (logits.argmax(-1) == targets).float().mean()
    return loss, {"next_token_accuracy": top1, "perplexity_bound": float(VOCAB)}


def options(tmp: Path, **overrides) -> TrainingOptions:
    base = dict(
        max_epochs=1,
        batch_size=BATCH,
        execution_environment="cpu",
        devices=2,
        ddp="torch",
        log_every=2,
        output_dir=str(tmp / "out"),
        progress_bar=False,
    )
    return TrainingOptions(**{**base, **overrides})


def torch_ddp_loop(rank: int, world_size: int) -> dict[str, torch.Tensor] | None:
    """nanoGPT's way: build with the Trainer's seeding, torch DDP, loss from the model, AdamW."""
    import random

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)  # TrainingOptions.seed's default: identical initial weights on every rank
    model = torch.nn.parallel.DistributedDataParallel(gpt2())
    opt = adamw(model.parameters())
    for batch in TokenBatches(rank, world_size):
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()} if rank == 0 else None


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs: max |diff| {(a[name] - b[name]).abs().max():.3g}"


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return spawn(torch_ddp_loop, 2)[0]


# --- two processes ---------------------------------------------------------------------------------------------
def test_a_model_that_returns_its_loss_on_dict_batches_matches_torch_ddp(tmp_path, reference):
    result = Trainer(gpt2, adamw, None, TokenBatches, options=options(tmp_path, validation_data=val_batches)).fit()
    assert result.steps == STEPS
    assert_same(result.model.state_dict(), reference)
    last = result.final
    assert last["tokens_per_s"] > 0 and last["samples_per_s"] > 0
    # samples and tokens of both ranks: tokens/s is samples/s times the sequence length
    assert last["tokens_per_s"] == pytest.approx(last["samples_per_s"] * SEQ)
    assert last["accuracy"] is None  # a language model: no classification accuracy
    assert result.last("val_loss") is not None and "val_accuracy" not in result.final


@pytest.mark.slow
def test_loss_from_batch_logs_its_metrics_and_validates_with_them(tmp_path):
    result = Trainer(
        gpt2,
        adamw,
        fastpar.loss_from_batch(lm_loss_with_metrics),
        TokenBatches,
        options=options(tmp_path, ddp="fastpar", sharding="zero2", validation_data=val_batches),
    ).fit()
    assert result.sharding == "zero2"
    final = result.final
    assert 0.0 <= final["next_token_accuracy"] <= 1.0
    assert final["perplexity_bound"] == pytest.approx(VOCAB)  # the mean of a constant
    assert 0.0 <= final["val_next_token_accuracy"] <= 1.0 and final["val_loss"] > 0
    assert final["loss"] < np.log(VOCAB) + 0.5  # near chance after 6 steps, not diverged


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["zero2", "fsdp"])
def test_sharded_runs_on_dict_batches_match_torch_ddp(tmp_path, reference, sharding):
    result = Trainer(gpt2, adamw, None, TokenBatches, options=options(tmp_path, ddp="fastpar", sharding=sharding)).fit()
    assert result.sharding == sharding
    if sharding == "zero2":  # the same buckets' sums, each rank stepping its slice: the same bits
        assert_same(result.model.state_dict(), reference)
    else:  # FSDP2 reduce-scatters with its own division: equal within rounding
        for name, tensor in reference.items():
            torch.testing.assert_close(result.model.state_dict()[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_the_pipeline_refuses_a_loss_it_cannot_split_before_launch(tmp_path):
    with pytest.raises(OptionError, match=r"sharding='pipeline' computes loss_fn\(outputs, targets\)"):
        Trainer(gpt2, adamw, None, TokenBatches, options=options(tmp_path, sharding="pipeline")).fit()


# --- one process: the three loss forms train alike -------------------------------------------------------------
class TwoInputNet(torch.nn.Module):
    """Two inputs, and (when given targets) its own loss."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = torch.nn.Linear(5, 16), torch.nn.Linear(3, 16), torch.nn.Linear(16, 4)

    def forward(self, left, right, labels=None):
        logits = self.head(torch.relu(self.a(left) + self.b(right)))
        if labels is None:
            return logits
        return collections.OrderedDict(loss=F.cross_entropy(logits, labels), logits=logits)


def two_input_net() -> torch.nn.Module:
    return TwoInputNet()


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


class PairData(torch.utils.data.Dataset):
    """Samples as ((left, right), label), or as dicts."""

    def __init__(self, as_dict: bool) -> None:
        g = torch.Generator().manual_seed(3)
        self.left, self.right = torch.randn(96, 5, generator=g), torch.randn(96, 3, generator=g)
        self.labels = (self.left[:, 0] + self.right[:, 0] > 0).long() + 2 * (self.left[:, 1] > 0).long()
        self.as_dict = as_dict

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        if self.as_dict:
            return {"left": self.left[i], "right": self.right[i], "labels": self.labels[i]}
        return (self.left[i], self.right[i]), self.labels[i]


def dict_loss(model, batch):
    logits = model(batch["left"], batch["right"])
    return F.cross_entropy(logits, batch["labels"]), {"mean_logit": logits.mean()}


def single(tmp: Path, loss_fn, as_dict: bool):
    opts = options(tmp, devices=1, max_epochs=2, batch_size=8, validation_data=PairData(as_dict), log_every=4)
    return Trainer(two_input_net, sgd, loss_fn, PairData(as_dict), options=opts).fit()


def test_the_three_loss_forms_train_to_the_same_bits(tmp_path):
    pairs = single(tmp_path / "pairs", F.cross_entropy, as_dict=False)  # model(*inputs), loss(outputs, targets)
    own = single(tmp_path / "own", None, as_dict=True)  # model(**batch) returns its loss
    custom = single(tmp_path / "custom", fastpar.loss_from_batch(dict_loss), as_dict=True)
    for other in (own, custom):
        assert_same(other.model.state_dict(), pairs.model.state_dict())
        assert [r["loss"] for r in other.history] == [r["loss"] for r in pairs.history]
    assert pairs.final["accuracy"] is not None and pairs.last("val_accuracy") > 0.5  # classification: accuracy
    assert own.final["accuracy"] is None  # the loss came from the model: nothing to compare outputs with
    assert "mean_logit" in custom.final and "val_mean_logit" in custom.final
    assert "tokens_per_s" not in pairs.final  # no token ids in these batches


def test_a_batch_that_is_not_a_pair_names_the_other_forms(tmp_path):
    with pytest.raises(TypeError, match=r"must be a pair \(inputs, targets\), got a dict.*loss_from_batch"):
        single(tmp_path, F.cross_entropy, as_dict=True)


def test_a_model_output_without_a_loss_is_named(tmp_path):
    with pytest.raises(TypeError, match=r"loss_fn=None: the model's forward returned a tensor of shape \(8, 4\)"):
        Trainer(
            two_input_net,
            sgd,
            None,
            [{"left": torch.randn(8, 5), "right": torch.randn(8, 3)}] * 3,
            options=options(tmp_path, devices=1),
        ).fit()


# --- the pieces ------------------------------------------------------------------------------------------------
def test_batches_move_to_the_device_recursively_in_the_models_dtype():
    Pair = collections.namedtuple("Pair", "x y")
    batch = {
        "a": np.ones((2, 3)),  # numpy float64
        "b": [torch.zeros(2, dtype=torch.int32), (torch.ones(2, dtype=torch.float16), "tag")],
        "c": Pair(torch.ones(2), 7),
    }
    moved = to_device(batch, torch.device("cpu"), torch.bfloat16)
    assert moved["a"].dtype == torch.bfloat16 and moved["b"][0].dtype == torch.int32
    assert moved["b"][1][0].dtype == torch.bfloat16 and moved["b"][1][1] == "tag"
    assert isinstance(moved["c"], Pair) and moved["c"].x.dtype == torch.bfloat16 and moved["c"].y == 7
    assert batch_size_of(moved) == 2


def test_samples_and_tokens_are_read_from_the_batch():
    ids = torch.zeros(4, 9, dtype=torch.long)
    assert token_count({"input_ids": ids, "attention_mask": torch.ones(4, 9)}) == 36
    assert token_count((ids, ids)) == 36
    assert token_count((torch.zeros(4, 9), ids)) is None  # floating inputs are not token ids
    assert token_count({"pixels": torch.zeros(4, 3)}) is None
    assert batch_size_of({"x": torch.tensor(1.0), "y": torch.zeros(5, 2)}) == 5  # scalars carry no batch
    with pytest.raises(TypeError, match="at least one tensor with a batch dimension"):
        batch_size_of({"name": "x"})


def test_the_loss_a_model_returns_is_found_where_models_put_it():
    loss = torch.tensor(1.5)
    assert loss_of_outputs(loss) is not None
    assert loss_of_outputs({"loss": loss, "logits": torch.zeros(2, 3)}) == 1.5
    assert loss_of_outputs((loss, torch.zeros(2))) == 1.5

    class Output:
        def __init__(self) -> None:
            self.loss = loss

    assert loss_of_outputs(Output()) == 1.5
    with pytest.raises(TypeError, match="a Hugging Face model returns outputs.loss"):
        loss_of_outputs({"logits": torch.zeros(2, 3)})


def test_loss_from_batch_results_are_checked():
    model = torch.nn.Linear(2, 1)
    batch = {"x": torch.ones(3, 2)}
    device = torch.device("cpu")

    def returns(value):
        return Objective(fastpar.loss_from_batch(lambda m, b: value))

    result = returns((m := model(batch["x"]).sum(), {"n": 2}))(model, batch, device)
    assert result.loss.item() == m.item() and result.metrics["n"].item() == 2.0 and result.samples == 3
    with pytest.raises(TypeError, match="return a scalar tensor"):
        returns(1.0)(model, batch, device)
    with pytest.raises(TypeError, match=r"return \(loss, \{name: scalar\}\)"):
        returns((torch.tensor(1.0), [1]))(model, batch, device)
    with pytest.raises(ValueError, match="metric 'v' has 3 values"):
        returns((torch.tensor(1.0), {"v": torch.ones(3)}))(model, batch, device)
    with pytest.raises(TypeError, match="needs a function"):
        fastpar.loss_from_batch(3)


# --- token data: fastpar.data.token_loader made before launch, re-planned per rank --------------------------------
BYTE_VOCAB = 257  # bytes and the end-of-text id


def byte_gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=BYTE_VOCAB, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    return GPT2LMHeadModel(config)


def next_token_loss(outputs, targets):
    return F.cross_entropy(outputs.logits.flatten(0, 1), targets.flatten())


def hand_loop_on_tokens(rank: int, world_size: int, folder: str) -> dict[str, torch.Tensor] | None:
    import random

    from fastpar.data import token_loader

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(byte_gpt2())
    opt = adamw(model.parameters())
    loader = token_loader(folder, seq_len=16, batch_size=4, rank=rank, world_size=world_size)
    for x, y in loader:
        next_token_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()} if rank == 0 else None


def test_a_token_loader_made_before_launch_feeds_each_rank_its_windows(tmp_path):
    from fastpar.data import prepare_tokens, token_loader

    text = Path(np.__file__).parent / "_globals.py"  # real text every machine with numpy has
    prepare_tokens([text], tmp_path / "tokens", val_fraction=0)
    loader = token_loader(tmp_path / "tokens", seq_len=16, batch_size=4)  # rank 0 of 1: the Trainer re-plans it
    result = Trainer(byte_gpt2, adamw, next_token_loss, loader, options=options(tmp_path, log_every=4)).fit()
    reference = spawn(hand_loop_on_tokens, 2, str(tmp_path / "tokens"))[0]
    assert result.steps == len(loader) // 2 > 4
    assert_same(result.model.state_dict(), reference)
    assert result.final["tokens_per_s"] == pytest.approx(result.final["samples_per_s"] * 16)
