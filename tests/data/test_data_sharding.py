"""The epoch plan, array/sequence/stream loaders and their behaviour under (simulated and real) ranks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastpar.data import ShardSpec, array_loader, iterable_loader, num_batches, rank_batches
from fastpar.data.sharding import LAST_BATCH_POLICIES, sample_seeds
from fastpar.launcher import spawn

CASES = [(n, b, w) for w in (2, 3) for n in (7, 10, 23, 50) for b in (2, 3, 4) if n >= b * w]


def plans(n, b, w, policy, epoch=0, seed=0, shuffle=True):
    specs = [ShardSpec(n, b, r, w, seed, shuffle, policy) for r in range(w)]
    return specs, [rank_batches(s, epoch) for s in specs]


@pytest.mark.parametrize("policy", LAST_BATCH_POLICIES)
@pytest.mark.parametrize(("n", "b", "w"), CASES)
def test_equal_batch_counts_and_coverage(n, b, w, policy):
    specs, per_rank = plans(n, b, w, policy, epoch=3)
    counts = {len(batches) for batches in per_rank}
    assert counts == {len(specs[0])} == {num_batches(n, b, w, policy)}
    sizes = [len(idx) for batches in per_rank for idx, _ in batches]
    assert min(sizes) >= 1 and max(sizes) <= b
    seen = np.concatenate([idx for batches in per_rank for idx, _ in batches])
    if policy == "partial":
        assert sorted(seen.tolist()) == list(range(n))  # every sample exactly once
        for batches in per_rank:  # full batches first, only the tail smaller
            s = [len(idx) for idx, _ in batches]
            assert s == sorted(s, reverse=True) and all(x == b for x in s[:-2])
        totals = [sum(len(idx) for idx, _ in batches) for batches in per_rank]
        assert max(totals) - min(totals) <= 1
    else:
        assert set(sizes) == {b}
        if policy == "drop":
            assert len(set(seen.tolist())) == len(seen) == (n // (b * w)) * b * w
        else:
            assert set(seen.tolist()) == set(range(n)) and len(seen) == len(specs[0]) * b * w


def test_partial_never_gives_an_empty_batch():
    # 5 samples, 2 ranks, batch 2: shards of 3 and 2 over 2 batches; rank 1 gets [1, 1], not [2, 0]
    _, per_rank = plans(5, 2, 2, "partial")
    assert [[len(i) for i, _ in batches] for batches in per_rank] == [[2, 1], [1, 1]]


def test_drop_drops_different_samples_each_epoch():
    dropped = []
    for epoch in range(4):
        _, per_rank = plans(23, 4, 2, "drop", epoch=epoch)
        used = {int(i) for batches in per_rank for idx, _ in batches for i in idx}
        dropped.append(frozenset(set(range(23)) - used))
    assert len(set(dropped)) > 1


def test_order_depends_on_seed_and_epoch_only():
    a = plans(50, 4, 3, "partial", epoch=1, seed=5)[1]
    b = plans(50, 4, 3, "partial", epoch=1, seed=5)[1]
    c = plans(50, 4, 3, "partial", epoch=2, seed=5)[1]
    d = plans(50, 4, 3, "partial", epoch=1, seed=6)[1]
    flat = [np.concatenate([i for bs in p for i, _ in bs]) for p in (a, b, c, d)]
    assert np.array_equal(flat[0], flat[1])
    assert not np.array_equal(flat[0], flat[2]) and not np.array_equal(flat[0], flat[3])
    unshuffled = plans(10, 5, 1, "partial", shuffle=False)[1][0]
    assert np.concatenate([i for i, _ in unshuffled]).tolist() == list(range(10))


def test_sample_seeds_are_distinct_and_reproducible():
    s = sample_seeds(0, 0, np.arange(1000))
    assert len(set(s.tolist())) == 1000 and (s >= 0).all()
    assert np.array_equal(s, sample_seeds(0, 0, np.arange(1000)))
    assert not np.array_equal(s, sample_seeds(0, 1, np.arange(1000)))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(num_samples=0, batch_size=2), "empty"),
        (dict(num_samples=10, batch_size=0), "batch_size"),
        (dict(num_samples=10, batch_size=2, rank=3, world_size=3), "rank"),
        (dict(num_samples=10, batch_size=2, last_batch="keep"), "last_batch"),
        (dict(num_samples=2, batch_size=2, world_size=3), "pad"),
        (dict(num_samples=5, batch_size=4, world_size=2, last_batch="drop"), "no batch"),
        (dict(num_samples=5, batch_size=1, world_size=2), "batch_size=1"),
    ],
)
def test_bad_plans_explain_themselves(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ShardSpec(**kwargs)


def test_array_loader_shards_and_keeps_pairs():
    x = np.arange(23 * 2, dtype=np.float32).reshape(23, 2)
    y = np.arange(23)
    loaders = [array_loader(x, y, 4, rank=r, world_size=3, device="cpu") for r in range(3)]
    assert {len(ld) for ld in loaders} == {len(list(ld)) for ld in loaders}
    loaders = [array_loader(x, y, 4, rank=r, world_size=3, device="cpu") for r in range(3)]
    seen = []
    for ld in loaders:
        for xb, yb in ld:
            assert xb.dtype == torch.float32 and yb.dtype == torch.int64
            assert torch.equal(xb[:, 0], yb.float() * 2)  # rows stay paired with their labels
            seen += yb.tolist()
    assert sorted(seen) == list(range(23))


def test_array_loader_epochs_set_epoch_and_resume():
    x = torch.arange(30)
    ld = array_loader(x, None, 4, seed=1, device="cpu")
    first = [b.tolist() for b in ld]
    second = [b.tolist() for b in ld]  # the cursor moved on to epoch 1 by itself
    assert first != second and sorted(sum(first, [])) == sorted(sum(second, [])) == list(range(30))
    ld.set_epoch(0)
    assert [b.tolist() for b in ld] == first
    ld.set_epoch(0)
    it = iter(ld)
    head = [next(it).tolist() for _ in range(3)]
    state = ld.state_dict()
    assert (state["epoch"], state["batch"]) == (0, 3)
    fresh = array_loader(x, None, 4, seed=1, device="cpu")
    fresh.load_state_dict(state)
    assert head + [b.tolist() for b in fresh] == first
    assert fresh.state_dict()["epoch"] == 1
    with pytest.raises(ValueError, match="batch_size"):
        array_loader(x, None, 5, seed=1, device="cpu").load_state_dict(state)


def test_array_loader_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="same number of samples"):
        array_loader(np.zeros((5, 2)), np.zeros(4), 2)


def test_sequence_loader_collates_dict_items():
    items = [{"id": i, "v": torch.full((2,), float(i))} for i in range(11)]
    loaders = [iterable_loader(items, 3, rank=r, world_size=2, shuffle=True, device="cpu") for r in range(2)]
    batches = [list(ld) for ld in loaders]
    assert len(batches[0]) == len(batches[1]) == len(loaders[0])
    ids = sorted(i for bs in batches for b in bs for i in b["id"].tolist())
    assert ids == list(range(11))


@pytest.mark.parametrize(("policy", "expected"), [("drop", 2), ("pad", 3), ("partial", 3)])
def test_round_robin_stream_gives_every_rank_the_same_batches(policy, expected):
    # 2 ranks x batch 3 = 6 items per step; 17 items = 2 full steps + 5 left
    outs = [list(iterable_loader(iter(range(17)), 3, rank=r, world_size=2, last_batch=policy)) for r in range(2)]
    assert len(outs[0]) == len(outs[1]) == expected
    seen = sorted(i for out in outs for b in out for i in b.tolist())
    if policy == "partial":
        assert seen == list(range(17))
    if policy == "pad":
        assert all(len(b) == 3 for out in outs for b in out) and set(seen) == set(range(17))


def test_stream_resume_and_callable_source():
    ld = iterable_loader(lambda epoch: range(epoch * 100, epoch * 100 + 10), 3, device="cpu")
    assert [b.tolist() for b in ld] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert [b.tolist() for b in ld][0] == [100, 101, 102]  # epoch 1 called the source with 1
    ld.load_state_dict({"epoch": 0, "batch": 2})
    assert [b.tolist() for b in ld] == [[6, 7, 8], [9]]


def _rank_loaders(rank, world_size):
    """Per-rank: defaults from torch.distributed, batch counts, and the agreed stop of sharded streams
    (with the device of every tensor the agreement all-reduces)."""
    import torch.distributed as dist

    from fastpar.data.arrays import collective_device

    x = torch.arange(31)
    ld = array_loader(x, None, 4, device="cpu")
    arrays = [b.tolist() for b in ld]
    reduced_on, all_reduce = [], dist.all_reduce

    def recording_all_reduce(tensor, *args, **kwargs):
        reduced_on.append(str(tensor.device))
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = recording_all_reduce
    try:  # rank r's own shard has 5 + 2 r items; rank 0 runs dry after one full batch of 3, so all stop there
        stream = iterable_loader(iter(range(5 + 2 * rank)), 3, sharded=True, last_batch="drop", device="cpu")
        streamed = [b.tolist() for b in stream]
    finally:
        dist.all_reduce = all_reduce
    return ld.rank, ld.world_size, len(ld), arrays, streamed, reduced_on, str(collective_device())


@pytest.mark.slow
def test_real_process_group_defaults_and_stream_agreement():
    results = spawn(_rank_loaders, 3, timeout=120)
    assert [r[:2] for r in results] == [(0, 3), (1, 3), (2, 3)]
    assert {r[2] for r in results} == {len(r[3]) for r in results}
    assert sorted(i for r in results for b in r[3] for i in b) == list(range(31))
    assert [len(r[4]) for r in results] == [1, 1, 1]  # rank 0 has 5 items: one full batch, so all stop at 1
    # gloo reduces on the CPU: two agreement rounds (the full batch, then the stop), both on the group's device
    assert [r[5] for r in results] == [["cpu", "cpu"]] * 3 and {r[6] for r in results} == {"cpu"}


def test_collective_device_is_the_groups_device(monkeypatch):
    from torch.distributed import distributed_c10d

    from fastpar.data.arrays import collective_device

    monkeypatch.setattr(distributed_c10d, "_get_object_coll_device", lambda group=None: "cuda")  # an NCCL-only group
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert collective_device() == torch.device("cuda", 3)
    monkeypatch.setattr(
        distributed_c10d, "_get_object_coll_device", lambda group=None: "cpu"
    )  # gloo, or cpu:gloo,cuda:nccl
    assert collective_device() == torch.device("cpu")


class _Reduced(Exception):
    pass


def test_sharded_stream_agrees_on_the_collective_device(monkeypatch):
    """The agreement flag is made on collective_device(), not on the CPU: an NCCL-only group (the trainer's on
    GPUs) rejects CPU tensors. Without GPUs here, "meta" stands in for the GPU."""
    import torch.distributed as dist

    from fastpar.data import arrays

    seen = []

    def all_reduce(tensor, *args, **kwargs):
        seen.append(tensor.device)
        raise _Reduced  # a meta tensor has no value to read back: stop at the collective

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(arrays, "collective_device", lambda: torch.device("meta"))
    loader = iterable_loader(iter(range(8)), 2, sharded=True, rank=0, world_size=2, device="cpu")
    with pytest.raises(_Reduced):
        next(iter(loader))
    assert seen == [torch.device("meta")]
