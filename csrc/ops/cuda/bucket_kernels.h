// What the host (csrc/ops/cuda_glue.cpp through nvcc, or fastpar/ops/cupy_tier.py through NVRTC) and the device code agree
// on: dtype codes, the per-tensor entry tables, the launch shape, and the host API of the nvcc build. Torch-free, and
// NVRTC-safe: NVRTC has no standard library and compiles no host code, so those parts are behind __CUDACC_RTC__.
// fastpar/_nvrtc.py reads the `constexpr` numbers below from this file: keep them one per line, plain literals.
#pragma once

#ifdef __CUDACC_RTC__
typedef int int32_t;  // the widths of every 64-bit CUDA host; only sizes cross the host/device boundary
typedef long long int64_t;
typedef unsigned long long uintptr_t;
#else
#include <cuda_runtime_api.h>

#include <cstdint>
#endif

namespace fastpar::cuda {

enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Elements per multi-tensor-apply chunk (one thread block per chunk). Small enough that a single 1M-element
// tensor still spreads over ~128 blocks; large enough that per-chunk lookup costs are noise.
constexpr int64_t kChunkElems = 8192;
constexpr int kBlockThreads = 256;
constexpr int64_t kMaxBlocks = 65535;  // grid-stride beyond this; plenty to fill any GPU

// One tensor of a scaled copy: `numel` (> 0) elements from `src` to `dst`. `first_chunk` is the running sum of
// ceil(numel / kChunkElems) over the entries before it, so a block finds its entry by binary search.
struct CopyEntry {
  const void* src;
  void* dst;
  int64_t numel;
  int64_t first_chunk;
  DType src_dtype;
  DType dst_dtype;
};

// One buffer of a norm reduction; same `first_chunk` convention.
struct ReduceEntry {
  const void* data;
  int64_t numel;
  int64_t first_chunk;
  DType dtype;
};

// The tables are also written by numpy (fastpar/ops/cupy_tier.py): these sizes are checked on both sides.
constexpr int kCopyEntryBytes = 40;
constexpr int kReduceEntryBytes = 32;
static_assert(sizeof(CopyEntry) == kCopyEntryBytes, "CopyEntry layout changed: update fastpar/ops/cupy_tier.py");
static_assert(sizeof(ReduceEntry) == kReduceEntryBytes, "ReduceEntry layout changed: update fastpar/ops/cupy_tier.py");

#ifndef __CUDACC_RTC__
inline int64_t chunks_for(int64_t numel) { return (numel + kChunkElems - 1) / kChunkElems; }

// dst = round(float(src) * scale), or with `accumulate` round(float(dst) + float(src) * scale), for every entry.
// `entries` points to device memory holding `num_entries` entries covering `total_chunks` chunks. One launch.
cudaError_t launch_scaled_copy(const CopyEntry* entries, int64_t num_entries, int64_t total_chunks, float scale,
                               bool accumulate, cudaStream_t stream);

// Sum of squares per chunk into `partials` (device, total_chunks doubles), then a fixed-order sum into
// `norm` (sqrt, as float) and `all_finite`. Two launches, deterministic, no host sync.
cudaError_t launch_norm_and_finite(const ReduceEntry* entries, int64_t num_entries, int64_t total_chunks,
                                   double* partials, float* norm, bool* all_finite, cudaStream_t stream);
#endif

}  // namespace fastpar::cuda
