// The same-host collectives as runs of steps over a Group. Chunks are sized to the staging slots (a few hundred KB),
// so what one rank writes into shared memory is still in cache when the others read it: per rank, memory traffic is
// close to one read of the input and one write of the output.
#include "shm/collectives.h"

#include <c10/core/ScalarType.h>

#include <algorithm>

#include "shm/reduce.h"

namespace fastpar::shm {
namespace {

constexpr int64_t kLine = 64;  // bytes: rank shares start on their own cache line
// Up to this size an all-reduce on more than two ranks sums whole chunks on every rank (one wait per step) rather
// than splitting the work (two waits per step, less traffic): latency wins over bandwidth.
constexpr int64_t kDirectBytes = 64 * 1024;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }


int64_t steps_for(int64_t n, int64_t chunk) { return std::max<int64_t>(1, ceil_div(n, chunk)); }

// Elements per rank share of a `len`-element chunk, whole cache lines.
int64_t share_of(int64_t len, int world, size_t es) {
  const int64_t line = std::max<int64_t>(1, kLine / static_cast<int64_t>(es));
  return ceil_div(ceil_div(len, world), line) * line;
}

// [begin, end) of share q, clipped to the chunk.
std::pair<int64_t, int64_t> share_range(int q, int64_t share, int64_t len) {
  return {std::min(len, q * share), std::min(len, (q + 1) * share)};
}

// A data-moving collective of `bytes` bytes of `dtype` (-1: raw bytes).
OpDesc move_desc(OpKind kind, int64_t bytes, int32_t dtype, int32_t root = -1) {
  OpDesc desc;
  desc.kind = static_cast<uint32_t>(kind);
  desc.dtype = dtype;
  desc.count = dtype >= 0 ? bytes / static_cast<int64_t>(c10::elementSize(static_cast<at::ScalarType>(dtype))) : bytes;
  desc.root = root;
  return desc;
}

OpDesc reduce_desc(OpKind kind, int64_t count, Reduction reduction) {
  OpDesc desc;
  desc.kind = static_cast<uint32_t>(kind);
  desc.dtype = static_cast<int32_t>(reduction.dtype);
  desc.count = count;
  desc.reduce = reduction.average ? 1 : 0;  // c10d::ReduceOp::AVG / SUM
  return desc;
}

// Runs a collective as steps of `chunk` elements (or bytes) over `total`. Each step is staged (stage(step, lo, len):
// this rank's chunk into its slot, then signal kArrive) and then consumed (consume(step, first, lo, len): wait for
// the others' chunks, reduce or copy out, signal kDone). A step is consumed as soon as the others have staged it, while
// this rank's chunk is still in cache; while they have not, staging runs ahead, up to buffers() steps, as far as the
// other ranks have freed the buffers: a rank whose peers are not running at the moment stages what it can and
// sleeps once, and the peers then find whole runs of steps ready instead of one.
template <typename Stage, typename Consume>
void run_steps(Group& g, const OpDesc& desc, std::chrono::milliseconds timeout, int64_t total, int64_t chunk,
               Stage&& stage, Consume&& consume) {
  const int64_t steps = steps_for(total, chunk);
  const uint64_t first = g.begin(desc, timeout, steps);  // the first step's buffers are free
  auto lo = [&](int64_t k) { return k * chunk; };
  auto len = [&](int64_t k) { return std::min(chunk, total - k * chunk); };
  // Step s reuses the buffers of step s - depth: free once every rank is done with that one.
  const auto depth = static_cast<uint64_t>(g.buffers());
  auto free = [&](uint64_t step) { return step <= depth || g.reached_all(Counter::kDone, step - depth); };
  int64_t staged = 0;
  for (int64_t done = 0; done < steps; ++done) {
    while (staged < steps && staged - done < g.buffers() && (staged == 0 || free(first + staged)) &&
           (staged == done || !g.reached_all(Counter::kArrive, first + done))) {
      stage(first + staged, lo(staged), len(staged));
      ++staged;
    }
    if (staged == done) {  // the next step's buffers are still in use: wait for them, then stage it
      g.wait_all(Counter::kDone, first + staged - depth);  // first + staged > depth, or it would be free
      stage(first + staged, lo(staged), len(staged));
      ++staged;
    }
    consume(first + done, done == 0, lo(done), len(done));
  }
}

// The elements of a list of spans as one concatenation: each(lo, len, fn) calls fn(pointer, offset from lo, n) for
// the pieces of [lo, lo + len) in order, one per span it touches (one call for a single buffer).
class Pieces {
 public:
  Pieces(const std::vector<Span>& spans, size_t element_size)
      : spans_(spans), starts_(spans.size() + 1, 0), es_(static_cast<int64_t>(element_size)) {
    for (size_t i = 0; i < spans.size(); ++i) starts_[i + 1] = starts_[i] + spans[i].numel;
  }
  int64_t total() const { return starts_.back(); }

  template <typename Fn>
  void each(int64_t lo, int64_t len, Fn&& fn) const {
    const int64_t end = lo + len;
    size_t i = std::upper_bound(starts_.begin(), starts_.end(), lo) - starts_.begin() - 1;
    for (int64_t at = lo; at < end && i < spans_.size(); ++i) {
      const int64_t piece_end = std::min(end, starts_[i + 1]);
      if (piece_end > at) fn(spans_[i].data + (at - starts_[i]) * es_, at - lo, piece_end - at);
      at = std::max(at, piece_end);
    }
  }

 private:
  const std::vector<Span>& spans_;
  std::vector<int64_t> starts_;
  int64_t es_;
};

}  // namespace

void all_reduce(Group& g, void* data, int64_t numel, Reduction reduction, std::chrono::milliseconds timeout) {
  all_reduce(g, std::vector<Span>{{static_cast<char*>(data), numel}}, reduction, timeout);
}

void all_reduce(Group& g, const std::vector<Span>& spans, Reduction reduction, std::chrono::milliseconds timeout) {
  const int world = g.world();
  const int rank = g.rank();
  const size_t es = c10::elementSize(reduction.dtype);
  const Pieces pieces(spans, es);
  const int64_t numel = pieces.total();
  const RingOrder order(world, numel, es);
  const int64_t chunk = static_cast<int64_t>(g.slot_bytes() / es);
  const void* src[kMaxRanks];
  const OpDesc desc = reduce_desc(OpKind::kAllReduce, numel, reduction);
  // Copies elements [lo, lo + len) of the concatenation into (or, `into_spans`, out of) the contiguous `buffer`.
  auto gather = [&](char* buffer, int64_t lo, int64_t len) {
    pieces.each(lo, len, [&](char* mine, int64_t at, int64_t n) { copy_bytes(buffer + at * es, mine, n * es); });
  };
  if (world <= 2 || numel * static_cast<int64_t>(es) <= kDirectBytes) {
    // Every rank sums whole chunks itself: one wait per step.
    run_steps(
        g, desc, timeout, numel, chunk,
        [&](uint64_t step, int64_t lo, int64_t len) {
          gather(g.stage(rank, step), lo, len);
          g.signal(Counter::kArrive, step);
        },
        [&](uint64_t step, bool first, int64_t lo, int64_t len) {
          g.wait_all(Counter::kArrive, step);
          if (first) g.check_same_call(step);
          pieces.each(lo, len, [&](char* mine, int64_t at, int64_t n) {
            for (int q = 0; q < world; ++q) src[q] = q == rank ? mine : g.stage(q, step) + at * es;
            reduce_ordered(src, mine, nullptr, n, lo + at, order, reduction.dtype, reduction.average);
          });
          g.signal(Counter::kDone, step);
        });
    return;
  }
  // More ranks, more data: reduce-scatter then all-gather inside each step. Rank q sums share q of everyone's chunk,
  // so each rank reads 1/world of the others' data instead of all of it.
  run_steps(
      g, desc, timeout, numel, chunk,
      [&](uint64_t step, int64_t lo, int64_t len) {
        const int64_t share = share_of(len, world, es);
        for (int q = 0; q < world; ++q) {
          const auto [b, e] = share_range(q, share, len);
          if (q != rank) gather(g.stage(rank, step) + b * es, lo + b, e - b);
        }
        g.signal(Counter::kArrive, step);
      },
      [&](uint64_t step, bool first, int64_t lo, int64_t len) {
        g.wait_all(Counter::kArrive, step);
        if (first) g.check_same_call(step);
        const int64_t share = share_of(len, world, es);
        const auto [b, e] = share_range(rank, share, len);
        pieces.each(lo + b, e - b, [&](char* mine, int64_t at, int64_t n) {
          const int64_t in_chunk = b + at;
          for (int q = 0; q < world; ++q) src[q] = q == rank ? mine : g.stage(q, step) + in_chunk * es;
          reduce_ordered(src, mine, g.result(step) + in_chunk * es, n, lo + in_chunk, order, reduction.dtype,
                         reduction.average);
        });
        g.signal(Counter::kReduced, step);
        g.wait_all(Counter::kReduced, step);
        for (int q = 0; q < world; ++q) {
          const auto [qb, qe] = share_range(q, share, len);
          if (q == rank) continue;
          pieces.each(lo + qb, qe - qb, [&](char* mine, int64_t at, int64_t n) {
            copy_bytes(mine, g.result(step) + (qb + at) * es, n * es);
          });
        }
        g.signal(Counter::kDone, step);
      });
}

void all_reduce_shared(Group& g, const std::vector<char*>& bases, int64_t numel, Reduction reduction, int64_t id,
                       int64_t offset, std::chrono::milliseconds timeout) {
  const int world = g.world();
  const int rank = g.rank();
  const size_t es = c10::elementSize(reduction.dtype);
  const RingOrder order(world, numel, es);
  OpDesc desc = reduce_desc(OpKind::kAllReduceShared, numel, reduction);
  desc.shared_id = id;
  desc.shared_offset = offset;
  const uint64_t step = g.begin(desc, timeout, 1);
  g.signal(Counter::kArrive, step);  // this rank's copy holds its values: the others may read it
  g.wait_all(Counter::kArrive, step);
  g.check_same_call(step);
  const auto [b, e] = share_range(rank, share_of(numel, world, es), numel);
  // Pieces the size of a staging slot: with more than two ranks the sums are copied to the others while in cache.
  const int64_t piece = std::max<int64_t>(1, static_cast<int64_t>(g.slot_bytes() / es));
  const void* src[kMaxRanks];
  for (int64_t lo = b; lo < e; lo += piece) {
    const int64_t n = std::min(piece, e - lo);
    for (int q = 0; q < world; ++q) src[q] = bases[q] + lo * es;
    char* mine = bases[rank] + lo * es;
    char* other = world == 2 ? bases[1 - rank] + lo * es : nullptr;
    reduce_ordered(src, mine, other, n, lo, order, reduction.dtype, reduction.average);
    if (world > 2) {
      for (int q = 0; q < world; ++q) {
        if (q != rank) copy_bytes(bases[q] + lo * es, mine, n * es);
      }
    }
  }
  g.signal(Counter::kDone, step);  // this rank's share is in every copy
  g.wait_all(Counter::kDone, step);  // every share is in this rank's copy, and nobody reads it any more
}

void reduce_scatter(Group& g, const std::vector<const void*>& parts, void* out, int64_t count, int64_t order_numel,
                    const std::vector<int64_t>& part_offsets, Reduction reduction, std::chrono::milliseconds timeout) {
  const int world = g.world();
  const int rank = g.rank();
  const size_t es = c10::elementSize(reduction.dtype);
  const RingOrder order(world, order_numel, es);
  // The staging slot holds one sub-slot per destination rank (slots hold at least 4 KB = 64 ranks x one cache
  // line, so a sub-slot never rounds down to nothing).
  const int64_t line = std::max<int64_t>(1, kLine / static_cast<int64_t>(es));
  const int64_t chunk = std::max(line, static_cast<int64_t>(g.slot_bytes() / es / world) / line * line);
  const void* src[kMaxRanks];
  run_steps(
      g, reduce_desc(OpKind::kReduceScatter, count, reduction), timeout, count, chunk,
      [&](uint64_t step, int64_t lo, int64_t len) {
        for (int q = 0; q < world; ++q) {
          if (q == rank) continue;
          copy_bytes(g.stage(rank, step) + q * chunk * es, static_cast<const char*>(parts[q]) + lo * es, len * es);
        }
        g.signal(Counter::kArrive, step);
      },
      [&](uint64_t step, bool first, int64_t lo, int64_t len) {
        g.wait_all(Counter::kArrive, step);
        if (first) g.check_same_call(step);
        for (int q = 0; q < world; ++q) {
          src[q] = q == rank ? static_cast<const char*>(parts[rank]) + lo * es : g.stage(q, step) + rank * chunk * es;
        }
        reduce_ordered(src, static_cast<char*>(out) + lo * es, nullptr, len, part_offsets[rank] + lo, order,
                       reduction.dtype, reduction.average);
        g.signal(Counter::kDone, step);
      });
}

void all_gather(Group& g, const void* input, const std::vector<void*>& outs, int64_t bytes, int32_t dtype,
                std::chrono::milliseconds timeout) {
  const int world = g.world();
  const int rank = g.rank();
  const char* in = static_cast<const char*>(input);
  run_steps(
      g, move_desc(OpKind::kAllGather, bytes, dtype), timeout, bytes, static_cast<int64_t>(g.slot_bytes()),
      [&](uint64_t step, int64_t lo, int64_t len) {
        copy_bytes(g.stage(rank, step), in + lo, len);
        copy_bytes(static_cast<char*>(outs[rank]) + lo, in + lo, len);
        g.signal(Counter::kArrive, step);
      },
      [&](uint64_t step, bool first, int64_t lo, int64_t len) {
        g.wait_all(Counter::kArrive, step);
        if (first) g.check_same_call(step);
        for (int q = 0; q < world; ++q) {
          if (q != rank) copy_bytes(static_cast<char*>(outs[q]) + lo, g.stage(q, step), len);
        }
        g.signal(Counter::kDone, step);
      });
}

void broadcast(Group& g, void* data, int64_t bytes, int root, int32_t dtype, std::chrono::milliseconds timeout) {
  const int rank = g.rank();
  char* base = static_cast<char*>(data);
  run_steps(
      g, move_desc(OpKind::kBroadcast, bytes, dtype, root), timeout, bytes, static_cast<int64_t>(g.slot_bytes()),
      [&](uint64_t step, int64_t lo, int64_t len) {
        // Every rank arrives (publishing its call), so the root can check the receivers called the same broadcast:
        // ranks that disagree on the root would each broadcast to themselves and return different tensors.
        if (rank == root) copy_bytes(g.stage(root, step), base + lo, len);
        g.signal(Counter::kArrive, step);
      },
      [&](uint64_t step, bool first, int64_t lo, int64_t len) {
        if (rank != root) {
          g.wait_rank(Counter::kArrive, root, step);
          if (first) g.check_same_call(step, root);
          copy_bytes(base + lo, g.stage(root, step), len);
        } else if (first) {
          g.wait_all(Counter::kArrive, step);
          g.check_same_call(step);
        }
        g.signal(Counter::kDone, step);
      });
}

void barrier(Group& g, std::chrono::milliseconds timeout) {
  run_steps(
      g, move_desc(OpKind::kBarrier, 0, -1), timeout, 0, 1,
      [&](uint64_t step, int64_t, int64_t) { g.signal(Counter::kArrive, step); },
      [&](uint64_t step, bool, int64_t, int64_t) {
        g.wait_all(Counter::kArrive, step);
        g.check_same_call(step);
        g.signal(Counter::kDone, step);
      });
}

}  // namespace fastpar::shm
