// One POSIX shared-memory segment per process group: a header, one control block per rank and the data slots the
// collectives stage chunks in. Rank 0 creates it (0600, pages reserved up front), every rank maps it, and rank 0
// unlinks the name once all have mapped it, so a crash leaves nothing behind in /dev/shm.
#pragma once

#include <pthread.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

namespace fastpar::shm {

constexpr int kMaxRanks = 64;  // larger same-host groups use gloo
// Stage/result buffers per rank (chosen at creation, at most kMaxBuffers): step s uses buffer s % buffers, so a rank
// can stage that many steps ahead of the slowest rank and the ranks need not run at the same moment (on a busy
// machine they rarely do).
constexpr int kMaxBuffers = 62;
constexpr int kDescRing = kMaxBuffers + 2;  // op descriptors a rank keeps, indexed by the op's first step

// The three progress counters of a rank, each the last step it finished that phase of.
enum class Counter : int { kArrive = 0, kReduced = 1, kDone = 2 };
constexpr int kCounters = 3;

enum class RankState : uint32_t { kAbsent = 0, kJoined = 1, kLeft = 2 };

// What a rank called, compared across ranks at the first step of every collective.
struct OpDesc {
  uint32_t kind = 0;  // OpKind
  int32_t dtype = -1;  // at::ScalarType, -1 for none
  int64_t count = 0;  // elements (or bytes for dtype -1) per rank
  int32_t root = -1;
  int32_t reduce = -1;  // c10d::ReduceOp::RedOpType, -1 for none
  uint64_t seq = 0;  // collective number in this group, from 1
  int64_t shared_id = -1;  // an all-reduce of a shared buffer (shared_buffers.h): its id and the byte offset
  int64_t shared_offset = -1;
};

struct alignas(64) PaddedCounter {
  std::atomic<uint64_t> value{0};
};

struct RankBlock {
  PaddedCounter counters[kCounters];  // one cache line each: written by one rank, polled by all
  alignas(64) pthread_mutex_t alive;  // robust + process-shared, held by the rank's worker thread while it lives
  std::atomic<uint32_t> state{0};  // RankState
  int32_t pid = 0;
  std::atomic<uint64_t> op_seq{0};  // the collective it is in, or last started
  std::atomic<uint32_t> op_kind{0};
  OpDesc desc[kDescRing];
};

struct Header {
  uint64_t magic = 0;
  uint64_t token = 0;  // random, published through the store: proves every rank mapped the same memory
  uint32_t world = 0;
  uint32_t buffers = 0;
  uint64_t slot_bytes = 0;
  uint64_t data_offset = 0;
  uint64_t total_bytes = 0;
  alignas(64) std::atomic<uint32_t> doorbell{0};  // futex word: bumped when a counter moves and someone sleeps
  std::atomic<uint32_t> sleepers{0};
  alignas(64) std::atomic<uint32_t> aborted{0};  // 0 ok, 1 being written, 2 message ready
  std::atomic<int32_t> abort_by{-1};  // the aborting rank, written first after `aborted` becomes 1
  char abort_message[1024] = {};
};

// A mapped segment. Movable, unmaps on destruction.
class Segment {
 public:
  Segment() = default;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  Segment(Segment&& other) noexcept;
  Segment& operator=(Segment&& other) noexcept;
  ~Segment();

  // Creates `name` (O_EXCL, mode 0600), reserves its pages (ENOSPC is an error here, not a SIGBUS later) and
  // initialises the header and rank blocks. The segment is unmapped again; ranks map it with open().
  static void create(const std::string& name, int world, size_t slot_bytes, int buffers, uint64_t token);
  // Maps `name`; throws unless it holds a fastpar group of `world` ranks with `token`.
  static Segment open(const std::string& name, int world, uint64_t token);
  static void unlink(const std::string& name);  // no error if it is already gone
  static size_t size_for(int world, size_t slot_bytes, int buffers);

  bool valid() const { return base_ != nullptr; }
  Header& header() const { return *reinterpret_cast<Header*>(base_); }
  RankBlock& rank(int r) const;
  size_t slot_bytes() const { return header().slot_bytes; }
  int buffers() const { return static_cast<int>(header().buffers); }
  // Staging slot of rank q for step s, and the shared result slot for step s (slot_bytes each).
  char* stage(int q, uint64_t s) const;
  char* result(uint64_t s) const;

 private:
  char* base_ = nullptr;
  size_t size_ = 0;
};

// Liveness of rank q as seen through its robust mutex: alive (a live thread holds it), dead (its holder died),
// left (it detached cleanly) or absent (never joined).
enum class Liveness { kAlive, kDead, kLeft, kAbsent };
Liveness probe(RankBlock& block);

// Take / release one's own liveness mutex (from the thread that lives as long as the membership).
void join(RankBlock& block, int pid);
void leave(RankBlock& block);

}  // namespace fastpar::shm
