// CPU kernels: one at::parallel_for over all elements of all tensors, so many tiny tensors cost no more than
// one large one. Needs -fopenmp when torch's parallel backend is OpenMP, else the loop runs on one thread.
#include <ATen/Parallel.h>
#include <ATen/ops/scalar_tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "ops/bucket_ops.h"
#include "float_convert.h"
#include "text.h"

namespace fastpar {
namespace {

// Below this many elements a thread is not worth waking (a few hundred KB of traffic).
constexpr int64_t kCopyGrain = 64 * 1024;
// Norm partial sums are taken over fixed blocks, so the summation order does not depend on the thread count.
constexpr int64_t kNormBlock = 64 * 1024;

template <typename F>
void dispatch_dtype(at::ScalarType type, F&& f) {
  switch (type) {
    case at::kFloat:
      f(float{});
      break;
    case at::kHalf:
      f(c10::Half{});
      break;
    case at::kBFloat16:
      f(c10::BFloat16{});
      break;
    default:
      TORCH_CHECK_TYPE(false, text("fastpar: unsupported dtype ", type));
  }
}

// One fused loop for fp32/bf16 pairs (no intermediate buffer). Per element it reads src and dst before writing
// dst, so src == dst (in place) is safe.
template <typename Src, typename Dst, bool kAccumulate>
inline __attribute__((always_inline)) void fused_body(const Src* src, Dst* dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) {
    float value = load_float(src + i) * scale;
    if constexpr (kAccumulate) value = load_float(dst + i) + value;
    store_float(dst + i, value);
  }
}

template <typename Src, typename Dst, bool kAccumulate>
void fused_baseline(const Src* src, Dst* dst, int64_t n, float scale) {
  fused_body<Src, Dst, kAccumulate>(src, dst, n, scale);
}

#if defined(__x86_64__)
// AVX2 clone chosen at run time (kHasAVX2, float_convert.h).
template <typename Src, typename Dst, bool kAccumulate>
__attribute__((target("avx2"))) void fused_avx2(const Src* src, Dst* dst, int64_t n, float scale) {
  fused_body<Src, Dst, kAccumulate>(src, dst, n, scale);
}
#endif

template <typename Src, typename Dst, bool kAccumulate>
void fused(const Src* src, Dst* dst, int64_t n, float scale) {
#if defined(__x86_64__)
  if (kHasAVX2) return fused_avx2<Src, Dst, kAccumulate>(src, dst, n, scale);
#endif
  fused_baseline<Src, Dst, kAccumulate>(src, dst, n, scale);
}

template <typename T>
void to_float(const T* src, float* out, int64_t n) {
  if constexpr (std::is_same_v<T, c10::Half>) {
    half_to_float(src, out, n);
  } else {
    fused<Storage<T>, float, false>(reinterpret_cast<const Storage<T>*>(src), out, n, 1.0f);
  }
}

template <typename T>
void from_float(const float* in, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, c10::Half>) {
    float_to_half(in, dst, n);
  } else {
    fused<float, Storage<T>, false>(in, reinterpret_cast<Storage<T>*>(dst), n, 1.0f);
  }
}

// Multiply, add and round exactly like the pure-torch reference (no FMA: -ffp-contract=off). fp32/bf16 pairs are
// one fused loop; pairs with fp16 go through an L1-sized fp32 block so each step is a simple vectorisable loop.
template <typename Src, typename Dst, bool kAccumulate>
void convert(const Src* src, Dst* dst, int64_t n, float scale) {
  if constexpr (std::is_same_v<Src, float> && std::is_same_v<Dst, float>) {
    // Memory-bound, so the baseline-ISA loop inlined here is as fast as the AVX2 clone and saves a call per tensor.
    fused_body<float, float, kAccumulate>(src, dst, n, scale);
  } else if constexpr (!std::is_same_v<Src, c10::Half> && !std::is_same_v<Dst, c10::Half>) {
    fused<Storage<Src>, Storage<Dst>, kAccumulate>(reinterpret_cast<const Storage<Src>*>(src),
                                                   reinterpret_cast<Storage<Dst>*>(dst), n, scale);
  } else {
    constexpr int64_t kBlock = 512;
    float value[kBlock];
    float old[kBlock];
    for (int64_t begin = 0; begin < n; begin += kBlock) {
      const int64_t m = std::min(kBlock, n - begin);
      to_float(src + begin, value, m);
      for (int64_t i = 0; i < m; ++i) value[i] = value[i] * scale;
      if constexpr (kAccumulate) {
        to_float(dst + begin, old, m);
        for (int64_t i = 0; i < m; ++i) value[i] = old[i] + value[i];
      }
      from_float(value, dst + begin, m);  // after all reads of the block: src may be dst (in place)
    }
  }
}

void copy_range(const CopySpan& span, int64_t begin, int64_t end, float scale, bool accumulate) {
  const int64_t n = end - begin;
  if (span.src_type == span.dst_type && scale == 1.0f && !accumulate) {
    if (span.src == span.dst) return;  // the tensor is already a view of the bucket
    // fp32 takes the multiply loop below (x * 1.0f is exact): measured here ~20% faster than glibc's memcpy on
    // 4 MB tensors, where memcpy switches to non-temporal stores.
    if (span.src_type != at::kFloat) {
      const size_t size = c10::elementSize(span.src_type);
      std::memcpy(static_cast<char*>(span.dst) + begin * size, static_cast<const char*>(span.src) + begin * size,
                  n * size);
      return;
    }
  }
  dispatch_dtype(span.src_type, [&](auto src_tag) {
    using Src = decltype(src_tag);
    dispatch_dtype(span.dst_type, [&](auto dst_tag) {
      using Dst = decltype(dst_tag);
      const Src* src = static_cast<const Src*>(span.src) + begin;
      Dst* dst = static_cast<Dst*>(span.dst) + begin;
      if (accumulate) {
        convert<Src, Dst, true>(src, dst, n, scale);
      } else {
        convert<Src, Dst, false>(src, dst, n, scale);
      }
    });
  });
}

template <typename T>
double sum_of_squares(const T* data, int64_t n) {
  // Eight independent accumulators let the compiler vectorise a reduction it may not reorder.
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int k = 0; k < 8; ++k) {
      const double v = static_cast<float>(data[i + k]);
      acc[k] += v * v;
    }
  }
  for (; i < n; ++i) {
    const double v = static_cast<float>(data[i]);
    acc[0] += v * v;
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// starts[i] = first global element of span i; starts.back() = total.
template <typename Span>
std::vector<int64_t> span_starts(const std::vector<Span>& spans) {
  std::vector<int64_t> starts(spans.size() + 1, 0);
  for (size_t i = 0; i < spans.size(); ++i) starts[i + 1] = starts[i] + spans[i].numel;
  return starts;
}

// Calls fn(span_index, begin_in_span, end_in_span) for each piece of the global range [begin, end).
template <typename Fn>
void for_each_piece(const std::vector<int64_t>& starts, int64_t begin, int64_t end, Fn&& fn) {
  size_t i = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1;
  for (; begin < end; ++i) {
    const int64_t piece_end = std::min(end, starts[i + 1]);
    if (piece_end > begin) fn(i, begin - starts[i], piece_end - starts[i]);
    begin = std::max(begin, piece_end);
  }
}

}  // namespace

void scaled_copy_cpu(const std::vector<CopySpan>& spans, float scale, bool accumulate) {
  const std::vector<int64_t> starts = span_starts(spans);
  at::parallel_for(0, starts.back(), kCopyGrain, [&](int64_t begin, int64_t end) {
    for_each_piece(starts, begin, end,
                   [&](size_t i, int64_t lo, int64_t hi) { copy_range(spans[i], lo, hi, scale, accumulate); });
  });
}

std::tuple<at::Tensor, at::Tensor> norm_and_finite_cpu(const std::vector<ReduceSpan>& spans) {
  const std::vector<int64_t> starts = span_starts(spans);
  const int64_t blocks = (starts.back() + kNormBlock - 1) / kNormBlock;
  std::vector<double> partial(blocks, 0.0);
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      double sum = 0.0;
      for_each_piece(starts, b * kNormBlock, std::min(starts.back(), (b + 1) * kNormBlock),
                     [&](size_t i, int64_t lo, int64_t hi) {
                       dispatch_dtype(spans[i].type, [&](auto tag) {
                         using T = decltype(tag);
                         sum += sum_of_squares(static_cast<const T*>(spans[i].data) + lo, hi - lo);
                       });
                     });
      partial[b] = sum;
    }
  });
  double total = 0.0;
  for (double p : partial) total += p;
  // Squares of finite fp32 values cannot overflow a double sum, so the sum is finite iff every element is.
  at::Tensor norm = at::scalar_tensor(static_cast<float>(std::sqrt(total)), at::kFloat);
  at::Tensor finite = at::scalar_tensor(std::isfinite(total), at::kBool);
  return {norm, finite};
}

}  // namespace fastpar
