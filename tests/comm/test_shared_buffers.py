"""Shared-memory buffers of the "fastpar" backend (fastpar/comm/shared_buffers.py, csrc/shm/shared_buffers.cpp):
an all-reduce of a tensor inside one stages nothing, and must still give gloo's bits on every rank; fastpar's DDP
keeps its buckets in them. Checked against gloo in the same processes, on spawned CPU ranks."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from fastpar.launcher import spawn

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _values(rank: int, n: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7919 * rank + 104729 * salt + n)
    x = torch.randn(n, generator=gen, dtype=torch.float64) * torch.exp(
        torch.randn(n, generator=gen, dtype=torch.float64) * 4
    )
    return x.to(dtype)


def _fastpar_files() -> list[str]:
    """Shared-buffer names in /dev/shm (<segment name>.b<id>.r<rank>); group segments other tests' crashed ranks
    left (swept by the next group) are not counted."""
    names = (name.split(".") for name in os.listdir("/dev/shm") if name.startswith("fastpar."))
    return sorted(".".join(p) for p in names if len(p) == 10 and p[8].startswith("b") and p[9].startswith("r"))


def _parity_rank(rank: int, world: int) -> list[str]:
    from fastpar.comm import shared_buffers

    gloo = dist.new_group(backend="gloo")
    failures = []
    for salt, dtype in enumerate(DTYPES):
        sizes = [(1, dtype), (4099, dtype), (300_001, dtype)]
        flats = shared_buffers.carve(sizes)
        assert flats is not None, "the backend runs on shared memory: carve must give buffers"
        for k, flat in enumerate(flats):
            assert flat.dtype == dtype and flat.numel() == sizes[k][0] and not flat.any()
            for op_name, op in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG)):
                flat.copy_(_values(rank, flat.numel(), dtype, salt))
                ref = flat.clone()
                dist.all_reduce(ref, op=op, group=gloo)
                with shared_buffers.bucket_collective():
                    dist.all_reduce(flat, op=op)
                if not torch.equal(flat.view(torch.uint8), ref.view(torch.uint8)):
                    failures.append(f"{dtype} n={flat.numel()} {op_name}")
        # a slice of a buffer (a hook reducing part of a bucket) takes the same path at its offset
        view = flats[2].narrow(0, 1000, 5000)
        view.copy_(_values(rank, 5000, dtype, salt + 100))
        ref = view.clone()
        dist.all_reduce(ref, group=gloo)
        with shared_buffers.bucket_collective():
            dist.all_reduce(view)
        if not torch.equal(view.view(torch.uint8), ref.view(torch.uint8)):
            failures.append(f"{dtype} slice")
    dist.barrier()
    return failures + [f"left in /dev/shm: {_fastpar_files()}"] * bool(_fastpar_files())


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_all_reduce_of_a_shared_buffer_gives_gloos_bits(world):
    results = spawn(_parity_rank, world, backend="fastpar")
    assert results == [[]] * world


def _mismatch_rank(rank: int, world: int) -> str:
    from fastpar.comm import shared_buffers

    flat = shared_buffers.shared_flat(1000, torch.float32)
    assert flat is not None
    t = flat if rank == 0 else torch.ones(1000)  # rank 0 reduces a shared buffer, rank 1 private memory
    try:
        with shared_buffers.bucket_collective():
            dist.all_reduce(t)
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_ranks_that_disagree_on_a_shared_buffer_fail_with_both_calls_named():
    messages = spawn(_mismatch_rank, 2, backend="fastpar", pg_timeout=60)
    assert any("collective mismatch" in m and "shared buffer 0" in m for m in messages), messages


def _ddp_rank(rank: int, world: int, shared: str) -> tuple:
    os.environ["FASTPAR_SHM_BUCKETS"] = shared
    from fastpar import DistributedDataParallel
    from fastpar.comm import shared_buffers

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 8)
    )
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.25)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(3):
        torch.manual_seed(100 * rank + step)
        opt.zero_grad(set_to_none=step % 2 == 0)
        ddp(torch.randn(16, 64)).square().mean().backward()
        opt.step()
    buckets = ddp.reducer.buckets
    in_shared = [b.comm_flat.untyped_storage().data_ptr() != 0 and _is_shared(b.comm_flat) for b in buckets]
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return shared_buffers.available(None), len(buckets), in_shared, params


def _is_shared(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory is a MAP_SHARED mapping (found in /proc/self/maps as a /dev/shm file)."""
    address = t.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, *rest = line.split()
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                return "/dev/shm/fastpar" in line
    return False


def test_ddp_keeps_its_buckets_in_shared_memory_with_the_same_results():
    shared = spawn(_ddp_rank, 2, "1", backend="fastpar")
    private = spawn(_ddp_rank, 2, "0", backend="fastpar")
    assert shared[0][0] and not private[0][0]
    assert shared[0][1] >= 2  # several buckets, all in shared memory
    assert all(all(r[2]) for r in shared) and not any(any(r[2]) for r in private)
    for s, p in zip(shared, private, strict=True):
        assert torch.equal(s[3], p[3])
    assert torch.equal(shared[0][3], shared[1][3])


def test_default_caps_take_torchs_25_mb_for_shared_buckets_on_busy_cores():
    from fastpar.ddp.buckets import default_caps

    mb = 1024 * 1024
    params = [torch.zeros(1000, 1000) for _ in range(20)]  # 80 MB of fp32 gradients
    assert default_caps(params, 2, shared_buckets=True, cores=2) == [mb, 25 * mb]  # every core computes
    assert default_caps(params, 2, shared_buckets=True, cores=4) == [mb, 4 * mb]  # a spare core per rank
    assert default_caps(params, 2, cores=2) == [mb, 4 * mb]  # private buckets (gloo): fastpar's 4 MB
    assert default_caps(params, 3, shared_buckets=True, cores=2) == [mb, 25 * mb]  # torch's above 2 ranks


def _one_rank_cannot_rank(rank: int, world: int) -> tuple:
    from fastpar.comm import shared_buffers
    from fastpar.ops import loader

    ext = loader.extension()
    if rank == 1:  # this rank's /dev/shm is "full"

        class Full:
            def __getattr__(self, name):
                return getattr(ext, name)

            def shm_shared_create(self, backend, nbytes):
                raise RuntimeError("fastpar shm: cannot reserve 1 MB in /dev/shm (simulated)")

        loader.extension = lambda: Full()
    flat = shared_buffers.shared_flat(1000, torch.float32)
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)  # the group still works, on the staged path
    return flat is None, bool(torch.all(t == 3.0)), _fastpar_files()


def test_a_rank_that_cannot_create_its_buffer_makes_every_rank_keep_private_memory():
    results = spawn(_one_rank_cannot_rank, 2, backend="fastpar")
    assert results == [(True, True, []), (True, True, [])]


def _copy_on_one_rank(rank: int, world: int) -> tuple:
    import copy

    from fastpar import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 4)))
    model(torch.randn(8, 32)).sum().backward()  # the buckets moved to shared memory at this forward
    if rank == 0:  # a copy made and evaluated on one rank alone must not wait for the other
        clone = copy.deepcopy(model)
        with torch.no_grad():
            clone(torch.randn(8, 32))
    model(torch.randn(8, 32)).sum().backward()
    return _is_shared(model.reducer.buckets[0].comm_flat), [p.grad.clone() for p in model.parameters()]


def test_a_copy_on_one_rank_alone_does_not_wait_for_the_others():
    results = spawn(_copy_on_one_rank, 2, backend="fastpar", pg_timeout=60, timeout=120)
    assert results[0][0] and results[1][0]
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1], strict=True))


def _rank_local_steps_rank(rank: int, world: int) -> tuple:
    import copy

    from fastpar import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 4)))
    if rank == 0:  # before any step, on this rank alone: a copy sampled with grad, and a no_sync step
        clone = copy.deepcopy(model)
        clone(torch.randn(8, 32)).sum()
        with model.no_sync():
            model(torch.randn(8, 32)).sum().backward()
        model.zero_grad()
    for step in range(2):
        torch.manual_seed(step)
        model(torch.randn(8, 32)).sum().backward()
    return _is_shared(model.reducer.buckets[0].comm_flat), [p.grad.clone() for p in model.parameters()]


def test_rank_local_forwards_and_no_sync_steps_do_not_wait_for_the_others():
    """The shared buckets are created at the end of the first synchronised backward, not at a forward."""
    results = spawn(_rank_local_steps_rank, 2, backend="fastpar", pg_timeout=30, timeout=120)
    assert results[0][0] and results[1][0], "the buckets are in shared memory after the first synchronised step"
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1], strict=True))


def _own_all_reduce_rank(rank: int, world: int) -> dict:
    from fastpar import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 4)))
    for _ in range(2):
        model(torch.randn(8, 32)).sum().backward()
    grad = model.module[0].weight.grad
    # rank 0 reduces its .grad (inside the shared bucket), rank 1 private memory: an ordinary all-reduce on both
    tensor = grad if rank == 0 else torch.ones_like(grad)
    before = tensor.clone()
    try:
        dist.all_reduce(tensor)
    except RuntimeError as error:
        return {"error": str(error)}
    return {"in_shared": _is_shared(grad), "before": before, "after": tensor.clone()}


def test_a_users_all_reduce_of_a_gradient_in_a_shared_bucket_is_an_ordinary_all_reduce():
    results = spawn(_own_all_reduce_rank, 2, backend="fastpar", pg_timeout=30, timeout=120)
    assert "error" not in results[0] and "error" not in results[1], results
    assert results[0]["in_shared"]
    expected = results[0]["before"] + results[1]["before"]
    assert torch.equal(results[0]["after"], expected) and torch.equal(results[1]["after"], expected)
