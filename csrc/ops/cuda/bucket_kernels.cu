// CUDA bucket kernels: scaled copy (pack/unpack) and norm_and_finite, each one multi-tensor-apply launch.
// One device source, two compilers: nvcc builds it into fastpar._C (with the host launchers at the end), and NVRTC
// compiles the same file at run time for the CuPy tier (fastpar/_nvrtc.py), which sees no host code and finds the
// kernels by their extern "C" names. Both build with --fmad=false: a fused multiply-add would round differently
// from the CPU reference.
#include "dtype_dispatch.cuh"
#include "multi_tensor_apply.cuh"

namespace fastpar::cuda {
namespace {

template <typename Src, typename Dst, bool kAccumulate>
__device__ __forceinline__ Dst scaled(Src x, Dst old, float scale) {
  float value = to_float(x) * scale;
  if constexpr (kAccumulate) value = to_float(old) + value;
  return from_float<Dst>(value);
}

// Vector width: 16-byte accesses on the wider of the two types (fp32 x4; fp16/bf16 x8 when both are 16-bit).
template <typename Src, typename Dst>
__host__ __device__ constexpr int vec_width() {
  return 16 / (sizeof(Src) > sizeof(Dst) ? sizeof(Src) : sizeof(Dst));
}

// No __restrict__: src and dst are the same memory when a tensor is scaled in place.
template <typename Src, typename Dst, bool kAccumulate>
__device__ void copy_chunk(const Src* src, Dst* dst, int64_t n, float scale) {
  constexpr int kVec = vec_width<Src, Dst>();
  int64_t done = 0;
  if (is_aligned<kVec>(src) && is_aligned<kVec>(dst)) {
    const int64_t vecs = n / kVec;
    const auto* src_vec = reinterpret_cast<const AlignedVec<Src, kVec>*>(src);
    auto* dst_vec = reinterpret_cast<AlignedVec<Dst, kVec>*>(dst);
    for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) {
      const AlignedVec<Src, kVec> in = src_vec[v];
      AlignedVec<Dst, kVec> out;
      if constexpr (kAccumulate) out = dst_vec[v];
#pragma unroll
      for (int k = 0; k < kVec; ++k) out.v[k] = scaled<Src, Dst, kAccumulate>(in.v[k], out.v[k], scale);
      dst_vec[v] = out;
    }
    done = vecs * kVec;
  }
  for (int64_t i = done + threadIdx.x; i < n; i += blockDim.x) {
    dst[i] = scaled<Src, Dst, kAccumulate>(src[i], kAccumulate ? dst[i] : Dst(), scale);
  }
}

struct ScaledCopyOp {
  float scale;
  bool accumulate;

  __device__ void operator()(const CopyEntry& entry, int64_t /*chunk*/, int64_t begin, int64_t n) const {
    FASTPAR_DISPATCH_DTYPE(entry.src_dtype, Src, FASTPAR_DISPATCH_DTYPE(entry.dst_dtype, Dst, {
      const Src* src = static_cast<const Src*>(entry.src) + begin;
      Dst* dst = static_cast<Dst*>(entry.dst) + begin;
      if (accumulate) {
        copy_chunk<Src, Dst, true>(src, dst, n, scale);
      } else {
        copy_chunk<Src, Dst, false>(src, dst, n, scale);
      }
    }))
  }
};

// Sum over the block in a fixed order (deterministic); the result is valid in thread 0.
__device__ double block_sum(double value) {
  __shared__ double warp_sums[kBlockThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_down_sync(0xffffffffu, value, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_sums[warp] = value;
  __syncthreads();
  if (warp == 0) {
    value = lane < kBlockThreads / 32 ? warp_sums[lane] : 0.0;
    for (int offset = 16; offset > 0; offset /= 2) value += __shfl_down_sync(0xffffffffu, value, offset);
  }
  __syncthreads();  // warp_sums may be reused by the next call
  return value;
}

// Squares are summed in double: fp32 squares overflow at |x| > 1.8e19, and the reference sums in double.
template <typename T>
__device__ double thread_sum_squares(const T* data, int64_t n) {
  constexpr int kVec = 16 / sizeof(T);
  double sum = 0.0;
  int64_t done = 0;
  if (is_aligned<kVec>(data)) {
    const int64_t vecs = n / kVec;
    const auto* data_vec = reinterpret_cast<const AlignedVec<T, kVec>*>(data);
    for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) {
      const AlignedVec<T, kVec> in = data_vec[v];
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const double x = to_float(in.v[k]);
        sum += x * x;
      }
    }
    done = vecs * kVec;
  }
  for (int64_t i = done + threadIdx.x; i < n; i += blockDim.x) {
    const double x = to_float(data[i]);
    sum += x * x;
  }
  return sum;
}

struct SumSquaresOp {
  double* partials;

  __device__ void operator()(const ReduceEntry& entry, int64_t chunk, int64_t begin, int64_t n) const {
    double sum = 0.0;
    FASTPAR_DISPATCH_DTYPE(entry.dtype, T, sum = thread_sum_squares(static_cast<const T*>(entry.data) + begin, n))
    sum = block_sum(sum);
    if (threadIdx.x == 0) partials[chunk] = sum;
  }
};

// Squares of finite values cannot overflow a double sum, so the total is finite iff every element is.
__device__ void finish_norm(const double* partials, int64_t count, float* norm, bool* all_finite) {
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) sum += partials[i];
  sum = block_sum(sum);
  if (threadIdx.x == 0) {
    *norm = static_cast<float>(sqrt(sum));
    *all_finite = isfinite(sum);
  }
}

}  // namespace
}  // namespace fastpar::cuda

// Kernel entry points, launched with kBlockThreads threads per block: explicit instantiations of the templates above
// under unmangled names, so an NVRTC module is looked up by name. The nvcc launchers below launch the same kernels.
extern "C" __global__ void __launch_bounds__(fastpar::cuda::kBlockThreads)
    fastpar_scaled_copy(const fastpar::cuda::CopyEntry* entries, int64_t num_entries, int64_t total_chunks,
                        float scale, bool accumulate) {
  fastpar::cuda::multi_tensor_apply(entries, num_entries, total_chunks, fastpar::cuda::ScaledCopyOp{scale, accumulate});
}

extern "C" __global__ void __launch_bounds__(fastpar::cuda::kBlockThreads)
    fastpar_sum_squares(const fastpar::cuda::ReduceEntry* entries, int64_t num_entries, int64_t total_chunks,
                        double* partials) {
  fastpar::cuda::multi_tensor_apply(entries, num_entries, total_chunks, fastpar::cuda::SumSquaresOp{partials});
}

// One block: a fixed-order sum of the per-chunk partials (deterministic).
extern "C" __global__ void __launch_bounds__(fastpar::cuda::kBlockThreads)
    fastpar_finish_norm(const double* partials, int64_t count, float* norm, bool* all_finite) {
  fastpar::cuda::finish_norm(partials, count, norm, all_finite);
}

#ifndef __CUDACC_RTC__
namespace fastpar::cuda {
namespace {

unsigned grid_blocks(int64_t total_chunks) {
  return static_cast<unsigned>(total_chunks < kMaxBlocks ? total_chunks : kMaxBlocks);
}

}  // namespace

cudaError_t launch_scaled_copy(const CopyEntry* entries, int64_t num_entries, int64_t total_chunks, float scale,
                               bool accumulate, cudaStream_t stream) {
  if (total_chunks == 0) return cudaSuccess;
  fastpar_scaled_copy<<<grid_blocks(total_chunks), kBlockThreads, 0, stream>>>(entries, num_entries, total_chunks,
                                                                                 scale, accumulate);
  return cudaGetLastError();
}

cudaError_t launch_norm_and_finite(const ReduceEntry* entries, int64_t num_entries, int64_t total_chunks,
                                   double* partials, float* norm, bool* all_finite, cudaStream_t stream) {
  if (total_chunks > 0) {
    fastpar_sum_squares<<<grid_blocks(total_chunks), kBlockThreads, 0, stream>>>(entries, num_entries, total_chunks,
                                                                                 partials);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  fastpar_finish_norm<<<1, kBlockThreads, 0, stream>>>(partials, total_chunks, norm, all_finite);
  return cudaGetLastError();
}

}  // namespace fastpar::cuda
#endif  // __CUDACC_RTC__
