// Host API of the CUDA bucket kernels. Torch-free (raw pointers, a dtype enum, cudaStream_t) so the device code
// compiles standalone with nvcc; csrc/cuda_glue.cpp builds the tables from ATen tensors.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fastpar::cuda {

enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Elements per multi-tensor-apply chunk (one thread block per chunk). Small enough that a single 1M-element
// tensor still spreads over ~128 blocks; large enough that per-chunk lookup costs are noise.
constexpr int64_t kChunkElems = 8192;

inline int64_t chunks_for(int64_t numel) { return (numel + kChunkElems - 1) / kChunkElems; }

// One tensor of a scaled copy: `numel` (> 0) elements from `src` to `dst`. `first_chunk` is the running sum of
// chunks_for(numel) over the entries before it, so a block finds its entry by binary search.
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

// dst = round(float(src) * scale), or with `accumulate` round(float(dst) + float(src) * scale), for every entry.
// `entries` points to device memory holding `num_entries` entries covering `total_chunks` chunks. One launch.
cudaError_t launch_scaled_copy(const CopyEntry* entries, int64_t num_entries, int64_t total_chunks, float scale,
                               bool accumulate, cudaStream_t stream);

// Sum of squares per chunk into `partials` (device, total_chunks doubles), then a fixed-order sum into
// `norm` (sqrt, as float) and `all_finite`. Two launches, deterministic, no host sync.
cudaError_t launch_norm_and_finite(const ReduceEntry* entries, int64_t num_entries, int64_t total_chunks,
                                   double* partials, float* norm, bool* all_finite, cudaStream_t stream);

}  // namespace fastpar::cuda
