"""Errors instead of hangs and riddles: unused parameters, a rank that never reaches a bucket, bad arguments."""

from __future__ import annotations

import sys
import time

import pytest
import torch
import torch.distributed as dist

from fastpar.launcher import RankError, spawn

sys.path.insert(0, __file__.rsplit("/", 1)[0])


def _unused_without_flag_rank(rank: int, world_size: int) -> str:
    from ddp_models import Unused

    import fastpar

    model = fastpar.DDP(Unused())
    try:
        model(torch.randn(4, 16), step=1, rank=rank).sum().backward()  # `sometimes` and `never` unused
    except fastpar.ddp.UnusedParametersError as exc:
        # the error leaves no collective in flight: the next synchronised step works
        model.module.sometimes.requires_grad_(False)
        model.module.never.requires_grad_(False)
        return str(exc)
    return "no error"


@pytest.mark.slow
def test_unused_parameters_are_named_with_the_fix():
    for message in spawn(_unused_without_flag_rank, 2, timeout=60):
        assert "never.weight" in message and "sometimes.bias" in message
        assert "find_unused_parameters=True" in message
        assert "body.weight" not in message


def _skip_backward_rank(rank: int, world_size: int) -> str:
    from ddp_models import MLP

    import fastpar

    model = fastpar.DDP(MLP())
    loss = model(torch.randn(4, 16)).sum()
    if rank == 1:
        time.sleep(30)  # never reaches the backward's collectives; the parent ends this rank
        return "slept"
    loss.backward()
    return "no error"


@pytest.mark.slow
def test_rank_that_never_reaches_a_bucket_is_named_without_hanging():
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        spawn(_skip_backward_rank, 2, timeout=60, pg_timeout=5)
    message = str(info.value)
    assert time.monotonic() - start < 45
    assert "rank 0 of 2 failed" in message
    assert "BucketTimeoutError" in message and "bucket 0" in message
    assert "rank(s) [1] never reached it" in message
    assert "net.0.weight" in message


def _shape_mismatch_rank(rank: int, world_size: int) -> str:
    import fastpar

    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3 + rank))
    try:
        fastpar.DDP(module)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow
def test_parameter_shape_mismatch_names_the_first_parameter():
    for message in spawn(_shape_mismatch_rank, 2, timeout=60):
        assert "Parameter #2 is 1.weight [3, 8]" in message and "1.weight [4, 8]" in message
        assert "rank 1" in message


@pytest.fixture
def single_rank_group(no_process_group):
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield


def test_device_ids_with_cpu_module(single_rank_group):
    import fastpar

    with pytest.raises(ValueError, match="device_ids and output_device arguments only work"):
        fastpar.DDP(torch.nn.Linear(2, 2), device_ids=[0])


def test_module_without_trainable_parameters(single_rank_group):
    import fastpar

    module = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(RuntimeError, match="doesn't have any parameter that requires a gradient"):
        fastpar.DDP(module)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"mixed_precision": object()}, "grad_dtype"),
        ({"skip_all_reduce_unused_params": True}, "find_unused_parameters"),
    ],
)
def test_unsupported_arguments_are_refused(single_rank_group, kwargs, match):
    import fastpar

    with pytest.raises(NotImplementedError, match=match):
        fastpar.DDP(torch.nn.Linear(2, 2), **kwargs)


def test_bad_grad_dtype(single_rank_group):
    import fastpar

    with pytest.raises(ValueError, match="grad_dtype"):
        fastpar.DDP(torch.nn.Linear(2, 2), grad_dtype=torch.int8)
