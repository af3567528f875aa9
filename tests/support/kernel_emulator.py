"""A CPU stand-in for the GPU under fastpar's CuPy tier, so its host half runs in CI without one.

:class:`EmulatedLauncher` takes the place of ``fastpar.ops.cupy_tier.CupyLauncher``: it interprets the entry tables the
tier writes chunk by chunk, as ``csrc/ops/cuda/bucket_kernels.cu`` does (a block per chunk, its entry found by binary
search over ``first_chunk``), reading and writing memory through the raw pointers in them. Wrong pointers, counts,
dtype codes or chunk bookkeeping in the tables therefore give wrong results in the tests, as they would on a GPU.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from fastpar.ops import cupy_tier, nvrtc

TORCH_DTYPES = {code: dtype for dtype, code in cupy_tier.DTYPE_CODES.items()}


def memory(address: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``numel`` elements of ``dtype`` at ``address``, as a tensor sharing that memory."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=dtype)


def table_at(address: int, count: int, layout: np.dtype) -> np.ndarray:
    return np.frombuffer((ctypes.c_char * (count * layout.itemsize)).from_address(address), dtype=layout)


class EmulatedLauncher:
    """Runs the kernels' semantics on CPU memory; records every upload and launch for the tests."""

    def __init__(self):
        self.uploads = 0
        self.launches: list[tuple[str, int, int]] = []  # (kernel, blocks, threads)
        self.chunk = nvrtc.abi()["kChunkElems"]

    def prepare(self, device: torch.device) -> None:
        pass

    def stream(self, device: torch.device) -> int:
        return 0

    def upload(self, table: np.ndarray, device: torch.device) -> torch.Tensor:
        self.uploads += 1
        return torch.from_numpy(table.view(np.uint8).copy())

    def launch(self, device: torch.device, stream: int, kernel: str, blocks: int, threads: int, args: tuple) -> None:
        self.launches.append((kernel, blocks, threads))
        getattr(self, kernel)(*args)

    def _chunks(self, entries: np.ndarray, total_chunks: int):
        """(entry, chunk, begin, count) per chunk, as multi_tensor_apply hands them to the op. The chunk bookkeeping
        is checked first: a wrong table would make the emulation write outside the tensors (on a GPU, too)."""
        per_entry = (entries["numel"] + self.chunk - 1) // self.chunk
        assert (entries["numel"] > 0).all(), "an entry has no elements"
        assert (entries["first_chunk"] == np.cumsum(per_entry) - per_entry).all(), "first_chunk is not a running sum"
        assert total_chunks == per_entry.sum(), f"total_chunks {total_chunks} != {per_entry.sum()} chunks in the table"
        for chunk in range(total_chunks):
            entry = entries[np.searchsorted(entries["first_chunk"], chunk, side="right") - 1]
            begin = (chunk - int(entry["first_chunk"])) * self.chunk
            count = min(self.chunk, int(entry["numel"]) - begin)
            assert count > 0, f"chunk {chunk} lies past the end of its entry: bad first_chunk or numel"
            yield entry, chunk, begin, count

    def fastpar_scaled_copy(self, entries_ptr, num_entries, total_chunks, scale, accumulate):
        entries = table_at(int(entries_ptr), int(num_entries), cupy_tier.COPY_ENTRY)
        for entry, _, begin, count in self._chunks(entries, int(total_chunks)):
            src_type, dst_type = TORCH_DTYPES[int(entry["src_dtype"])], TORCH_DTYPES[int(entry["dst_dtype"])]
            src = memory(int(entry["src"]) + begin * src_type.itemsize, count, src_type)
            dst = memory(int(entry["dst"]) + begin * dst_type.itemsize, count, dst_type)
            value = src.float() * float(np.float32(scale))  # fp32 math, one rounding, as the kernel
            if accumulate:
                value = dst.float() + value
            dst.copy_(value.to(dst_type))

    def fastpar_sum_squares(self, entries_ptr, num_entries, total_chunks, partials_ptr):
        entries = table_at(int(entries_ptr), int(num_entries), cupy_tier.REDUCE_ENTRY)
        partials = memory(int(partials_ptr), int(total_chunks), torch.float64)
        for entry, chunk, begin, count in self._chunks(entries, int(total_chunks)):
            dtype = TORCH_DTYPES[int(entry["dtype"])]
            partials[chunk] = memory(int(entry["data"]) + begin * dtype.itemsize, count, dtype).double().square().sum()

    def fastpar_finish_norm(self, partials_ptr, count, norm_ptr, finite_ptr):
        total = (
            memory(int(partials_ptr), int(count), torch.float64).sum()
            if int(count)
            else torch.zeros((), dtype=torch.float64)
        )
        memory(int(norm_ptr), 1, torch.float32)[0] = total.sqrt().float()
        memory(int(finite_ptr), 1, torch.bool)[0] = bool(torch.isfinite(total))


def emulated_tier() -> tuple[cupy_tier.BucketKernels, EmulatedLauncher]:
    launcher = EmulatedLauncher()
    return cupy_tier.BucketKernels(launcher, nvrtc_version="emulated"), launcher
