"""The bucket collective seam: what replaces a bucket's all-reduce is installed through
``Reducer.install_bucket_collective`` only; a comm hook and a collective exclude each other in either order (one
rule, one error); a collective written against the ``BucketCollective`` protocol alone trains as torch's DDP does."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fastpar
from fastpar.ddp import gradient_path
from fastpar.ddp.bucket_collective import BucketCollective
from fastpar.ddp.buckets import build_buckets
from fastpar.launcher import free_port, spawn

_EXCLUSIVE = "A comm hook and a bucket collective .*each replace every bucket's all-reduce"


class AllReduceCollective:
    """A bucket collective that owns plain buckets and all-reduces them: DDP's arithmetic through the seam."""

    description = "a test collective (all-reduce through the seam)"
    operation = "seam all-reduce of gradient bucket"
    diagnosis_key = "seam-test"

    def __init__(self, reducer) -> None:
        self.reducer = reducer
        self.started: list[int] = []
        self.layouts: list[list[list[int]]] = []

    def build_buckets(self, layout):
        return build_buckets(self.reducer.slots, [list(b) for b in layout], True, None)

    def start(self, bucket):
        self.started.append(bucket.index)
        return dist.all_reduce(bucket.comm_flat, group=self.reducer.group, async_op=True)

    def finish(self, bucket, result, globally_unused) -> None:
        gradient_path.finish(bucket, result, globally_unused)

    def before_accumulate(self) -> None:
        pass  # finish leaves the reduced gradients in .grad: the next backward adds onto them as in DDP

    def follow_layout(self, assignment) -> None:
        self.layouts.append([list(b) for b in assignment])


@pytest.fixture
def group(no_process_group):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_only_a_bucket_collective_can_be_installed(group):
    model = fastpar.DDP(mlp())
    assert isinstance(AllReduceCollective(model.reducer), BucketCollective)
    with pytest.raises(TypeError, match="needs a fastpar.ddp.bucket_collective.BucketCollective"):
        model.reducer.install_bucket_collective(object())


@pytest.mark.parametrize("collective", ["zero", "custom"])
def test_a_comm_hook_and_a_collective_exclude_each_other_in_both_orders(group, collective):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def install(model):
        if collective == "zero":
            fastpar.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
        else:
            model.reducer.install_bucket_collective(AllReduceCollective(model.reducer))

    hooked = fastpar.DDP(mlp())
    hooked.register_comm_hook(None, allreduce_hook)
    with pytest.raises(RuntimeError, match=f"cannot install .*already has a comm hook.*{_EXCLUSIVE}") as first:
        install(hooked)
    assert hooked.reducer.bucket_collective is None
    sharded = fastpar.DDP(mlp())
    install(sharded)
    with pytest.raises(
        RuntimeError, match=f"cannot register a comm hook: this model already has .*{_EXCLUSIVE}"
    ) as second:
        sharded.register_comm_hook(None, allreduce_hook)
    assert sharded.reducer.comm_hook is None
    with pytest.raises(RuntimeError, match=f"cannot install .*already has .*{_EXCLUSIVE}"):
        install(sharded)  # a second collective
    # one rule: the same error, worded from the same sentence, whichever came first
    tail = str(first.value).split("already has")[1].split(". ", 1)[1]
    assert str(second.value).split("already has")[1].split(". ", 1)[1] == tail


def test_nothing_outside_the_reducer_writes_its_fields():
    import pathlib
    import re

    root = pathlib.Path(fastpar.__file__).parent
    writes = re.compile(r"\breducer\.[A-Za-z_]\w*\s*=[^=]")
    offenders = [
        f"{path.relative_to(root)}:{n}"
        for path in root.rglob("*.py")
        if path.name != "reducer.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if writes.search(line)
    ]
    assert offenders == []


def _train(rank: int, world_size: int, impl: str) -> dict:
    model_module = mlp()
    if impl == "torch":
        model = torch.nn.parallel.DistributedDataParallel(model_module)
        collective = None
    else:
        model = fastpar.DDP(model_module, bucket_cap_mb=0.0001)  # several buckets
        collective = AllReduceCollective(model.reducer)
        model.reducer.install_bucket_collective(collective)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(10 + rank)
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(6, 4, generator=gen)).square().mean().backward()
        opt.step()
    out = {"params": [p.detach().clone() for p in model.parameters()]}
    if collective is not None:
        out["buckets"] = len(model.reducer.buckets)
        out["started"] = collective.started
        out["layouts"] = collective.layouts
    return out


@pytest.mark.slow
def test_a_custom_collective_installed_through_the_seam_trains_as_torch_ddp():
    reference = spawn(_train, 2, "torch", timeout=120)
    got = spawn(_train, 2, "custom", timeout=120)
    for rank in range(2):
        assert all(torch.equal(a, b) for a, b in zip(reference[rank]["params"], got[rank]["params"], strict=True))
        buckets = got[rank]["buckets"]
        assert buckets > 1 and got[rank]["started"] == list(range(buckets)) * 4  # every bucket, in order, every step
        assert len(got[rank]["layouts"]) == 2  # at installation, then torch's rebuild
