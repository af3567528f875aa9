"""fastpar.ops against an independent expectation, on every implementation: the compiled CPU kernels, the pure-torch
fallback, the CuPy tier's host logic on CPU (an emulated GPU, tests/support/kernel_emulator.py), and on a GPU (skipped without
one) the compiled CUDA kernels and the CuPy/NVRTC tier. pack/unpack must match bit for bit. Each test also proves
which implementation ran (``fastpar.ops.last_implementation``), so a silent fallback to torch cannot pass."""

from __future__ import annotations

import random
import re

import pytest
import torch
from kernel_emulator import emulated_tier

from fastpar import ops
from fastpar.ops import loader

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_PAIRS = [pytest.param(a, b, id=f"{str(a)[6:]}-{str(b)[6:]}") for a in DTYPES for b in DTYPES]
SCALES = [pytest.param(1.0, id="scale1"), pytest.param(1 / 3, id="scale1_3")]
# (sizes or shapes, offset of `out`/`flat` inside its storage: 1 makes every vector access unaligned)
SIZE_SETS = {
    "empty-list": ([], 0),
    "zero-element": ([0, (0, 3), 5, 0], 0),
    "one-element": ([1, (), (1, 1)], 0),
    "odd": ([1, 3, 7, 1023, 4097, (3, 5)], 1),
    "chunk-edges": ([8191, 8193, 1, 16384], 0),  # CUDA chunks are 8192 elements
}
SIZES = [pytest.param(*v, id=k) for k, v in SIZE_SETS.items()]
THREADS_SPLIT = [70_001, 3, 140_000]  # pieces straddle the CPU kernel's per-thread ranges
SENTINEL = 7.0


def _served_by(name: str, impl):
    """A stand-in for loader.kernels_for that routes CPU tensors to ``impl``."""
    return lambda device: (name, impl) if device.type == "cpu" else ("torch", None)


@pytest.fixture(
    params=[
        "compiled",
        "fallback",
        "cupy-emulated",
        pytest.param("cuda", marks=pytest.mark.cuda),
        pytest.param("cupy", marks=pytest.mark.cuda),
    ],
)
def device(request, monkeypatch):
    """Device to run on. After the test, asserts that every op on it was served by the implementation under test."""
    if request.param == "fallback":
        monkeypatch.setattr(loader, "kernels_for", _served_by("torch", None))
        where, expected = "cpu", "torch"
    elif request.param == "cupy-emulated":
        monkeypatch.setattr(loader, "kernels_for", _served_by("cupy", emulated_tier()[0]))
        where, expected = "cpu", "cupy"
    elif request.param == "compiled":
        where, expected = "cpu", loader.kernels_for(torch.device("cpu"))[0]
        if expected == "torch":
            pytest.skip(f"fastpar._C is not built: {loader.ext_status()['reason']}")
    elif request.param == "cuda":
        where, expected = "cuda", loader.kernels_for(torch.device("cuda", torch.cuda.current_device()))[0]
        if expected not in ("compiled", "jit"):
            pytest.skip(f"the live extension has no CUDA kernels (CUDA tensors: {expected}): {loader.ext_status()}")
    else:
        pytest.importorskip("cupy", reason="the CuPy tier needs CuPy: pip install 'fastpar[cupy]'")
        monkeypatch.setenv("FASTPAR_EXT", "cupy")
        loader._reset_for_tests()
        request.addfinalizer(loader._reset_for_tests)  # the next test loads afresh, without FASTPAR_EXT=cupy
        where, expected = "cuda", loader.kernels_for(torch.device("cuda", torch.cuda.current_device()))[0]
        assert expected == "cupy", f"FASTPAR_EXT=cupy did not load the CuPy tier: {loader.ext_status()['reason']}"
    ops._last_served.clear()
    yield where
    served = ops.last_implementation(where)
    assert served in (expected, None), f"{request.param}: the last op on {where} was served by {served}"


def make(sizes, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s if isinstance(s, tuple) else (s,), generator=g) * 10).to(dtype).to(device) for s in sizes]


def buffer(total, dtype, device, offset, fill=SENTINEL):
    return torch.full((total + offset + 5,), fill, dtype=dtype, device=device)[offset:]


def cat_float(tensors):
    return torch.cat([t.reshape(-1).cpu().float() for t in tensors]) if tensors else torch.zeros(0)


def assert_bits(actual, expected):
    """Bitwise equality (tells -0.0 from 0.0); a NaN must stay a NaN, its payload bits are not part of the contract."""
    actual, expected = actual.cpu(), expected.cpu()
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.equal(actual.isnan(), expected.isnan()), (actual, expected)
    as_int = torch.int32 if actual.dtype == torch.float32 else torch.int16
    numbers = ~expected.isnan()
    assert torch.equal(actual[numbers].view(as_int), expected[numbers].view(as_int)), (actual, expected)


@pytest.mark.parametrize("sizes,offset", SIZES)
@pytest.mark.parametrize("src_dtype,out_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("scale", SCALES)
def test_pack(device, sizes, offset, src_dtype, out_dtype, scale):
    tensors = make(sizes, src_dtype, device)
    total = sum(t.numel() for t in tensors)
    out = buffer(total, out_dtype, device, offset)
    assert ops.pack(tensors, out, scale) is out
    assert_bits(out[:total], (cat_float(tensors) * scale).to(out_dtype))
    assert (out[total:] == SENTINEL).all(), "pack wrote past the tensors' total"


# Ties, subnormals, overflow to inf, signed zero, NaN: where a cast that is not round-to-nearest-even shows.
SPECIAL = [
    0.0,
    -0.0,
    1e-8,
    6e-8,
    -3e-5,
    1.0009765625,
    1.00048828125,
    2049.0,
    65504.0,
    65520.0,
    7e4,
    1e30,
    -1e-30,
    3.4e38,
    float("inf"),
    float("-inf"),
    float("nan"),
    1.00390625,
    1.01171875,
    257.0,
    -1.5,
]


@pytest.mark.parametrize("src_dtype,out_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("scale", SCALES)
def test_rounding_of_special_values(device, src_dtype, out_dtype, scale):
    values = torch.tensor(SPECIAL * 3).to(src_dtype).to(device)  # 63 elements: vector body and scalar tail
    out = ops.pack([values[:5], values[5:]], buffer(63, out_dtype, device, 0), scale)
    assert_bits(out[:63], (values.cpu().float() * scale).to(out_dtype))
    target = values.clone()
    ops.unpack(out, [target], scale, accumulate=True)
    assert_bits(target, (values.cpu().float() + out[:63].cpu().float() * scale).to(src_dtype))


@pytest.mark.parametrize("sizes,offset", SIZES)
@pytest.mark.parametrize("flat_dtype,dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("accumulate", [False, True], ids=["assign", "accumulate"])
def test_unpack(device, sizes, offset, flat_dtype, dtype, scale, accumulate):
    targets = make(sizes, dtype, device, seed=1)
    before = [t.clone() for t in targets]
    total = sum(t.numel() for t in targets)
    flat = buffer(total, flat_dtype, device, offset)
    flat[:total] = make([total], flat_dtype, device, seed=2)[0]
    assert ops.unpack(flat, targets, scale, accumulate) is None
    value = flat[:total].cpu().float() * scale
    if accumulate:
        value = cat_float(before) + value
    expected = value.to(dtype).split([t.numel() for t in targets])
    for t, b, e in zip(targets, before, expected, strict=True):
        assert_bits(t, e.view(b.shape))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_large_tensors_split_across_threads(device, dtype):
    tensors = make(THREADS_SPLIT, torch.float32, device)
    out = ops.pack(tensors, buffer(210_004, dtype, device, 1), 1 / 3)
    assert_bits(out[:210_004], (cat_float(tensors) * (1 / 3)).to(dtype))
    before = cat_float(tensors)
    ops.unpack(out, tensors, 3.0, accumulate=True)
    assert_bits(cat_float(tensors), before + out[:210_004].cpu().float() * 3.0)


def test_mixed_dtypes_in_one_call(device):
    tensors = [
        t.to(dt) for t, dt in zip(make([5, 1, 300, 8], torch.float32, device), DTYPES + [torch.float16], strict=True)
    ]
    out = ops.pack(tensors, buffer(314, torch.bfloat16, device, 0), 0.25)
    assert_bits(out[:314], (cat_float(tensors) * 0.25).to(torch.bfloat16))
    before = [t.clone() for t in tensors]
    ops.unpack(out, tensors, 2.0, accumulate=True)
    expected = (cat_float(before) + out[:314].cpu().float() * 2.0).split([5, 1, 300, 8])
    for t, e in zip(tensors, expected, strict=True):
        assert_bits(t, e.to(t.dtype))


def strided_views(device, dtype):
    base = make([(6, 5), (30,), (4, 6)], dtype, device, seed=3)
    return [base[0].t(), base[1][::3], base[2][:, 1:4]]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_pack_reads_strided_inputs(device, dtype):
    tensors = strided_views(device, dtype)
    assert not any(t.is_contiguous() for t in tensors)
    out = ops.pack(tensors, buffer(52, torch.float32, device, 0), 1 / 3)
    assert_bits(out[:52], (cat_float(tensors) * (1 / 3)).to(torch.float32))


@pytest.mark.parametrize("accumulate", [False, True], ids=["assign", "accumulate"])
def test_unpack_writes_strided_targets(device, accumulate):
    targets = strided_views(device, torch.bfloat16)
    before = [t.clone() for t in targets]
    flat = make([52], torch.float32, device, seed=4)[0]
    ops.unpack(flat, targets, 0.5, accumulate)
    value = flat.cpu() * 0.5 + (cat_float(before) if accumulate else 0)
    for t, e in zip(targets, value.to(torch.bfloat16).split([30, 10, 12]), strict=True):
        assert_bits(t, e.view(t.shape))


@pytest.mark.parametrize("scale", SCALES)
def test_pack_in_place_when_tensors_are_views_of_out(device, scale):
    out = make([20], torch.float32, device)[0]
    before = out.clone()
    ops.pack([out[:12].view(3, 4), out[12:19]], out, scale)
    assert_bits(out, torch.cat([(before[:19].cpu() * scale), before[19:].cpu()]))


def test_ten_thousand_tiny_tensors(device):
    rng = random.Random(0)
    tensors = make([rng.randint(0, 4) for _ in range(10_000)], torch.float32, device)
    total = sum(t.numel() for t in tensors)
    out = ops.pack(tensors, buffer(total, torch.float16, device, 0), 1 / 3)
    assert_bits(out[:total], (cat_float(tensors) * (1 / 3)).to(torch.float16))
    before = [t.clone() for t in tensors]
    ops.unpack(out, tensors, 3.0, accumulate=True)
    expected = (cat_float(before) + out[:total].cpu().float() * 3.0).split([t.numel() for t in tensors])
    assert all(torch.equal(t.cpu(), e.view(t.shape)) for t, e in zip(tensors, expected, strict=True))


def reference_norm(flats) -> float:
    return cat_float(flats).double().norm().item()


def test_norm_and_finite(device):
    flats = make([1000, 7, 0, 5000], torch.float32, device)
    flats[1], flats[3] = flats[1].half(), flats[3].bfloat16()
    norm, finite = ops.norm_and_finite(flats)
    assert norm.dtype == torch.float32 and finite.dtype == torch.bool and norm.dim() == finite.dim() == 0
    assert norm.device.type == finite.device.type == device
    assert norm.item() == pytest.approx(reference_norm(flats), rel=1e-6) and finite.item()


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_norm_and_finite_detects_non_finite(device, bad, dtype):
    flats = make([100, 3000], dtype, device)
    flats[1][1234] = bad
    norm, finite = ops.norm_and_finite(flats)
    assert not finite.item()
    assert (norm.isnan() if bad != bad else norm.isinf()).item()


def test_norm_of_huge_values_does_not_overflow(device):
    norm, finite = ops.norm_and_finite([torch.full((4,), 1e20, device=device)])  # x*x overflows fp32
    assert finite.item() and norm.item() == pytest.approx(2e20, rel=1e-6)


def test_norm_of_nothing_is_zero(device):
    assert [x.item() for x in ops.norm_and_finite([])] == [0.0, True]
    norm, finite = ops.norm_and_finite([torch.zeros(0, device=device)])
    assert norm.item() == 0.0 and finite.item()


def test_norm_does_not_depend_on_thread_count(device):
    flats = make([300_001, 5, 77_777], torch.float32, device)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = ops.norm_and_finite(flats)[0]
        torch.set_num_threads(max(2, threads))
        assert torch.equal(ops.norm_and_finite(flats)[0], single)
    finally:
        torch.set_num_threads(threads)


def _error_cases(device):
    x, f64 = torch.zeros(4, device=device), torch.zeros(4, dtype=torch.float64, device=device)
    meta = torch.zeros(2, device="meta")
    where = torch.device(device) if device == "cpu" else x.device
    return [
        (
            lambda: ops.pack([x], f64),
            TypeError,
            "pack: out has dtype torch.float64; supported dtypes are float32, float16 and bfloat16",
        ),
        (
            lambda: ops.pack([x, x.int()], torch.zeros(9, device=device)),
            TypeError,
            "pack: tensors[1] has dtype torch.int32; supported dtypes are float32, float16 and bfloat16",
        ),
        (lambda: ops.pack([[1.0]], x), TypeError, "pack: tensors[0] must be a torch.Tensor, got list"),
        (
            lambda: ops.pack([x], x.view(2, 2)),
            ValueError,
            "pack: out must be 1-D, got shape (2, 2); pass buffer.view(-1)",
        ),
        (
            lambda: ops.pack([x[:1]], x[::2]),
            ValueError,
            "pack: out must be contiguous; pass out.contiguous() and copy back",
        ),
        (
            lambda: ops.pack([x, x[:1]], x),
            ValueError,
            "pack: out has 4 elements but the tensors hold 5; allocate out with at least 5 elements",
        ),
        (
            lambda: ops.pack([x[:1], meta], x),
            ValueError,
            f"pack: tensors[1] is on meta but out is on {where}; move them to one device",
        ),
        (
            lambda: ops.unpack(x.view(2, 2), [x]),
            ValueError,
            "unpack: flat must be 1-D, got shape (2, 2); pass buffer.view(-1)",
        ),
        (
            lambda: ops.unpack(x[:3], [x]),
            ValueError,
            "unpack: flat has 3 elements but the tensors hold 4; allocate flat with at least 4 elements",
        ),
        (
            lambda: ops.unpack(x, [f64]),
            TypeError,
            "unpack: tensors[0] has dtype torch.float64; supported dtypes are float32, float16 and bfloat16",
        ),
        (lambda: ops.unpack(x, [x[:1], 3]), TypeError, "unpack: tensors[1] must be a torch.Tensor, got int"),
        (
            lambda: ops.unpack(x, [meta]),
            ValueError,
            f"unpack: tensors[0] is on meta but flat is on {where}; move them to one device",
        ),
        (
            lambda: ops.norm_and_finite([x, f64]),
            TypeError,
            "norm_and_finite: flats[1] has dtype torch.float64; supported dtypes are float32, float16 and bfloat16",
        ),
        (
            lambda: ops.norm_and_finite([x, None]),
            TypeError,
            "norm_and_finite: flats[1] must be a torch.Tensor, got NoneType",
        ),
        (
            lambda: ops.norm_and_finite([x, meta]),
            ValueError,
            f"norm_and_finite: flats[1] is on meta but flats[0] is on {where}; move them to one device",
        ),
    ]


def test_errors_name_the_problem_and_the_fix(device):
    for call, exc_type, message in _error_cases(device):
        with pytest.raises(exc_type, match=f"^{re.escape(message)}$"):
            call()


def test_extension_entry_points_directly(device, request):
    if request.node.callspec.params["device"] != "compiled":
        pytest.skip("calls the compiled extension itself")
    ext = loader.extension()
    norm, finite = ext.norm_and_finite([])
    assert norm.item() == 0.0 and finite.item()
    out = torch.zeros(3)
    assert ext.pack((torch.ones(1), torch.ones(2)), out, 2.0) is out and out.tolist() == [2.0, 2.0, 2.0]
