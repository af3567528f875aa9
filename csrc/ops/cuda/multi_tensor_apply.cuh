// Multi-tensor apply (after NVIDIA apex): one launch covers every chunk of every tensor. Tensor metadata sits in
// a device table of entries with a running chunk count (`first_chunk`); each block finds its entry by binary
// search, so 10,000 tiny tensors are still one launch and the table has no size limit.
// Device code only: the kernels in bucket_kernels.cu call it, and nvcc or NVRTC compiles them.
#pragma once

#include "bucket_kernels.h"

namespace fastpar::cuda {

// N elements of T in one aligned access: 16 bytes for fp32 x4 or fp16 x8.
template <typename T, int N>
struct alignas(sizeof(T) * N) AlignedVec {
  T v[N];
};

template <int N, typename T>
__device__ __forceinline__ bool is_aligned(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % (sizeof(T) * N) == 0;
}

// Index of the entry whose chunks contain `chunk`: the last entry with first_chunk <= chunk.
template <typename Entry>
__device__ int64_t find_entry(const Entry* entries, int64_t num_entries, int64_t chunk) {
  int64_t lo = 0, hi = num_entries - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (entries[mid].first_chunk <= chunk) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Body of a multi-tensor kernel launched with kBlockThreads threads: calls op(entry, chunk_index, begin, count) once
// per chunk, from all threads of the block that owns it.
template <typename Entry, typename Op>
__device__ __forceinline__ void multi_tensor_apply(const Entry* entries, int64_t num_entries, int64_t total_chunks,
                                                   const Op& op) {
  __shared__ int64_t entry_index;
  for (int64_t chunk = blockIdx.x; chunk < total_chunks; chunk += gridDim.x) {
    if (threadIdx.x == 0) entry_index = find_entry(entries, num_entries, chunk);
    __syncthreads();
    const Entry& entry = entries[entry_index];
    const int64_t begin = (chunk - entry.first_chunk) * kChunkElems;
    op(entry, chunk, begin, min(kChunkElems, entry.numel - begin));
    __syncthreads();  // entry_index is rewritten for the next chunk
  }
}

}  // namespace fastpar::cuda
