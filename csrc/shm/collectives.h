// Same-host collectives on raw CPU buffers, through a Group's shared-memory slots. Every rank calls the same
// function with matching sizes (checked at the first step). Buffers are contiguous; pointers may alias only where
// stated. Each call takes `timeout` for its waits (0: the group's).
#pragma once

#include <c10/core/ScalarType.h>

#include <chrono>
#include <cstdint>
#include <vector>

#include "shm/group.h"

namespace fastpar::shm {

struct Reduction {
  at::ScalarType dtype;
  bool average;  // sum, then divide by the world size
};

// One contiguous buffer of a list collective: `numel` elements from `data`.
struct Span {
  char* data;
  int64_t numel;
};

// data (numel elements) becomes the sum over ranks, in place; the same bits on every rank, equal to gloo's.
void all_reduce(Group& group, void* data, int64_t numel, Reduction reduction, std::chrono::milliseconds timeout);
// The same over the concatenation of `spans` (all of `reduction.dtype`), each reduced where it lies: staged straight
// from the spans and summed straight into them, so a list costs what one buffer of its total size costs (no pack
// into a flat buffer, no unpack), with the bits of an all-reduce of the concatenation (gloo's allreduce_coalesced).
void all_reduce(Group& group, const std::vector<Span>& spans, Reduction reduction, std::chrono::milliseconds timeout);

// The same over a shared buffer every rank maps (shared_buffers.h): `bases[q]` is rank q's copy of the `numel`
// elements (at byte `offset` of buffer `id`, which every rank must pass alike). Nothing is staged: rank q sums share q
// of everyone's copy, in gloo's order, and writes it into every copy -- per rank one read and one write of the data.
void all_reduce_shared(Group& group, const std::vector<char*>& bases, int64_t numel, Reduction reduction, int64_t id,
                       int64_t offset, std::chrono::milliseconds timeout);

// out (count elements) = sum over ranks of their parts[rank]. `order_numel` / `part_offsets[q]` place the parts in
// the all-reduce whose order the sum follows: gloo reduce-scatters a tensor by all-reducing the whole input
// (order_numel = world * count, offsets q * count) and a list by all-reducing each part alone (count, 0).
void reduce_scatter(Group& group, const std::vector<const void*>& parts, void* out, int64_t count, int64_t order_numel,
                    const std::vector<int64_t>& part_offsets, Reduction reduction, std::chrono::milliseconds timeout);

// outs[q] (bytes each) = rank q's input. outs[rank] may be input.
void all_gather(Group& group, const void* input, const std::vector<void*>& outs, int64_t bytes, int32_t dtype,
                std::chrono::milliseconds timeout);

// data (bytes) = root's data.
void broadcast(Group& group, void* data, int64_t bytes, int root, int32_t dtype, std::chrono::milliseconds timeout);

void barrier(Group& group, std::chrono::milliseconds timeout);

}  // namespace fastpar::shm
