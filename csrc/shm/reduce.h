// The reduction of fastpar's same-host collectives, in gloo's summation order so results are bit-identical to gloo.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstddef>
#include <cstdint>

namespace fastpar::shm {

// Which rank's value a sum starts from, per element, in gloo's ring all-reduce (gloo/allreduce.cc, ring()): the
// buffer is cut into world-size blocks of whole 1 MiB-bounded segments; block b is reduced along the ring starting
// at rank b-1, so its sum is x[b-1], then x[b-2] + that, ..., x[b] + that (ranks mod world), each partial rounded to
// the element type. Every rank computes the same order, so every rank holds the same bits.
class RingOrder {
 public:
  RingOrder(int world, int64_t numel, size_t element_size);
  int world() const { return world_; }
  int64_t block_elements() const { return block_; }
  int first_rank(int64_t index) const;  // the rank the sum of element `index` starts from

 private:
  int world_;
  int64_t block_;
};

// float32, float64, bfloat16, float16: the dtypes the shared-memory path reduces (others go to gloo).
bool reducible(at::ScalarType dtype);

// out[i] = sum over ranks q of src[q][i] for i < len, where element i is element `first + i` of the all-reduce
// `order` describes; with `average`, then divided by the world size (as gloo's sum followed by `/= world`).
// `out2`, when not null, gets the same values. `out` may be src[q] (in place). Multithreaded with at::parallel_for.
void reduce_ordered(const void* const* src, void* out, void* out2, int64_t len, int64_t first, const RingOrder& order,
                    at::ScalarType dtype, bool average);

// memcpy split over at::parallel_for threads for large copies.
void copy_bytes(void* dst, const void* src, size_t bytes);

// The most threads one reduce_ordered or copy_bytes splits over; 0 (the default): torch's intra-op thread count.
// Process-wide, because it is this process's share of the cores whichever group reduces: with as many ranks as
// cores, a summation thread only takes the core of another rank's compute thread, so the reduction runs inline.
void set_summation_threads(int threads);
int summation_threads();

}  // namespace fastpar::shm
