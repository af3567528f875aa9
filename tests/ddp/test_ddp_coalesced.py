"""all_reduce_coalesced: same result as one all_reduce per tensor, for mixed dtypes and tiny caps."""

from __future__ import annotations

import pytest
import torch

from fastpar.ddp.buckets import assign_buckets
from fastpar.ddp.coalesced import plan_coalesced_buckets
from fastpar.launcher import spawn


def _coalesced_rank(rank: int, world_size: int, cap_mb: float) -> bool:
    import torch.distributed as dist

    from fastpar.ddp import all_reduce_coalesced

    g = torch.Generator().manual_seed(rank)
    shapes = [(3, 5), (7,), (128, 33), (1,), (0,), (64, 64)]
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float16, torch.float32, torch.float32]
    tensors = [torch.randn(s, generator=g).to(d) for s, d in zip(shapes, dtypes, strict=True)]
    expected = [t.clone() for t in tensors]
    for t in expected:
        dist.all_reduce(t)
        t.copy_((t.float() * 0.5).to(t.dtype))
    all_reduce_coalesced(tensors, bucket_cap_mb=cap_mb, scale=0.5)
    return all(torch.equal(a, b) for a, b in zip(tensors, expected, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("cap_mb", [25.0, 0.01])
def test_all_reduce_coalesced_matches_per_tensor(cap_mb):
    assert spawn(_coalesced_rank, 2, cap_mb, timeout=120) == [True, True]


def test_plan_is_ddps_rule_one_dtype_per_bucket():
    ts = [torch.zeros(1000), torch.zeros(1000, dtype=torch.bfloat16), torch.zeros(1000), torch.zeros(300000)]
    ts.append(torch.zeros(1000))
    buckets = plan_coalesced_buckets(ts, bucket_cap_mb=0.01)  # 10 KiB
    # DDP's (torch's) rule: a bucket closes once it reaches the cap; buckets ordered by their first member
    assert buckets == [[0, 2, 3], [1], [4]]
    assert buckets == assign_buckets(ts, range(len(ts)), [int(0.01 * 1024 * 1024)])


def test_plan_rejects_nonpositive_cap():
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        plan_coalesced_buckets([torch.zeros(1)], bucket_cap_mb=0)


def _in_place_rank(rank: int, world_size: int) -> dict:
    """On the fastpar backend a bucket is one list all-reduce, nothing packed; the same bits as packing on gloo."""
    import torch.distributed as dist

    from fastpar.ddp import CoalescedAllReduce, all_reduce_coalesced

    gloo = dist.new_group(backend="gloo")
    g = torch.Generator().manual_seed(rank)
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float16]
    tensors = [torch.randn(97 * (i + 1), generator=g).to(dtypes[i % 4]) for i in range(40)]
    on_gloo = [t.clone() for t in tensors]
    one_shot = [t.clone() for t in tensors]
    prepared = CoalescedAllReduce(tensors, bucket_cap_mb=0.002)
    packed = CoalescedAllReduce(on_gloo, gloo, bucket_cap_mb=0.002)
    prepared()
    packed()
    all_reduce_coalesced(one_shot, bucket_cap_mb=0.002)
    try:  # the two-rank one-shot path checks dtypes in C++, naming the tensor
        all_reduce_coalesced([torch.zeros(3), torch.zeros(3, dtype=torch.float64)])
        refused = ""
    except TypeError as error:
        refused = str(error)
    return {
        "refused": "tensors[1]" in refused and "use float32/float16/bfloat16" in refused,
        "paths": (prepared.in_place, packed.in_place, len(prepared.lists) > 5),
        "prepared": all(torch.equal(a, b) for a, b in zip(tensors, on_gloo, strict=True)),
        "one_shot": all(torch.equal(a, b) for a, b in zip(one_shot, on_gloo, strict=True)),
    }


def test_fastpar_backend_reduces_buckets_in_place_with_the_packed_paths_bits():
    for result in spawn(_in_place_rank, 2, backend="fastpar", timeout=120):
        assert result == {"refused": True, "paths": (True, False, True), "prepared": True, "one_shot": True}
