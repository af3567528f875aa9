// Device-agnostic description of the bucket ops, shared by the bindings and the CPU/CUDA kernels.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>
#include <vector>

namespace fastpar {

// `numel` elements read from `src` (dtype `src_type`), scaled and written to `dst` (dtype `dst_type`).
// Both are contiguous; `dst` may equal `src` (in place) but may not partially overlap it.
struct CopySpan {
  const void* src;
  void* dst;
  int64_t numel;
  at::ScalarType src_type;
  at::ScalarType dst_type;
};

// A contiguous buffer of `numel` elements whose squares are summed.
struct ReduceSpan {
  const void* data;
  int64_t numel;
  at::ScalarType type;
};

// dst = round(float(src) * scale), or round(float(dst) + float(src) * scale) with `accumulate`.
void scaled_copy_cpu(const std::vector<CopySpan>& spans, float scale, bool accumulate);
// (L2 norm as fp32 0-d, all-finite as bool 0-d); summation order is fixed, so results are deterministic.
std::tuple<at::Tensor, at::Tensor> norm_and_finite_cpu(const std::vector<ReduceSpan>& spans);

#ifdef FASTPAR_WITH_CUDA
// Same contracts on `device`, enqueued on its current CUDA stream; one multi-tensor launch, no host sync.
void scaled_copy_cuda(const std::vector<CopySpan>& spans, float scale, bool accumulate, at::Device device);
std::tuple<at::Tensor, at::Tensor> norm_and_finite_cuda(const std::vector<ReduceSpan>& spans, at::Device device);
#endif

}  // namespace fastpar
