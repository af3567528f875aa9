"""FSDP2's collectives on gloo as point-to-point exchanges (fastpar/shard/gloo_exchange.py): the reduce-scatter
gives the bits of gloo's all-reduce and a slice (sum and average; other ops fall back to it), the all-gather the
bytes of gloo's ``all_gather_into_tensor``, synchronous and asynchronous, at 2 and 3 ranks, fp32 and bf16, from
one gloo segment to several; and ``fully_shard_model`` installs them on gloo only."""

from __future__ import annotations

import pytest
import torch

from fastpar.launcher import spawn

SIZES = [1, 7, 1000, 300_001]  # per rank; 300_001 x 3 fp32 spans several of gloo's 1 MiB segments per chunk


def _inputs(rank: int, world_size: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.rand(world_size * n, generator=torch.Generator().manual_seed(100 + rank)) + 1).to(dtype)


def _reduce_scatter_rank(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from fastpar.shard.gloo_exchange import PointToPointReduceScatter

    group, wrong = dist.group.WORLD, {}
    for dtype in (torch.float32, torch.bfloat16):
        for n in SIZES:
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX):
                x = _inputs(rank, world_size, n, dtype)
                expected = x.clone()
                dist.all_reduce(expected, op=op)
                out = torch.full((n,), float("nan"), dtype=dtype)
                PointToPointReduceScatter()(output_tensor=out, input_tensor=x, group=group, op=op)
                wrong[(str(dtype), n, str(op))] = int((out != expected.view(world_size, n)[rank]).sum())
    return wrong


def _all_gather_rank(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from fastpar.shard.gloo_exchange import PointToPointAllGather

    group, wrong = dist.group.WORLD, {}
    for dtype in (torch.float32, torch.bfloat16):
        for n in SIZES:
            for async_op, in_place in ((False, True), (True, True), (True, False)):
                shard = _inputs(rank, 1, n, dtype)
                expected = torch.empty(world_size * n, dtype=dtype)
                dist.all_gather_into_tensor(expected, shard)
                out = torch.full((world_size * n,), float("nan"), dtype=dtype)
                given = out[rank * n : (rank + 1) * n] if in_place else shard
                if in_place:
                    given.copy_(shard)
                work = PointToPointAllGather()(output_tensor=out, input_tensor=given, group=group, async_op=async_op)
                assert (work is not None) == async_op
                if work is not None:
                    assert isinstance(work, dist.Work)  # FSDP2 waits only for a Work
                    work.wait()
                wrong[(str(dtype), n, async_op, in_place)] = int((out != expected).sum())
    return wrong


@pytest.mark.parametrize("world_size", [2, 3])
def test_point_to_point_reduce_scatter_has_the_bits_of_glooss_all_reduce_and_slice(world_size):
    for rank, wrong in enumerate(spawn(_reduce_scatter_rank, world_size, timeout=300)):
        assert all(count == 0 for count in wrong.values()), f"rank {rank}: elements differing {wrong}"


@pytest.mark.parametrize("world_size", [2, 3])
def test_point_to_point_all_gather_equals_gloos(world_size):
    for rank, wrong in enumerate(spawn(_all_gather_rank, world_size, timeout=300)):
        assert all(count == 0 for count in wrong.values()), f"rank {rank}: elements differing {wrong}"


def _installed_rank(rank: int, world_size: int) -> tuple[set, set, bool]:
    from fastpar.shard import fully_shard_model

    model = fully_shard_model(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)), wrap="root")
    states = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if hasattr(m, "_get_fsdp_state")]
    states = [s for s in states if s is not None]
    return (
        {type(s._reduce_scatter_comm).__name__ for s in states},
        {type(s._all_gather_comm).__name__ for s in states},
        all(s.unshard_async_op for s in states),
    )


@pytest.mark.parametrize("backend", ["gloo", "fastpar"])
def test_fully_shard_model_installs_the_exchanges_on_gloo_only_and_gathers_ahead_on_cpu(backend):
    reduce_scatter, all_gather, gathers_ahead = spawn(_installed_rank, 2, backend=backend)[0]
    if backend == "gloo":
        assert reduce_scatter == {"PointToPointReduceScatter"} and all_gather == {"PointToPointAllGather"}
    else:
        assert "PointToPointReduceScatter" not in reduce_scatter and "PointToPointAllGather" not in all_gather
    assert gathers_ahead  # CPU ranks: the default prefetch gathers the next unit asynchronously
