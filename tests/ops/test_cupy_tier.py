"""The CuPy/NVRTC kernel tier: csrc/ops/cuda compiles through NVRTC (no GPU needed), the tier's host contracts on an
emulated GPU (tests/support/kernel_emulator.py), the loader's choices, DDP and the pack benchmark through the tier, CuPy arrays
in array_loader; and on a GPU (skipped without one) the real tier under DDP, ``fastpar info`` and ``fastpar bench``.
The op-by-op bit-exactness of the tier is tests/ops/test_ops.py (params ``cupy-emulated`` and, on a GPU, ``cupy``)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from collections import Counter

import numpy as np
import pytest
import torch
from kernel_emulator import emulated_tier

import fastpar
from fastpar import ops
from fastpar.info import _kernels_line
from fastpar.launcher import spawn
from fastpar.ops import cupy_tier, loader, nvrtc

needs_gpu = pytest.mark.cuda


def nvrtc_or_skip() -> None:
    """CI installs CuPy, NVRTC and the CUDA runtime headers and sets FASTPAR_EXPECT_NVRTC=1: then a missing piece
    fails the test instead of skipping it."""
    try:
        nvrtc.version()
        nvrtc.cuda_include_dir()
    except Exception as exc:
        if os.environ.get("FASTPAR_EXPECT_NVRTC") == "1":
            raise
        pytest.skip(f"NVRTC is not usable here: {exc}")


# ---- the kernels compile through NVRTC (the CI check; no GPU needed) ----------------------------------------------
SM_TARGETS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120")


@pytest.mark.parametrize(
    "target", [t if t in ("sm_80", "sm_90") else pytest.param(t, marks=pytest.mark.slow) for t in SM_TARGETS]
)
def test_every_kernel_compiles_through_nvrtc(target):
    nvrtc_or_skip()
    if int(target[3:]) not in nvrtc.supported_archs():
        pytest.skip(f"NVRTC {nvrtc.version()} does not know {target}")
    cubin = nvrtc.compile_kernels(target)  # raises NvrtcError with NVRTC's log on any error
    assert cubin[:4] == b"\x7fELF"
    for name in nvrtc.ENTRY_POINTS:
        assert name.encode() in cubin


@pytest.mark.parametrize("target", ["compute_80", "compute_90"])
def test_ptx_rounds_like_the_nvcc_build(target):
    """No FMA contraction and no flush-to-zero anywhere: the arithmetic the CPU reference rounds like."""
    nvrtc_or_skip()
    ptx = nvrtc.compile_kernels(target).decode()
    assert sorted(re.findall(r"\.entry\s+(\w+)", ptx)) == sorted(nvrtc.ENTRY_POINTS)
    assert re.findall(r"\bfma\.\S+", ptx) == []
    assert re.findall(r"\b\w+(?:\.\w+)*\.ftz\b", ptx) == []
    assert re.search(r"\bmul\.rn\.f32\b", ptx) and re.search(r"\badd\.rn\.f64\b", ptx)


def _float_ops(ptx: str) -> Counter:
    """Floating-point arithmetic and conversion instructions of a PTX file, counted (integer indexing may differ)."""
    ops = re.findall(r"\b((?:add|sub|mul|div|fma|sqrt|rcp|cvt|abs|neg|min|max|setp|testp)(?:\.\w+)+)", ptx)
    return Counter(op for op in ops if re.search(r"\.(?:b?f16|f32|f64)\b", op))


def test_nvrtc_and_nvcc_emit_the_same_floating_point_code(tmp_path):
    """The same source through both compilers: the same rounding instructions, the same number of each."""
    nvrtc_or_skip()
    nvcc = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    if not os.path.isfile(nvcc):
        pytest.skip("nvcc is not installed")
    ptx = tmp_path / "nvcc.ptx"
    source = nvrtc.kernel_dir() / nvrtc.SOURCE
    subprocess.run(
        [nvcc, "-std=c++17", "-O3", "--fmad=false", "-arch=compute_90", "-ptx", str(source), "-o", str(ptx)],
        check=True,
        timeout=600,
    )
    nvcc_ops, nvrtc_ops = _float_ops(ptx.read_text()), _float_ops(nvrtc.compile_kernels("compute_90").decode())
    assert nvrtc_ops == nvcc_ops and nvcc_ops["cvt.rn.bf16.f32"] > 0 and nvcc_ops["mul.rn.f32"] > 0


def test_compiled_kernels_are_cached_on_disk(tmp_path, monkeypatch):
    nvrtc_or_skip()
    monkeypatch.setenv("FASTPAR_JIT_DIR", str(tmp_path))
    path = nvrtc.cached_kernels("sm_90")
    assert path.parent == tmp_path / "nvrtc" and path.read_bytes()[:4] == b"\x7fELF"

    def no_compile(target):
        raise AssertionError("compiled again although the binary is cached")

    monkeypatch.setattr(nvrtc, "compile_kernels", no_compile)
    assert nvrtc.cached_kernels("sm_90") == path
    assert [p.name for p in path.parent.iterdir() if p.suffix == ".cubin"] == [path.name]


def test_a_compile_error_carries_nvrtcs_log(tmp_path, monkeypatch):
    nvrtc_or_skip()
    (tmp_path / nvrtc.SOURCE).write_text('extern "C" __global__ void fastpar_scaled_copy() { undefined_name(); }\n')
    monkeypatch.setattr(nvrtc, "kernel_dir", lambda: tmp_path)
    with pytest.raises(nvrtc.NvrtcError, match=r"could not compile .*bucket_kernels\.cu for sm_90[\s\S]*undefined"):
        nvrtc.compile_kernels("sm_90")


def test_target_is_a_cubin_for_known_gpus_and_ptx_for_newer_ones(monkeypatch):
    monkeypatch.setattr(nvrtc, "supported_archs", lambda: (75, 80, 86, 90))
    monkeypatch.setattr(nvrtc, "version", lambda: "12.4")
    assert nvrtc.target_for((8, 6)) == "sm_86"
    assert nvrtc.target_for((8, 9)) == "compute_86"  # the driver compiles that PTX for the GPU
    with pytest.raises(nvrtc.NvrtcError, match=r"NVRTC 12.4 compiles for sm_75..sm_90; this GPU is sm_70"):
        nvrtc.target_for((7, 0))


def test_missing_headers_name_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("FASTPAR_CUDA_INCLUDE", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"no cuda_fp16.h found through FASTPAR_CUDA_INCLUDE=.*nvidia-cuda-runtime"):
        nvrtc.cuda_include_dir()


# ---- the host/device contract -----------------------------------------------------------------------------------
def test_python_and_the_header_agree_on_the_abi():
    header = (nvrtc.kernel_dir() / nvrtc.ABI_HEADER).read_text()
    enum = dict(re.findall(r"k(\w+) = (\d+)", re.search(r"enum class DType[^}]*}", header).group(0)))
    assert {"Float32": 0, "Float16": 1, "BFloat16": 2} == {k: int(v) for k, v in enum.items()}
    assert list(cupy_tier.DTYPE_CODES.values()) == [0, 1, 2]
    abi = nvrtc.abi()
    assert (cupy_tier.COPY_ENTRY.itemsize, cupy_tier.REDUCE_ENTRY.itemsize) == (
        abi["kCopyEntryBytes"],
        abi["kReduceEntryBytes"],
    )
    assert abi["kChunkElems"] == 8192 and abi["kBlockThreads"] == 256


def test_same_tensors_upload_their_table_once():
    tier, launcher = emulated_tier()
    tensors, out = [torch.randn(10), torch.randn(5)], torch.empty(15)
    for scale in (1.0, 0.5, 0.5):
        tier.pack(tensors, out, scale)
        assert torch.equal(out, (torch.cat(tensors) * scale))
    assert launcher.uploads == 1 and [k for k, _, _ in launcher.launches] == ["fastpar_scaled_copy"] * 3


def test_launch_shape_follows_the_header(monkeypatch):
    tier, launcher = emulated_tier()
    monkeypatch.setattr(tier, "_max_blocks", 2)  # grid-stride past the cap, as the nvcc launchers do
    tensors = [torch.randn(3 * 8192 + 1), torch.randn(10)]
    out = tier.pack(tensors, torch.empty(3 * 8192 + 11), 1 / 3)
    assert torch.equal(out, (torch.cat(tensors) * (1 / 3)))
    assert launcher.launches == [("fastpar_scaled_copy", 2, 256)]


def test_views_of_the_bucket_are_not_copied():
    tier, launcher = emulated_tier()
    out = torch.randn(12)
    tier.pack([out[:4].view(2, 2), out[4:12]], out, 1.0)
    assert launcher.launches == [] and launcher.uploads == 0


def test_norm_of_empty_buffers_only_finishes():
    tier, launcher = emulated_tier()
    norm, finite = tier.norm_and_finite([torch.zeros(0)])
    assert norm.item() == 0.0 and finite.item()
    assert launcher.launches == [("fastpar_finish_norm", 1, 256)]


# ---- the loader ---------------------------------------------------------------------------------------------------
def test_a_gpu_without_cuda_kernels_gets_the_cupy_tier(fresh_loader):
    tier, _ = emulated_tier()
    fresh_loader.setenv("FASTPAR_EXT", "auto")
    fresh_loader.setattr(loader, "_gpu_visible", lambda: True)
    fresh_loader.setattr(cupy_tier, "load", lambda: tier)
    status = fastpar.ext_status()
    prebuilt = loader.extension() is not None
    assert status == {
        "backend": "cupy",
        "reason": status["reason"],
        "cuda": True,
        "cpu": "compiled" if prebuilt else "torch",
        "nvrtc": "emulated",
    }
    assert "compiled by NVRTC emulated through CuPy" in status["reason"]
    assert loader.kernels_for(torch.device("cuda", 0)) == ("cupy", tier)
    assert _kernels_line(status).startswith("cupy, NVRTC emulated (")


def test_without_cupy_cuda_tensors_use_torch_and_say_why(fresh_loader):
    def no_cupy():
        raise ImportError("CuPy is needed ... pip install 'fastpar[cupy]'")

    fresh_loader.setenv("FASTPAR_EXT", "auto")
    fresh_loader.setattr(loader, "_gpu_visible", lambda: True)
    fresh_loader.setattr(cupy_tier, "load", no_cupy)
    if loader.extension() is None:
        pytest.skip("needs the prebuilt fastpar._C")
    status = fastpar.ext_status()
    assert status["backend"] == "compiled" and not status["cuda"] and status["nvrtc"] is None
    assert "CUDA tensors use pure torch" in status["reason"] and "fastpar[cupy]" in status["reason"]
    assert loader.kernels_for(torch.device("cuda", 0)) == ("torch", None)


def test_forcing_cupy_where_it_cannot_run_warns_once(fresh_loader):
    fresh_loader.setenv("FASTPAR_EXT", "cupy")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        status = fastpar.ext_status()
        ops.pack([torch.ones(2)], torch.zeros(2))
    if status["backend"] == "cupy":
        pytest.skip("the CuPy tier runs here")
    assert [type(w.message) for w in caught] == [RuntimeWarning]
    assert status["backend"] == "torch" and "CuPy/NVRTC tier unavailable" in status["reason"]


def test_a_failed_compile_falls_back_with_one_warning(fresh_loader):
    tier, _ = emulated_tier()

    def broken(device):
        raise nvrtc.NvrtcError("NVRTC 13.0 could not compile bucket_kernels.cu for sm_90: error")

    fresh_loader.setattr(tier, "prepare", broken)
    fresh_loader.setattr(loader, "_gpu_visible", lambda: True)
    fresh_loader.setattr(cupy_tier, "load", lambda: tier)
    fresh_loader.setenv("FASTPAR_EXT", "cupy")
    assert fastpar.ext_status()["backend"] == "cupy"
    with pytest.warns(RuntimeWarning, match=r"CuPy kernel tier failed on cuda:0.*could not compile"):
        assert loader.kernels_for(torch.device("cuda", 0)) == ("torch", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert loader.kernels_for(torch.device("cuda", 0)) == ("torch", None)
    status = fastpar.ext_status()
    assert status["backend"] != "cupy" and not status["cuda"] and "failed on cuda:0" in status["reason"]


# ---- DDP and the benchmark run through the tier ---------------------------------------------------------------------
def _ddp_rank(rank: int, world_size: int) -> dict:
    sys.path.insert(0, os.path.dirname(__file__))
    from ddp_models import train
    from kernel_emulator import emulated_tier

    from fastpar import ops
    from fastpar.ops import loader

    tier, launcher = emulated_tier()
    served = {"cupy": lambda d: ("cupy", tier), "torch": lambda d: ("torch", None)}
    outcome = {}
    for kind in ("mlp", "cnn"):
        ref = train(lambda m: torch.nn.parallel.DistributedDataParallel(m), kind, rank, steps=5)
        for grad_dtype in (None, torch.bfloat16):
            got = {}
            for impl, kernels_for in served.items():
                loader.kernels_for = kernels_for
                ops._last_served.clear()
                got[impl] = train(
                    lambda m, g=grad_dtype: fastpar.DDP(m, gradient_as_bucket_view=False, grad_dtype=g),
                    kind,
                    rank,
                    steps=5,
                )
                outcome[f"{kind}/{grad_dtype}/{impl} served by"] = ops.last_implementation("cpu")
            outcome[f"{kind}/{grad_dtype}: cupy != torch ops"] = [
                k for k in got["cupy"] if not torch.equal(got["cupy"][k], got["torch"][k])
            ]
            if grad_dtype is None:
                outcome[f"{kind}: cupy != torch DDP"] = [k for k in ref if not torch.equal(ref[k], got["cupy"][k])]
    outcome["launched"] = sorted({kernel for kernel, _, _ in launcher.launches})
    return outcome


@pytest.mark.slow
def test_ddp_uses_the_live_tier_with_identical_results():
    for rank, outcome in enumerate(spawn(_ddp_rank, 2, timeout=300)):
        for key, value in outcome.items():
            if key.endswith("served by"):
                assert value == key.split("/")[2].split()[0], (rank, key)
            elif key == "launched":
                assert value == ["fastpar_scaled_copy"], rank
            else:
                assert value == [], f"rank {rank} {key}: {value}"


def test_pack_benchmark_lists_each_tier(monkeypatch, tmp_path, capsys):
    from fastpar.bench.benchmarks import pack
    from fastpar.bench.cli import main

    monkeypatch.setattr(pack, "kernel_tiers", lambda device: ({"cupy": emulated_tier()[0]}, ["compiled: none"]))
    out_json = tmp_path / "pack.json"
    argv = ["pack", "--shapes", "3x1K", "--device", "cpu", "-n", "1", "-w", "0", "--rounds", "1", "--json"]
    assert main([*argv, str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "fastpar.pack[cupy]" in text and "fastpar.unpack[cupy]" in text and "# tier pack[cupy] 3x1K:" in text
    report = json.loads(out_json.read_text())
    assert set(report["summary"]["tier_of_memcpy"]) == {"pack[cupy] 3x1K", "unpack[cupy] 3x1K"}


# ---- array_loader takes CuPy (DLPack) arrays -----------------------------------------------------------------------
class DLPackProducer:
    """Exposes only the DLPack protocol, as a CuPy array does (here over CPU memory)."""

    def __init__(self, tensor: torch.Tensor):
        self._tensor = tensor

    def __dlpack__(self, **kwargs):
        return self._tensor.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._tensor.__dlpack_device__()


def test_array_loader_shares_dlpack_arrays_without_a_copy():
    from fastpar.data import array_loader

    x, y = torch.arange(40.0).view(10, 4), torch.arange(10)
    loader = array_loader(DLPackProducer(x), DLPackProducer(y), 4, shuffle=False, rank=0, world_size=1, device="cpu")
    assert loader.x.data_ptr() == x.data_ptr() and loader.y.data_ptr() == y.data_ptr()
    x[0, 0] = -1.0  # shared memory: the batch sees the change
    (xb, yb), *_ = list(loader)
    assert torch.equal(xb, x[:4]) and torch.equal(yb, y[:4]) and xb[0, 0] == -1.0


# ---- on a GPU: the real tier ----------------------------------------------------------------------------------------
def _train_on_gpu(wrap, device: torch.device, rank: int) -> dict:
    sys.path.insert(0, os.path.dirname(__file__))
    from ddp_models import MODELS

    torch.manual_seed(0)
    module = MODELS["mlp"]().to(device)
    model = wrap(module)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(5):
        opt.zero_grad()
        model(torch.randn(8, 16, generator=gen).to(device), step=step, rank=rank).square().mean().backward()
        opt.step()
    return {k: v.cpu() for k, v in module.state_dict().items()}


def _gpu_ddp_rank(rank: int, world_size: int) -> dict:
    from fastpar import ops
    from fastpar.ops import loader

    device = torch.device("cuda", torch.cuda.current_device())
    ids = [device.index]
    reference = _train_on_gpu(lambda m: torch.nn.parallel.DistributedDataParallel(m, device_ids=ids), device, rank)
    variants = {
        "views": lambda m: fastpar.DDP(m, device_ids=ids),
        "no_views": lambda m: fastpar.DDP(m, device_ids=ids, gradient_as_bucket_view=False),
        "bf16": lambda m: fastpar.DDP(m, device_ids=ids, grad_dtype=torch.bfloat16),
    }
    results, outcome = {}, {}
    for ext in ("cupy", "torch"):
        os.environ["FASTPAR_EXT"] = ext
        loader._reset_for_tests()
        for name, wrap in variants.items():
            ops._last_served.clear()
            results[ext, name] = _train_on_gpu(wrap, device, rank)
            outcome[f"{ext}/{name} served by"] = ops.last_implementation(device)
        outcome[f"{ext} status"] = loader.ext_status()
    for name in ("views", "no_views"):
        outcome[f"{name}: cupy != torch DDP"] = [
            k for k in reference if not torch.equal(reference[k], results["cupy", name][k])
        ]
    outcome["bf16: cupy != torch ops"] = [
        k for k in reference if not torch.equal(results["cupy", "bf16"][k], results["torch", "bf16"][k])
    ]
    return outcome


@needs_gpu
def test_ddp_on_a_gpu_runs_the_cupy_tier():
    pytest.importorskip("cupy")
    outcome = spawn(_gpu_ddp_rank, 1, backend="nccl", timeout=300)[0]
    assert outcome["cupy status"]["backend"] == "cupy", outcome["cupy status"]
    for key, value in outcome.items():
        if key.endswith("served by"):
            assert value == key.split("/")[0], (key, value)
        elif not key.endswith("status"):
            assert value == [], (key, value)


def _run(args: list[str], **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fastpar", *args], env={**os.environ, **env}, capture_output=True, text=True, timeout=600
    )


@needs_gpu
def test_fastpar_info_reports_the_cupy_tier():
    pytest.importorskip("cupy")
    result = _run(["info"], FASTPAR_EXT="cupy")
    assert result.returncode == 0, result.stderr
    assert re.search(r"^kernels\s+cupy, NVRTC \d+\.\d+ \(", result.stdout, re.M), result.stdout


@needs_gpu
def test_pack_benchmark_on_a_gpu_times_the_cupy_tier(tmp_path):
    pytest.importorskip("cupy")
    out = tmp_path / "pack.json"
    result = _run(["bench", "pack", "--shapes", "8x64K", "-n", "2", "-w", "1", "--rounds", "1", "--json", str(out)])
    assert result.returncode == 0, result.stderr
    impls = {row["impl"] for row in json.loads(out.read_text())["rows"]}
    assert {"fastpar.pack[cupy]", "fastpar.unpack[cupy]"} <= impls, impls


@needs_gpu
def test_array_loader_takes_cupy_arrays_without_a_copy():
    cupy = pytest.importorskip("cupy")
    from fastpar.data import array_loader

    x, y = cupy.arange(40, dtype=cupy.float32).reshape(10, 4), cupy.arange(10)
    loader = array_loader(x, y, 4, shuffle=False, rank=0, world_size=1, device="cuda")
    assert loader.x.data_ptr() == x.data.ptr and loader.x.device.type == "cuda"
    (xb, yb), *_ = list(loader)
    assert torch.equal(xb.cpu(), torch.arange(16.0).view(4, 4)) and torch.equal(yb.cpu(), torch.arange(4))
    assert np.array_equal(cupy.asnumpy(x[:4]), xb.cpu().numpy())
