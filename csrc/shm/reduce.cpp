// Ordered sums for the same-host collectives: a chain of adds per element in gloo's ring order, each partial rounded
// to the element type exactly as gloo's reduce function does (fp32/fp64 adds; bf16 through c10::BFloat16's
// round-to-nearest-even; fp16 through c10::Half, which rounds like F16C except that every NaN becomes 0x7E00|sign).
// Work goes in L1-sized tiles so each pass is a simple vectorisable loop; at::parallel_for splits large ranges.
#include "shm/reduce.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "float_convert.h"
#include "shm/segment.h"
#include "text.h"

namespace fastpar::shm {
namespace {

constexpr int64_t kTile = 1024;  // elements per tile: 4 KB of fp32 accumulators stay in L1
constexpr int64_t kGrain = 32 * 1024;  // below this many elements a thread is not worth waking
constexpr size_t kCopyGrain = 256 * 1024;  // bytes
constexpr size_t kSegmentBytes = 1 << 20;  // gloo's AllreduceOptionsImpl::kMaxSegmentSize

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

std::atomic<int> max_threads{0};

// at::parallel_for splits a range into pieces of at least `grain`: a grain of len / threads caps the pieces.
int64_t capped_grain(int64_t len, int64_t grain) {
  const int threads = max_threads.load(std::memory_order_relaxed);
  return threads > 0 ? std::max(grain, ceil_div(len, threads)) : grain;
}

// How each dtype's tile is widened to the accumulator type, rounded after an add, and stored.
template <typename T>
struct Tile;

template <>
struct Tile<float> {
  using Acc = float;
  static void load(const float* src, float* acc, int64_t n) { std::memcpy(acc, src, n * sizeof(float)); }
  static void add(const float* src, float* acc, float*, int64_t n) {
    for (int64_t i = 0; i < n; ++i) acc[i] = src[i] + acc[i];  // gloo: own + received, in that order
  }
  static void divide(float* acc, int64_t n, int world) {
    const float d = static_cast<float>(world);
    for (int64_t i = 0; i < n; ++i) acc[i] = acc[i] / d;
  }
  static void store(const float* acc, float* dst, int64_t n) { std::memcpy(dst, acc, n * sizeof(float)); }
};

template <>
struct Tile<double> {
  using Acc = double;
  static void load(const double* src, double* acc, int64_t n) { std::memcpy(acc, src, n * sizeof(double)); }
  static void add(const double* src, double* acc, float*, int64_t n) {
    for (int64_t i = 0; i < n; ++i) acc[i] = src[i] + acc[i];
  }
  static void divide(double* acc, int64_t n, int world) {
    const double d = static_cast<double>(world);
    for (int64_t i = 0; i < n; ++i) acc[i] = acc[i] / d;
  }
  static void store(const double* acc, double* dst, int64_t n) { std::memcpy(dst, acc, n * sizeof(double)); }
};

inline float round_bf16(float value) { return bf16_to_float(float_to_bf16(value)); }

template <>
struct Tile<c10::BFloat16> {
  using Acc = float;
  static void load(const c10::BFloat16* src, float* acc, int64_t n) {
    const auto* bits = reinterpret_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) acc[i] = bf16_to_float(bits[i]);
  }
  static void add(const c10::BFloat16* src, float* acc, float*, int64_t n) {
    const auto* bits = reinterpret_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) acc[i] = round_bf16(bf16_to_float(bits[i]) + acc[i]);
  }
  static void divide(float* acc, int64_t n, int world) {
    const float d = static_cast<float>(world);
    for (int64_t i = 0; i < n; ++i) acc[i] = round_bf16(acc[i] / d);
  }
  static void store(const float* acc, c10::BFloat16* dst, int64_t n) {
    auto* bits = reinterpret_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) bits[i] = float_to_bf16(acc[i]);
  }
};

template <>
struct Tile<c10::Half> {
  using Acc = float;
  static void load(const c10::Half* src, float* acc, int64_t n) { half_to_float(src, acc, n); }
  static void add(const c10::Half* src, float* acc, float* scratch, int64_t n) {
    half_to_float(src, scratch, n);
    for (int64_t i = 0; i < n; ++i) acc[i] = scratch[i] + acc[i];
    round_to_half(acc, n);
  }
  static void divide(float* acc, int64_t n, int world) {
    const float d = static_cast<float>(world);
    for (int64_t i = 0; i < n; ++i) acc[i] = acc[i] / d;
    round_to_half(acc, n);
  }
  static void store(const float* acc, c10::Half* dst, int64_t n) {
    float_to_half(acc, dst, n);
    auto* bits = reinterpret_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) {
      // c10::Half (what gloo sums fp16 with in torch) makes every NaN 0x7E00 with its sign; F16C keeps the payload
      uint32_t wide;
      std::memcpy(&wide, &acc[i], sizeof(wide));
      if (acc[i] != acc[i]) bits[i] = static_cast<uint16_t>(0x7E00u | ((wide >> 16) & 0x8000u));
    }
  }
  // Each partial sum is a float16 in gloo: round the accumulators through float16 and back (NaNs stay NaNs).
  static void round_to_half(float* acc, int64_t n) {
    c10::Half halves[kTile];
    float_to_half(acc, halves, n);
    half_to_float(halves, acc, n);
  }
};

// Sum of `n` sources in the given order over `len` elements.
template <typename T>
inline __attribute__((always_inline)) void chain_sum_body(const T* const* src, int n, T* out, T* out2, int64_t len,
                                                          bool average, int world) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    if (n == 2 && !average) {  // the common case in one pass: memory-bound, no tile round trips
      for (int64_t i = 0; i < len; ++i) {
        const T value = src[1][i] + src[0][i];
        out[i] = value;
        if (out2 != nullptr) out2[i] = value;
      }
      return;
    }
  }
  using Acc = typename Tile<T>::Acc;
  Acc acc[kTile];
  float scratch[kTile];
  for (int64_t begin = 0; begin < len; begin += kTile) {
    const int64_t m = std::min(kTile, len - begin);
    Tile<T>::load(src[0] + begin, acc, m);
    for (int k = 1; k < n; ++k) Tile<T>::add(src[k] + begin, acc, scratch, m);
    if (average) Tile<T>::divide(acc, m, world);
    Tile<T>::store(acc, out + begin, m);  // after every read of the tile: out may be a source (in place)
    if (out2 != nullptr) Tile<T>::store(acc, out2 + begin, m);
  }
}

template <typename T>
void chain_sum_baseline(const T* const* src, int n, T* out, T* out2, int64_t len, bool average, int world) {
  chain_sum_body(src, n, out, out2, len, average, world);
}

#if defined(__x86_64__)
template <typename T>
__attribute__((target("avx2"))) void chain_sum_avx2(const T* const* src, int n, T* out, T* out2, int64_t len,
                                                     bool average, int world) {
  chain_sum_body(src, n, out, out2, len, average, world);
}
#endif

template <typename T>
void chain_sum(const T* const* src, int n, T* out, T* out2, int64_t len, bool average, int world) {
#if defined(__x86_64__)
  if (kHasAVX2) return chain_sum_avx2(src, n, out, out2, len, average, world);
#endif
  chain_sum_baseline(src, n, out, out2, len, average, world);
}

template <typename F>
void dispatch_reducible(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat:
      return f(float{});
    case at::kDouble:
      return f(double{});
    case at::kBFloat16:
      return f(c10::BFloat16{});
    case at::kHalf:
      return f(c10::Half{});
    default:
      TORCH_CHECK_TYPE(false, text("fastpar shm: cannot reduce dtype ", dtype));
  }
}

}  // namespace

RingOrder::RingOrder(int world, int64_t numel, size_t element_size) : world_(world), block_(numel) {
  if (world <= 1 || numel == 0) return;
  // The arithmetic of gloo's ring(): segments of at most kMaxSegmentSize bytes, at least two per rank, a whole
  // number per rank; a rank's block is its segments together.
  const auto es = static_cast<int64_t>(element_size);
  const int64_t total = numel * es;
  const int64_t max_segment = es * std::max<int64_t>(1, static_cast<int64_t>(kSegmentBytes) / es);
  const int64_t segments = ceil_div(std::max(ceil_div(total, max_segment), int64_t{2} * world), world) * world;
  const int64_t segment_bytes = ceil_div(ceil_div(total, segments), es) * es;
  block_ = segment_bytes * (segments / world) / es;
}

int RingOrder::first_rank(int64_t index) const {
  const auto block = static_cast<int>(index / block_);
  return (block - 1 + world_) % world_;
}

bool reducible(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 || dtype == at::kHalf;
}

void reduce_ordered(const void* const* src, void* out, void* out2, int64_t len, int64_t first, const RingOrder& order,
                    at::ScalarType dtype, bool average) {
  const int world = order.world();
  dispatch_reducible(dtype, [&](auto tag) {
    using T = decltype(tag);
    auto sum_range = [&](int64_t begin, int64_t end) {
      const T* chain[kMaxRanks];
      // Pieces that stay inside one ring block share one order: x[b-1], x[b-2], ..., x[b].
      while (begin < end) {
        const int64_t index = first + begin;
        const int64_t block_end = (index / order.block_elements() + 1) * order.block_elements() - first;
        const int64_t piece_end = std::min(end, block_end);
        const int start = order.first_rank(index);
        for (int k = 0; k < world; ++k) chain[k] = static_cast<const T*>(src[(start - k + world) % world]) + begin;
        chain_sum<T>(chain, world, static_cast<T*>(out) + begin, out2 ? static_cast<T*>(out2) + begin : nullptr,
                     piece_end - begin, average, world);
        begin = piece_end;
      }
    };
    // A list collective sums thousands of small pieces: below the grain, no parallel_for bookkeeping per piece.
    if (len <= kGrain) {
      sum_range(0, len);
    } else {
      at::parallel_for(0, len, capped_grain(len, kGrain), sum_range);
    }
  });
}

void copy_bytes(void* dst, const void* src, size_t bytes) {
  if (bytes == 0 || dst == src) return;
  if (bytes <= kCopyGrain) {  // one thread's worth (every piece of a list of small tensors): no parallel_for
    std::memcpy(dst, src, bytes);
    return;
  }
  const auto total = static_cast<int64_t>(bytes);
  at::parallel_for(0, total, capped_grain(total, kCopyGrain), [&](int64_t begin, int64_t end) {
    std::memcpy(static_cast<char*>(dst) + begin, static_cast<const char*>(src) + begin, end - begin);
  });
}

void set_summation_threads(int threads) { max_threads.store(std::max(0, threads), std::memory_order_relaxed); }

int summation_threads() { return max_threads.load(std::memory_order_relaxed); }

}  // namespace fastpar::shm
