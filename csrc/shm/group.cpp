// Counters, futex sleeps, liveness checks and the group-wide abort of fastpar's same-host collectives.
#include "shm/group.h"

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "text.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace fastpar::shm {
namespace {

using Clock = std::chrono::steady_clock;

// The most a wait spins before it sleeps unless the backend sets it (FASTPAR_SHM_SPIN_US). A peer on another core
// usually arrives within microseconds; with more runnable threads than cores, spinning only steals the core the peer
// needs (fastpar/comm/threads.py chooses per group).
std::chrono::nanoseconds default_max_spin() {
  static const std::chrono::nanoseconds budget = [] {
    const char* value = std::getenv("FASTPAR_SHM_SPIN_US");
    const long us = value != nullptr ? std::strtol(value, nullptr, 10) : 50;
    return std::chrono::nanoseconds(std::max(0L, us) * 1000);
  }();
  return budget;
}
constexpr auto kMinSpin = std::chrono::nanoseconds(2000);

// A sleeping wait wakes at least this often to check the lagging ranks are alive and the deadline.
constexpr auto kSleepSlice = std::chrono::milliseconds(20);
// How long a rank waits for the message of a rank that began to abort the group (it takes microseconds).
constexpr auto kAbortMessageWait = std::chrono::milliseconds(2000);

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds timeout) {
  const auto ns = timeout.count();
  timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  // Not FUTEX_PRIVATE: the word is shared between processes.
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

const char* counter_phase(Counter counter) {
  switch (counter) {
    case Counter::kArrive:
      return "reach";
    case Counter::kReduced:
      return "reduce its share of";
    case Counter::kDone:
      return "finish";
  }
  return "reach";
}

std::string dtype_name(int32_t dtype) {
  switch (static_cast<at::ScalarType>(dtype)) {
    case at::kFloat:
      return "float32";
    case at::kHalf:
      return "float16";
    case at::kBFloat16:
      return "bfloat16";
    case at::kDouble:
      return "float64";
    default:
      return c10::toString(static_cast<at::ScalarType>(dtype));
  }
}

std::string seconds(std::chrono::milliseconds ms) { return text(ms.count() / 1000.0, " s"); }

// "(float32 x 1000, sum)": what a collective was called with.
std::string arguments(const OpDesc& desc) {
  std::string out = "(";
  if (desc.dtype >= 0) {
    out += text(dtype_name(desc.dtype), " x ", desc.count);
  } else {
    out += text(desc.count, " bytes");
  }
  if (desc.root >= 0) out += text(", root ", desc.root);
  if (desc.reduce >= 0) out += desc.reduce == 1 ? ", avg" : ", sum";  // c10d::ReduceOp: SUM 0, AVG 1
  if (desc.shared_id >= 0) out += text(", shared buffer ", desc.shared_id, " at byte ", desc.shared_offset);
  return out + ")";
}

}  // namespace

const char* op_name(OpKind kind) {
  switch (kind) {
    case OpKind::kAllReduce:
      return "all_reduce";
    case OpKind::kReduceScatter:
      return "reduce_scatter";
    case OpKind::kAllGather:
      return "all_gather";
    case OpKind::kBroadcast:
      return "broadcast";
    case OpKind::kBarrier:
      return "barrier";
    case OpKind::kAllReduceShared:
      return "all_reduce (of a shared buffer)";
    case OpKind::kNone:
      break;
  }
  return "no collective";
}

Group::Group(Segment segment, int rank, std::chrono::milliseconds timeout)
    : segment_(std::move(segment)),
      header_(segment_.header()),
      rank_(rank),
      world_(static_cast<int>(header_.world)),
      buffers_(static_cast<int>(header_.buffers)),
      default_timeout_(timeout),
      max_spin_(default_max_spin()),
      spin_(max_spin_) {}

void Group::set_max_spin(std::chrono::nanoseconds spin) {
  max_spin_ = std::max(std::chrono::nanoseconds(0), spin);
  spin_ = max_spin_;
}

Group::~Group() {
  if (joined_) leave();
}

void Group::join() {
  shm::join(segment_.rank(rank_), static_cast<int>(::getpid()));
  joined_ = true;
}

void Group::leave() {
  joined_ = false;
  shm::leave(segment_.rank(rank_));
  // wake sleepers so they notice at once that this rank is gone
  header_.doorbell.fetch_add(1);
  futex_wake_all(&header_.doorbell);
}

bool Group::aborted() const { return header_.aborted.load(std::memory_order_acquire) != 0; }

std::string Group::abort_message() const {
  // The aborting rank writes the message between setting 1 and 2, in microseconds. One that died in between (or
  // before it even wrote its rank) must not keep the others waiting: they look for a dead rank, and give up after a
  // while, sleeping rather than spinning.
  const auto give_up = Clock::now() + kAbortMessageWait;
  while (header_.aborted.load(std::memory_order_acquire) == 1) {
    const int by = header_.abort_by.load(std::memory_order_acquire);
    for (int q = 0; q < world_; ++q) {
      if (q == rank_ || (by >= 0 && q != by) || probe(segment_.rank(q)) != Liveness::kDead) continue;
      return "rank " + std::to_string(q) + " (pid " + std::to_string(segment_.rank(q).pid) +
             ") died while it was aborting the group, before it wrote why";
    }
    if (Clock::now() >= give_up) {
      return "rank " + (by >= 0 ? std::to_string(by) : std::string("?")) +
             " began to abort the group but did not write why within " + seconds(kAbortMessageWait) +
             " (it may be stuck or dead)";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return std::string(header_.abort_message, strnlen(header_.abort_message, sizeof(header_.abort_message)));
}

void Group::throw_aborted() const {
  std::string message = abort_message();
  const int by = header_.abort_by.load(std::memory_order_acquire);
  if (by >= 0 && by != rank_) message += " [reported by rank " + std::to_string(by) + "]";
  C10_THROW_ERROR(DistBackendError, "fastpar shm backend, rank " + std::to_string(rank_) + ": " + message);
}

void Group::abort(const std::string& message) {
  uint32_t expected = 0;
  if (header_.aborted.compare_exchange_strong(expected, 1)) {
    header_.abort_by.store(rank_, std::memory_order_release);
    const std::string text = message +
                             ". This process group can no longer be used: destroy it and restart the ranks "
                             "(torchrun --max-restarts does this).";
    const size_t n = std::min(text.size(), sizeof(header_.abort_message) - 1);
    std::memcpy(header_.abort_message, text.data(), n);
    header_.abort_message[n] = '\0';
    header_.aborted.store(2, std::memory_order_release);
    header_.doorbell.fetch_add(1);
    futex_wake_all(&header_.doorbell);
  }
  throw_aborted();
}

uint64_t Group::begin(OpDesc desc, std::chrono::milliseconds timeout, int64_t steps) {
  if (aborted()) throw_aborted();
  op_timeout_ = timeout.count() > 0 ? timeout : default_timeout_;
  deadline_ = Clock::now() + op_timeout_;
  desc.seq = ++seq_;
  current_ = desc;
  RankBlock& mine = segment_.rank(rank_);
  mine.op_kind.store(desc.kind, std::memory_order_relaxed);
  mine.op_seq.store(desc.seq, std::memory_order_release);
  const uint64_t first = step_ + 1;
  step_ += static_cast<uint64_t>(steps);
  // The first step reuses the buffers of step first - buffers_: every rank must be done with them. The descriptor
  // ring slot reused here was last read kDescRing > buffers_ steps ago, longer before still.
  const auto depth = static_cast<uint64_t>(buffers_);
  if (first > depth) wait_all(Counter::kDone, first - depth);
  mine.desc[first % kDescRing] = desc;  // published by the first signal of this step
  return first;
}

bool Group::reached_all(Counter counter, uint64_t step) const {
  const int c = static_cast<int>(counter);
  for (int q = 0; q < world_; ++q) {
    if (segment_.rank(q).counters[c].value.load(std::memory_order_acquire) < step) return false;
  }
  return true;
}

void Group::signal(Counter counter, uint64_t step) {
  segment_.rank(rank_).counters[static_cast<int>(counter)].value.store(step, std::memory_order_seq_cst);
  // Dekker with wait_until: a sleeper registers before its last check, so either it sees the new value or we see it.
  if (header_.sleepers.load(std::memory_order_seq_cst) != 0) {
    header_.doorbell.fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(&header_.doorbell);
  }
}

void Group::wait_all(Counter counter, uint64_t step) {
  wait_until([&] { return reached_all(counter, step); }, counter, step, -1);
}

void Group::wait_rank(Counter counter, int q, uint64_t step) {
  auto& value = segment_.rank(q).counters[static_cast<int>(counter)].value;
  wait_until([&] { return value.load(std::memory_order_acquire) >= step; }, counter, step, q);
}

template <typename Ready>
void Group::wait_until(Ready&& ready, Counter counter, uint64_t step, int only_rank) {
  if (ready()) return;
  // Adaptive: a wait that ends while spinning lets the next spin twice as long, one that has to sleep halves it, so
  // spinning goes away when the peers are descheduled (a loaded machine) and comes back when they run alongside.
  if (max_spin_.count() > 0) {
    const auto spin_end = Clock::now() + spin_;
    for (uint32_t i = 1;; ++i) {
      cpu_relax();
      if (ready()) {
        spin_ = std::min(max_spin_, spin_ * 2);
        return;
      }
      if ((i & 255) == 0) {
        if (aborted()) throw_aborted();
        if (Clock::now() >= spin_end) break;
      }
    }
    spin_ = std::max(std::min(kMinSpin, max_spin_), spin_ / 2);
  }
  while (true) {
    header_.sleepers.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t bell = header_.doorbell.load(std::memory_order_seq_cst);
    const bool done = ready();
    if (!done && !aborted()) futex_wait(&header_.doorbell, bell, kSleepSlice);
    header_.sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (done || ready()) return;
    if (aborted()) throw_aborted();
    check_lagging(counter, step, only_rank, Clock::now() >= deadline_);
  }
}

// Names the ranks we wait for that died, left, or (at the deadline) never arrived, and aborts the group.
void Group::check_lagging(Counter counter, uint64_t step, int only_rank, bool timed_out) {
  const int c = static_cast<int>(counter);
  for (int q = 0; q < world_; ++q) {
    if (only_rank >= 0 && q != only_rank) continue;
    RankBlock& block = segment_.rank(q);
    if (q == rank_ || block.counters[c].value.load(std::memory_order_acquire) >= step) continue;
    const Liveness liveness = probe(block);
    std::string out = text("rank ", q, " (pid ", block.pid, ") ");
    if (liveness == Liveness::kDead) {
      out += text("died (its process exited or was killed) while rank ", rank_, " waited for it to ",
                  counter_phase(counter), " ", where());
    } else if (liveness == Liveness::kLeft) {
      out += text("left the group (destroy_process_group, or the process is exiting) while rank ", rank_,
                  " waited for it to ", counter_phase(counter), " ", where());
    } else if (timed_out) {
      const auto seq = block.op_seq.load(std::memory_order_acquire);
      const auto kind = static_cast<OpKind>(block.op_kind.load(std::memory_order_relaxed));
      out += text("did not ", counter_phase(counter), " ", where(), " within ", seconds(op_timeout_),
                  " (the timeout); it is alive");
      if (seq != 0) out += text(", in (or last in) ", op_name(kind), " #", seq);
      out += ". Every rank must make the same collective calls in the same order";
    } else {
      continue;
    }
    abort(out);
  }
  if (timed_out) {
    abort("timed out after " + seconds(op_timeout_) + " in " + where() + " waiting for ranks that are alive");
  }
}

void Group::check_same_call(uint64_t first, int only_rank) {
  const OpDesc& mine = current_;
  for (int q = 0; q < world_; ++q) {
    if (q == rank_ || (only_rank >= 0 && q != only_rank)) continue;
    const OpDesc& theirs = segment_.rank(q).desc[first % kDescRing];
    if (theirs.kind == mine.kind && theirs.dtype == mine.dtype && theirs.count == mine.count &&
        theirs.root == mine.root && theirs.reduce == mine.reduce && theirs.seq == mine.seq &&
        theirs.shared_id == mine.shared_id && theirs.shared_offset == mine.shared_offset) {
      continue;
    }
    abort("collective mismatch at collective #" + std::to_string(mine.seq) + ": rank " + std::to_string(rank_) +
          " called " + describe(mine) + " but rank " + std::to_string(q) + " called " + describe(theirs) +
          " as its collective #" + std::to_string(theirs.seq) +
          ". Every rank must make the same calls, with the same sizes and dtypes, in the same order");
  }
}

std::string Group::describe(const OpDesc& desc) const {
  return op_name(static_cast<OpKind>(desc.kind)) + arguments(desc);
}

std::string Group::where() const {
  return op_name(static_cast<OpKind>(current_.kind)) + (" #" + std::to_string(current_.seq) + " ") +
         arguments(current_);
}

}  // namespace fastpar::shm
