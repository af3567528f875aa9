// CPU tensors as fastpar's same-host collectives take them: which tensors they handle, and a dense buffer over a
// tensor with the way back into it (shared by the one-host backend and its across-nodes form).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <string>
#include <vector>

#include "shm/collectives.h"
#include "shm/reduce.h"

namespace fastpar::shm {


inline bool sum_or_avg(const c10d::ReduceOp& op) {
  return op.op_ == c10d::ReduceOp::SUM || op.op_ == c10d::ReduceOp::AVG;
}

inline bool on_cpu(const at::Tensor& t) { return t.device().is_cpu() && t.layout() == at::kStrided; }

inline at::ScalarType real_dtype(const at::Tensor& t) {
  return t.is_complex() ? c10::toRealValueType(t.scalar_type()) : t.scalar_type();
}

inline bool reducible_tensor(const at::Tensor& t) { return on_cpu(t) && reducible(real_dtype(t)); }

inline bool same_dtype(const at::Tensor& a, const at::Tensor& b) { return a.scalar_type() == b.scalar_type(); }

// Which order a reduction sums a tensor's elements in. gloo reduces a CPU tensor's memory as it lies (numel elements
// from its data pointer), so a dense tensor that is not contiguous (a transposed weight) is summed in storage order,
// and at three ranks or more the order decides the last bits. A tensor with gaps (a strided slice) gloo cannot
// reduce at all; it gets a contiguous copy, summed in logical order.
enum class Order { kLogical, kStorage };

// A tensor the kernels work on, and the way its values get back into the caller's tensor. Complex tensors are
// viewed as real, as gloo does (so sums follow the same order). Detached (same storage and version counter): a
// collective writes into the tensor's memory outside autograd, as gloo does, so a non-contiguous leaf that requires
// grad (a transposed nn.Parameter) must not fail the copy back as an in-place autograd operation.
struct Dense {
  at::Tensor user;
  // `user` itself when contiguous; with Order::kStorage and a dense `user`, a 1-D view of its memory in storage
  // order; else a contiguous copy taken at call time.
  at::Tensor data;
  bool copied = false;
  bool reordered = false;  // data holds the elements in storage order, not in logical order

  explicit Dense(const at::Tensor& t, Order order = Order::kLogical)
      : user(t.is_complex() ? at::view_as_real(t.detach()) : t.detach()) {
    if (order == Order::kStorage && !user.is_contiguous() && user.is_non_overlapping_and_dense()) {
      data = user.as_strided({user.numel()}, {1});  // storage_offset is the lowest address: strides are positive
      reordered = true;
    } else {
      data = user.contiguous();
      copied = !data.is_same(user);
    }
  }
  char* ptr() const { return static_cast<char*>(data.data_ptr()); }
  int64_t numel() const { return data.numel(); }
  int64_t bytes() const { return data.numel() * static_cast<int64_t>(data.element_size()); }
  int32_t dtype() const { return static_cast<int32_t>(data.scalar_type()); }
  void write_back() const {
    if (copied) user.copy_(data);
  }
};

// Pairs (big[i], small[i]) of CPU tensors of one dtype, big holding `world` times small's elements: the shape of
// all_gather_into_tensor (output, input) and of reduce_scatter_tensor (input, output).
inline bool world_pairs(const std::vector<at::Tensor>& big, const std::vector<at::Tensor>& small, int world) {
  if (big.empty() || big.size() != small.size()) return false;
  for (size_t i = 0; i < big.size(); ++i) {
    if (!on_cpu(big[i]) || !on_cpu(small[i]) || !same_dtype(big[i], small[i]) ||
        big[i].numel() != small[i].numel() * world) {
      return false;
    }
  }
  return true;
}

inline std::vector<Dense> dense_all(const std::vector<at::Tensor>& tensors, Order order = Order::kLogical) {
  std::vector<Dense> out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) out.emplace_back(t, order);
  return out;
}

inline Reduction reduction_of(const Dense& t, const c10d::ReduceOp& op) {
  return {t.data.scalar_type(), op.op_ == c10d::ReduceOp::AVG};
}

inline std::string message_of(const std::exception& e) {
  if (const auto* error = dynamic_cast<const c10::Error*>(&e)) return error->what_without_backtrace();
  return e.what();
}

}  // namespace fastpar::shm
