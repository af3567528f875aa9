// ATen glue for the CUDA kernels in csrc/ops/cuda: builds the per-tensor tables, uploads them through pinned memory
// and launches on the current stream. Compiled only into CUDA builds; no host synchronisation anywhere.
#ifdef FASTPAR_WITH_CUDA

// c10/cuda only: ATen/cuda/CUDAContext.h pulls in cuSPARSE/cuBLAS headers that a minimal toolkit lacks.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstring>

#include "ops/bucket_ops.h"
#include "text.h"
#include "ops/cuda/bucket_kernels.h"

namespace fastpar {
namespace {

cuda::DType to_cuda_dtype(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return cuda::DType::kFloat32;
    case at::kHalf:
      return cuda::DType::kFloat16;
    case at::kBFloat16:
      return cuda::DType::kBFloat16;
    default:
      TORCH_CHECK_TYPE(false, text("fastpar: unsupported dtype ", type));
  }
}

// Copies the table to the device asynchronously: the pinned block is kept by torch's host allocator until the
// copy on the current stream is done, and the device block is stream-ordered, so neither needs a sync.
template <typename Entry>
at::Tensor upload_table(const std::vector<Entry>& table, at::Device device) {
  const int64_t bytes = static_cast<int64_t>(table.size() * sizeof(Entry));
  at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), table.data(), bytes);
  return host.to(at::TensorOptions().device(device), /*non_blocking=*/true);
}

}  // namespace

void scaled_copy_cuda(const std::vector<CopySpan>& spans, float scale, bool accumulate, at::Device device) {
  const c10::cuda::CUDAGuard guard(device);
  std::vector<cuda::CopyEntry> table;
  table.reserve(spans.size());
  int64_t chunks = 0;
  for (const CopySpan& span : spans) {
    const bool identity = span.src_type == span.dst_type && scale == 1.0f && !accumulate;
    if (identity && span.src == span.dst) continue;  // the tensor is already a view of the bucket
    table.push_back({span.src, span.dst, span.numel, chunks, to_cuda_dtype(span.src_type),
                     to_cuda_dtype(span.dst_type)});
    chunks += cuda::chunks_for(span.numel);
  }
  if (table.empty()) return;
  const at::Tensor entries = upload_table(table, device);
  C10_CUDA_CHECK(cuda::launch_scaled_copy(static_cast<const cuda::CopyEntry*>(entries.const_data_ptr()),
                                          static_cast<int64_t>(table.size()), chunks, scale, accumulate,
                                          c10::cuda::getCurrentCUDAStream()));
}

std::tuple<at::Tensor, at::Tensor> norm_and_finite_cuda(const std::vector<ReduceSpan>& spans, at::Device device) {
  const c10::cuda::CUDAGuard guard(device);
  std::vector<cuda::ReduceEntry> table;
  table.reserve(spans.size());
  int64_t chunks = 0;
  for (const ReduceSpan& span : spans) {
    table.push_back({span.data, span.numel, chunks, to_cuda_dtype(span.type)});
    chunks += cuda::chunks_for(span.numel);
  }
  const auto options = at::TensorOptions().device(device);
  at::Tensor partials = at::empty({std::max<int64_t>(chunks, 1)}, options.dtype(at::kDouble));
  at::Tensor norm = at::empty({}, options.dtype(at::kFloat));
  at::Tensor all_finite = at::empty({}, options.dtype(at::kBool));
  const at::Tensor entries = table.empty() ? at::Tensor() : upload_table(table, device);
  const auto* entry_ptr = entries.defined() ? static_cast<const cuda::ReduceEntry*>(entries.const_data_ptr()) : nullptr;
  C10_CUDA_CHECK(cuda::launch_norm_and_finite(entry_ptr, static_cast<int64_t>(table.size()), chunks,
                                              partials.data_ptr<double>(), norm.data_ptr<float>(),
                                              all_finite.data_ptr<bool>(), c10::cuda::getCurrentCUDAStream()));
  return {norm, all_finite};
}

}  // namespace fastpar

#endif  // FASTPAR_WITH_CUDA
