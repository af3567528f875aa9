"""The CuPy tier of ``fastpar.ops``: fastpar's CUDA kernels on GPU machines without nvcc (pip-installed torch + CuPy).

The kernels are ``csrc/ops/cuda/bucket_kernels.cu``, compiled by NVRTC (``fastpar.ops.nvrtc``) once per GPU architecture
and launched through CuPy on torch's current CUDA stream. Torch tensors are passed by pointer: no copies and no CuPy
arrays. Each call does what ``csrc/bindings.cpp`` and ``csrc/ops/cuda_glue.cpp`` do for the nvcc build: validate (with
the messages of ``fastpar.ops.reference``), write the per-tensor entry table (numpy, in the layout of
``bucket_kernels.h``), upload it through pinned memory on the stream, and launch once.

:class:`BucketKernels` holds that logic; the launcher under it does the CUDA work (:class:`CupyLauncher`), so the
tests drive the same logic on CPU with an emulating launcher.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from .._optional import require
from . import nvrtc
from .reference import _check_flat, _check_flats, _check_list

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # fastpar::cuda::DType
# fastpar::cuda::CopyEntry and ReduceEntry, with C's alignment and padding (sizes checked against the header)
COPY_ENTRY = np.dtype(
    [("src", "u8"), ("dst", "u8"), ("numel", "i8"), ("first_chunk", "i8"), ("src_dtype", "i4"), ("dst_dtype", "i4")],
    align=True,
)
REDUCE_ENTRY = np.dtype([("data", "u8"), ("numel", "i8"), ("first_chunk", "i8"), ("dtype", "i4")], align=True)
_MAX_CACHED_TABLES = 4096


class Launcher(Protocol):
    """Where the kernels run: CUDA through CuPy, or an emulation in the tests."""

    def prepare(self, device: torch.device) -> None: ...
    def stream(self, device: torch.device) -> int: ...
    def upload(self, table: np.ndarray, device: torch.device) -> torch.Tensor: ...
    def launch(
        self, device: torch.device, stream: int, kernel: str, blocks: int, threads: int, args: tuple
    ) -> None: ...


class BucketKernels:
    """``pack``/``unpack``/``norm_and_finite`` with the signatures and contracts of ``fastpar._C``."""

    name = "cupy"

    def __init__(self, launcher: Launcher, nvrtc_version: str | None = None):
        abi = nvrtc.abi()
        if (COPY_ENTRY.itemsize, REDUCE_ENTRY.itemsize) != (abi["kCopyEntryBytes"], abi["kReduceEntryBytes"]):
            raise RuntimeError(
                "csrc/ops/cuda/bucket_kernels.h and fastpar/ops/cupy_tier.py disagree on the entry layout"
            )
        self.nvrtc_version = nvrtc_version
        self._launcher = launcher
        self._chunk, self._threads, self._max_blocks = abi["kChunkElems"], abi["kBlockThreads"], abi["kMaxBlocks"]
        # Uploaded tables by (device, stream, bytes): DDP packs the same tensors every step, so the upload is done
        # once. Reuse stays ordered after the upload because the stream is part of the key.
        self._tables: dict[tuple[Any, int, bytes], torch.Tensor] = {}

    def prepare(self, device: torch.device) -> None:
        """Compile (or load from the disk cache) and load the kernels for ``device``; raises on failure."""
        self._launcher.prepare(device)

    def pack(self, tensors: Sequence[torch.Tensor], out: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        _check_flat("pack", "out", out)
        codes = _dtype_codes("pack", out, tensors, "out")
        rows, chunks, copies = [], 0, []
        dst, step, out_code = out.data_ptr(), out.element_size(), DTYPE_CODES[out.dtype]
        plain = np.float32(scale) == 1.0
        for t, code in zip(tensors, codes, strict=True):
            n = t.numel()
            if n == 0:
                continue
            t = _contiguous(t, copies)
            if not (plain and t.data_ptr() == dst and t.dtype == out.dtype):  # else already a view of the bucket
                rows.append((t.data_ptr(), dst, n, chunks, code, out_code))
                chunks += -(-n // self._chunk)
            dst += n * step
        self._scaled_copy(out.device, rows, chunks, scale, accumulate=False)
        return out

    def unpack(self, flat: torch.Tensor, tensors: Sequence[torch.Tensor], scale: float = 1.0, accumulate: bool = False):
        _check_flat("unpack", "flat", flat)
        codes = _dtype_codes("unpack", flat, tensors, "flat")
        rows, chunks, strided = [], 0, []  # strided targets are computed in a contiguous copy, then copied back
        src, step, flat_code = flat.data_ptr(), flat.element_size(), DTYPE_CODES[flat.dtype]
        plain = np.float32(scale) == 1.0 and not accumulate
        for t, code in zip(tensors, codes, strict=True):
            n = t.numel()
            if n == 0:
                continue
            target = t
            if not t.is_contiguous():
                target = t.contiguous() if accumulate else torch.empty(t.shape, dtype=t.dtype, device=t.device)
                strided.append((t, target))
            if not (plain and target.data_ptr() == src and t.dtype == flat.dtype):
                rows.append((src, target.data_ptr(), n, chunks, flat_code, code))
                chunks += -(-n // self._chunk)
            src += n * step
        self._scaled_copy(flat.device, rows, chunks, scale, accumulate)
        for t, temp in strided:
            t.copy_(temp)

    def norm_and_finite(self, flats: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        device = _check_flats(flats)
        rows, chunks, copies = [], 0, []
        for f in flats:
            n = f.numel()
            if n == 0:
                continue
            f = _contiguous(f, copies)
            rows.append((f.data_ptr(), n, chunks, DTYPE_CODES[f.dtype]))
            chunks += -(-n // self._chunk)
        stream = self._launcher.stream(device)
        table = self._table(device, stream, rows, REDUCE_ENTRY)
        partials = torch.empty(max(chunks, 1), dtype=torch.float64, device=device)
        norm = torch.empty((), dtype=torch.float32, device=device)
        finite = torch.empty((), dtype=torch.bool, device=device)
        if chunks:
            args = (_ptr(table), np.int64(len(rows)), np.int64(chunks), _ptr(partials))
            self._launch(device, stream, "fastpar_sum_squares", chunks, args)
        args = (_ptr(partials), np.int64(chunks), _ptr(norm), _ptr(finite))
        self._launcher.launch(device, stream, "fastpar_finish_norm", 1, self._threads, args)
        return norm, finite

    def _scaled_copy(self, device: torch.device, rows: list[tuple], chunks: int, scale: float, accumulate: bool):
        if not rows:
            return
        stream = self._launcher.stream(device)
        table = self._table(device, stream, rows, COPY_ENTRY)
        args = (_ptr(table), np.int64(len(rows)), np.int64(chunks), np.float32(scale), np.bool_(accumulate))
        self._launch(device, stream, "fastpar_scaled_copy", chunks, args)

    def _table(self, device: torch.device, stream: int, rows: list[tuple], layout: np.dtype) -> torch.Tensor | None:
        """The entry table on ``device`` (None when empty). Rows are in ``layout``'s field order, ``first_chunk``
        filled in by the caller (a running sum of ceil(numel / kChunkElems))."""
        if not rows:
            return None
        table = np.array(rows, dtype=layout)
        key = (device, stream, table.tobytes())
        uploaded = self._tables.get(key)
        if uploaded is None:
            if len(self._tables) >= _MAX_CACHED_TABLES:
                self._tables.clear()
            uploaded = self._tables[key] = self._launcher.upload(table, device)
        return uploaded

    def _launch(self, device: torch.device, stream: int, kernel: str, chunks: int, args: tuple) -> None:
        blocks = min(chunks, self._max_blocks)  # grid-stride beyond kMaxBlocks, as the nvcc launchers do
        self._launcher.launch(device, stream, kernel, blocks, self._threads, args)


def _dtype_codes(op: str, flat: torch.Tensor, tensors: Sequence[torch.Tensor], name: str) -> list[int]:
    """Each tensor's dtype code, after the checks of ``_torch_ops._check_list`` (whose messages it raises) in one
    pass: with hundreds of tensors per call, a second pass over them is a visible share of the call."""
    codes, device, total = [], flat.device, 0
    for t in tensors:
        code = DTYPE_CODES.get(getattr(t, "dtype", None))
        if code is None or not isinstance(t, torch.Tensor) or t.device != device:
            _check_list(op, flat, tensors, name)  # raises, naming the tensor and the fix
        codes.append(code)
        total += t.numel()
    if total > flat.numel():
        _check_list(op, flat, tensors, name)
    return codes


def _contiguous(t: torch.Tensor, copies: list[torch.Tensor]) -> torch.Tensor:
    """``t``, or a contiguous copy of it kept in ``copies`` until the launch: the table points at its memory."""
    if t.is_contiguous():
        return t
    copies.append(t.contiguous())
    return copies[-1]


def _ptr(tensor: torch.Tensor) -> np.uint64:
    return np.uint64(tensor.data_ptr())


class CupyLauncher:
    """Runs the NVRTC-built kernels through CuPy, on torch's current stream of each device."""

    def __init__(self):
        self._cupy = require("cupy", purpose="fastpar's CuPy kernel tier")
        self._modules: dict[str, Any] = {}  # cupy.RawModule per compile target
        self._kernels: dict[int, dict[str, Any]] = {}  # device index -> entry point -> cupy.RawKernel
        self._streams: dict[tuple[int, int], Any] = {}
        self._lock = threading.Lock()

    def prepare(self, device: torch.device) -> None:
        if device.index in self._kernels:
            return
        with self._lock:
            if device.index in self._kernels:
                return
            target = nvrtc.target_for(torch.cuda.get_device_capability(device))
            if target not in self._modules:
                self._modules[target] = self._cupy.RawModule(path=str(nvrtc.cached_kernels(target)))
            with self._cupy.cuda.Device(device.index):
                kernels = {name: self._modules[target].get_function(name) for name in nvrtc.ENTRY_POINTS}
            self._kernels[device.index] = kernels

    def stream(self, device: torch.device) -> int:
        return torch.cuda.current_stream(device).cuda_stream

    def upload(self, table: np.ndarray, device: torch.device) -> torch.Tensor:
        host = torch.empty(table.nbytes, dtype=torch.uint8, pin_memory=True)  # freed only after the copy ran
        host.numpy()[:] = table.view(np.uint8)
        return host.to(device, non_blocking=True)  # on the current stream, like the launch that reads it

    def launch(self, device: torch.device, stream: int, kernel: str, blocks: int, threads: int, args: tuple) -> None:
        self.prepare(device)
        key = (device.index, stream)
        cupy_stream = self._streams.get(key)
        if cupy_stream is None:
            cupy_stream = self._streams[key] = self._wrap_stream(device, stream)
        with self._cupy.cuda.Device(device.index):
            self._kernels[device.index][kernel]((blocks,), (threads,), args, stream=cupy_stream)

    def _wrap_stream(self, device: torch.device, handle: int) -> Any:
        cuda = self._cupy.cuda
        if hasattr(cuda.Stream, "from_external"):  # CuPy >= 14, where ExternalStream is deprecated
            current = torch.cuda.current_stream(device)
            assert current.cuda_stream == handle, "the current stream changed between table upload and launch"
            return cuda.Stream.from_external(current)
        return cuda.ExternalStream(handle, device.index)


def load() -> BucketKernels:
    """The tier, when this machine can run it. Compiles nothing yet (that happens per device on first use); raises
    ImportError or RuntimeError saying what is missing."""
    if torch.version.cuda is None:
        raise RuntimeError(f"torch {torch.__version__} is a CPU build")
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is visible")
    launcher = CupyLauncher()
    version = nvrtc.version()
    nvrtc.cuda_include_dir()  # fail now, with the fix, rather than at the first launch
    return BucketKernels(launcher, nvrtc_version=version)
