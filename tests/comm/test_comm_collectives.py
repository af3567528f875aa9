"""The "fastpar" backend against gloo, in the same processes: every shared-memory collective and dtype, on
2, 3 and 4 spawned CPU ranks, must give gloo's bits (sums in gloo's ring order, the same bits on every rank).

Each rank runs the collective once on the default group ("fastpar") and once on a gloo group over the same ranks,
from the same inputs, and compares the raw bytes. Inputs span many orders of magnitude, so a different summation
order would show; fp16 inputs overflow to inf and sum to NaN in places.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from fastpar.launcher import spawn

REDUCIBLE = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
SMALL = (0, 1, 13, 4099)  # 0 and 1 elements, odd sizes, less than a staging slot
MULTI_STEP = 300_001  # > one 512 KB staging slot in every dtype: several steps, odd tail
MULTI_SEGMENT = 1_500_001  # fp32: 6 MB, so gloo's ring uses several 1 MB segments per rank block


def _values(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7919 * rank + 104729 * salt + n)
    x = torch.randn(n, generator=gen, dtype=torch.float64) * torch.exp(
        torch.randn(n, generator=gen, dtype=torch.float64) * 4
    )
    return x.to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _both(call, gloo) -> tuple:
    """call(group) on the default (fastpar) group and on the gloo group."""
    return call(None), call(gloo)


def _check_collectives(rank: int, world: int, gloo, dtype: torch.dtype, n: int, failures: list) -> None:
    def record(name, pair):
        if not _same(*pair):
            failures.append(f"{name} {dtype} n={n}")

    op_names = (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG))
    for op_name, op in op_names:

        def all_reduce(group, op=op):
            t = _values(rank, n, dtype)
            dist.all_reduce(t, op=op, group=group)
            return t

        record(f"all_reduce/{op_name}", _both(all_reduce, gloo))

        def reduce_scatter_tensor(group, op=op):
            out = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(out, _values(rank, n * world, dtype, salt=1), op=op, group=group)
            return out

        record(f"reduce_scatter_tensor/{op_name}", _both(reduce_scatter_tensor, gloo))

    def reduce_scatter_list(group):
        out = torch.empty(n, dtype=dtype)
        dist.reduce_scatter(out, [_values(rank, n, dtype, salt=2 + q) for q in range(world)], group=group)
        return out

    record("reduce_scatter(list)", _both(reduce_scatter_list, gloo))

    def all_gather_into_tensor(group):
        out = torch.empty(n * world, dtype=dtype)
        dist.all_gather_into_tensor(out, _values(rank, n, dtype, salt=3), group=group)
        return out

    record("all_gather_into_tensor", _both(all_gather_into_tensor, gloo))

    def all_gather_list(group):
        outs = [torch.empty(n, dtype=dtype) for _ in range(world)]
        dist.all_gather(outs, _values(rank, n, dtype, salt=4), group=group)
        return torch.cat(outs)

    record("all_gather(list)", _both(all_gather_list, gloo))

    def broadcast(group):
        t = _values(rank, n, dtype, salt=5)
        dist.broadcast(t, src=world - 1, group=group)
        return t

    record("broadcast", _both(broadcast, gloo))


def _parity_rank(rank: int, world: int) -> dict:
    import fastpar

    status = fastpar.comm.shm_status()
    gloo = dist.new_group(backend="gloo")
    failures: list[str] = []
    for dtype in REDUCIBLE:
        for n in (*SMALL, MULTI_STEP):
            _check_collectives(rank, world, gloo, dtype, n, failures)
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):  # several 1 MB gloo segments per rank block

        def big(group, op=op):
            t = _values(rank, MULTI_SEGMENT, torch.float32)
            dist.all_reduce(t, op=op, group=group)
            return t

        if not _same(*_both(big, gloo)):
            failures.append(f"all_reduce {op} float32 n={MULTI_SEGMENT}")
    # the sums are the same bits on every rank
    total = _values(rank, MULTI_STEP, torch.float32)
    dist.all_reduce(total)
    gathered = [torch.empty_like(total) for _ in range(world)]
    dist.all_gather(gathered, total, group=gloo)
    if not all(_same(g, total) for g in gathered):
        failures.append("ranks hold different bits after all_reduce")
    return {"status": status, "failures": failures}


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_every_collective_and_dtype_matches_gloo_bit_for_bit(world):
    results = spawn(_parity_rank, world, backend="fastpar", timeout=900)
    for rank, result in enumerate(results):
        assert result["status"] == {"backend": "fastpar", "shm": True, "reason": "", "nodes": 1}, (
            rank,
            result["status"],
        )
        assert result["failures"] == [], f"rank {rank}: differs from gloo: {result['failures']}"


def _layouts_rank(rank: int, world: int) -> list[str]:
    """Non-contiguous, complex, multi-dimensional, coalesced and in-place forms, and calls gloo serves."""
    gloo = dist.new_group(backend="gloo")
    failures = []

    def check(name, call):
        if not _same(*_both(call, gloo)):
            failures.append(name)

    def strided(group):
        base = _values(rank, 64 * 33, torch.float32).view(64, 33)
        view = base[:, ::2]  # non-contiguous: the result must land in the view, the rest untouched
        if group is None:
            dist.all_reduce(view)
        else:  # gloo reduces a non-contiguous tensor's first numel elements of memory: give it a copy
            dense = view.contiguous()
            dist.all_reduce(dense, group=group)
            view.copy_(dense)
        return base

    def transposed_parameter(group):
        # a non-contiguous leaf that requires grad: the result is copied back into it outside autograd
        weight = torch.nn.Parameter(_values(rank, 24 * 17, torch.float32).view(24, 17).t())
        if group is None:
            dist.all_reduce(weight)
            dist.broadcast(weight, src=world - 1)
        else:  # gloo sums the transposed memory as it lies (storage order): a copy of the same layout
            dense = weight.detach().clone()
            dist.all_reduce(dense, group=group)
            dist.broadcast(dense, src=world - 1, group=group)
            with torch.no_grad():
                weight.copy_(dense)
        return weight.detach()

    def complex_sum(group):
        t = torch.complex(_values(rank, 257, torch.float32), _values(rank, 257, torch.float32, salt=9))
        dist.all_reduce(t, group=group)
        return torch.view_as_real(t)

    def coalesced(group):
        ts = [_values(rank, n, torch.float32, salt=n) for n in (5, 1000, 33)]
        dist.all_reduce_coalesced(ts, group=group)
        return torch.cat(ts)

    def in_place_gather(group):
        out = torch.zeros(world * 100, dtype=torch.bfloat16)
        out[rank * 100 : (rank + 1) * 100] = _values(rank, 100, torch.bfloat16)
        dist.all_gather_into_tensor(out, out[rank * 100 : (rank + 1) * 100], group=group)
        return out

    def matrix_scatter(group):
        out = torch.empty(3, 7)
        dist.reduce_scatter_tensor(out, _values(rank, 3 * world * 7, torch.float32).view(3 * world, 7), group=group)
        return out

    def bytes_broadcast(group):
        t = torch.arange(1001, dtype=torch.uint8) + rank
        dist.broadcast(t, src=0, group=group)
        return t

    # served by gloo inside the fastpar backend: integer sums, other reduce ops, all-to-all, point-to-point
    def integer_sum(group):
        t = torch.arange(10, dtype=torch.int64) * (rank + 1)
        dist.all_reduce(t, group=group)
        return t

    def maximum(group):
        t = _values(rank, 100, torch.float32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t

    def all_to_all(group):
        out = torch.empty(world * 4)
        dist.all_to_all_single(out, torch.arange(world * 4, dtype=torch.float32) + 100 * rank, group=group)
        return out

    def send_recv(group):  # the gloo group holds every rank in order: global ranks are group ranks
        got = torch.empty(5)
        reqs = [
            dist.isend(torch.full((5,), float(rank)), (rank + 1) % world, group=group),
            dist.irecv(got, (rank - 1) % world, group=group),
        ]
        for req in reqs:
            req.wait()
        return got

    calls = (
        strided,
        transposed_parameter,
        complex_sum,
        coalesced,
        in_place_gather,
        matrix_scatter,
        bytes_broadcast,
        integer_sum,
        maximum,
        all_to_all,
        send_recv,
    )
    for call in calls:
        check(call.__name__, call)
    dist.barrier()
    return failures


@pytest.mark.slow
def test_layouts_coalesced_and_delegated_calls_match_gloo():
    for rank, failures in enumerate(spawn(_layouts_rank, 3, backend="fastpar", timeout=600)):
        assert failures == [], f"rank {rank}: differs from gloo: {failures}"


def _storage_order_rank(rank: int, world: int) -> list[str]:
    """Reductions of dense tensors that are not contiguous (transposed): gloo sums their memory as it lies, so at
    three ranks the summation order, and with it the last bits, follows the storage order, not the logical one."""
    gloo = dist.new_group(backend="gloo")
    failures = []

    def transposed(n_rows: int, n_cols: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
        if dtype.is_complex:
            real = torch.complex(
                _values(rank, n_rows * n_cols, torch.float32, salt),
                _values(rank, n_rows * n_cols, torch.float32, salt + 50),
            )
            return real.to(dtype).view(n_rows, n_cols).t()
        return _values(rank, n_rows * n_cols, dtype, salt).view(n_rows, n_cols).t()

    def as_bits(t: torch.Tensor) -> torch.Tensor:
        return torch.view_as_real(t) if t.is_complex() else t

    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.float64):
        for op_name, op in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG)):

            def all_reduce(group, op=op, dtype=dtype):
                t = transposed(64, 33, dtype, salt=1)
                dist.all_reduce(t, op=op, group=group)
                return t

            def reduce_scatter_list(group, op=op, dtype=dtype):
                out = transposed(33, 64, dtype, salt=2)
                dist.reduce_scatter(
                    out, [transposed(33, 64, dtype, salt=3 + q) for q in range(world)], op=op, group=group
                )
                return out

            def reduce_scatter_tensor(group, op=op, dtype=dtype):
                out = torch.empty(16, 5, dtype=dtype)
                dist.reduce_scatter_tensor(out, transposed(5, 16 * world, dtype, salt=9), op=op, group=group)
                return out

            calls = {
                "all_reduce": all_reduce,
                "reduce_scatter(list)": reduce_scatter_list,
                "reduce_scatter_tensor": reduce_scatter_tensor,
            }
            for name, call in calls.items():
                if dtype.is_complex and op_name == "avg" and name != "all_reduce":
                    continue  # gloo divides a complex reduce-scatter's result as complex numbers: not matched yet
                ours, theirs = _both(call, gloo)
                if not (ours.stride() == theirs.stride() and _same(as_bits(ours), as_bits(theirs))):
                    failures.append(f"{name}/{op_name} {dtype}")
    dist.barrier()
    return failures


def test_non_contiguous_reductions_sum_in_gloos_storage_order_at_three_ranks():
    for rank, failures in enumerate(spawn(_storage_order_rank, 3, backend="fastpar", timeout=600)):
        assert failures == [], f"rank {rank}: differs from gloo: {failures}"


def _async_rank(rank: int, world: int) -> dict:
    """Many collectives in flight at once, waited for in another order, through every Work method."""
    gloo = dist.new_group(backend="gloo")
    sizes = [1, 4099, 300_001, 77, 200_000, 0, 65_536, 12_345]
    ours = [_values(rank, n, torch.float32, salt=i) for i, n in enumerate(sizes)]
    works = [dist.all_reduce(t, async_op=True) for t in ours]
    gathered = torch.empty(world * 10)
    works.append(dist.all_gather_into_tensor(gathered, torch.arange(10.0) + rank, async_op=True))
    called = []
    future = works[2].get_future().then(lambda fut: called.append(fut.value()[0].numel()) or fut.value())
    outcome = {"completed_before_wait": sum(w.is_completed() for w in works)}
    for w in reversed(works):
        assert w.wait(timeout=datetime.timedelta(seconds=120))
    future.wait()
    refs = [_values(rank, n, torch.float32, salt=i) for i, n in enumerate(sizes)]
    for t in refs:
        dist.all_reduce(t, group=gloo)
    outcome["equal"] = [_same(a, b) for a, b in zip(ours, refs, strict=True)]
    outcome["completed"] = all(w.is_completed() and w.exception() is None for w in works)
    outcome["result_is_output"] = (
        works[1].result()[0] is ours[1] or works[1].result()[0].data_ptr() == ours[1].data_ptr()
    )
    outcome["future_value"] = _same(works[4].get_future().value()[0], ours[4])
    outcome["callback"] = called == [sizes[2]]
    outcome["gathered"] = gathered.tolist() == [float(i + r) for r in range(world) for i in range(10)]
    return outcome


@pytest.mark.slow
def test_async_works_in_flight_at_once_wait_future_result():
    for outcome in spawn(_async_rank, 2, backend="fastpar", timeout=600):
        assert all(outcome["equal"]), outcome
        assert outcome["completed"] and outcome["result_is_output"] and outcome["future_value"], outcome
        assert outcome["callback"] and outcome["gathered"], outcome


def _device_map_rank(rank: int, world: int) -> dict:
    import fastpar

    t = torch.ones(3) * (rank + 1)
    dist.all_reduce(t)
    return {"backend": dist.get_backend(), "status": fastpar.comm.shm_status(), "sum": t.tolist()}


@pytest.mark.slow
def test_device_backend_string_cpu_fastpar():
    for result in spawn(_device_map_rank, 2, backend="cpu:fastpar", timeout=300):
        assert result["status"]["shm"], result
        assert result["sum"] == [3.0, 3.0, 3.0]


def _large_rank(rank: int, world: int) -> bool:
    gloo = dist.new_group(backend="gloo")
    n = 64 * 1024 * 1024  # 256 MB of float32
    ours = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    ref = ours.clone()
    dist.all_reduce(ours)
    dist.all_reduce(ref, group=gloo)
    return torch.equal(ours, ref)


@pytest.mark.slow
def test_256_megabyte_all_reduce_matches_gloo():
    assert spawn(_large_rank, 2, backend="fastpar", timeout=900) == [True, True]


def _list_all_reduce_rank(rank: int, world: int) -> list[str]:
    """all_reduce_coalesced stages each tensor and sums into it where it lies: the bits of gloo's all-reduce of the
    concatenation, with tensors cut across staging chunks, empty ones, a transposed one, both paths at 3 ranks."""
    import warnings

    gloo = dist.new_group(backend="gloo")
    failures = []
    lists = {
        "many": [1, 4099, 300_001, 0, 77, 65_536, 200_000],
        "small": [3, 0, 1000, 13],  # under 64 KB: every rank sums whole chunks, also at 3 ranks
    }
    for dtype in (torch.float32, torch.bfloat16):
        for name, sizes in lists.items():
            for op_name, op in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG)):

                def call(group, sizes=sizes, dtype=dtype, op=op):
                    ts = [_values(rank, n, dtype, salt=i) for i, n in enumerate(sizes)]
                    ts.append(_values(rank, 33 * 17, dtype, salt=99).view(33, 17).t())  # not contiguous
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", FutureWarning)  # all_reduce_coalesced is deprecated
                        dist.all_reduce_coalesced(ts, op=op, group=group)
                    return torch.cat([t.reshape(-1) for t in ts])

                if not _same(*_both(call, gloo)):
                    failures.append(f"{name}/{op_name} {dtype}")
    dist.barrier()
    return failures


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_list_all_reduce_sums_in_place_with_gloos_bits(world):
    for rank, failures in enumerate(spawn(_list_all_reduce_rank, world, backend="fastpar", timeout=300)):
        assert failures == [], f"rank {rank}: differs from gloo: {failures}"
