// The step protocol of fastpar's same-host collectives. A collective is a run of steps, numbered across the group's
// life; in each step every rank moves one chunk through its staging slot (step s uses buffer s % buffers()) and
// publishes how far it got on three monotonic counters (arrive, reduced, done). A rank may stage up to buffers() steps
// ahead of what every rank is done with. Waiting spins briefly, then sleeps on a futex; while asleep it checks that
// the ranks it waits for are alive, so a rank that dies or never arrives becomes an error naming it, never a hang.
// The first error aborts the group for every rank.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "shm/segment.h"

namespace fastpar::shm {

enum class OpKind : uint32_t {
  kNone = 0,
  kAllReduce,
  kReduceScatter,
  kAllGather,
  kBroadcast,
  kBarrier,
  kAllReduceShared,  // of a shared buffer (shared_buffers.h): nothing staged
};
const char* op_name(OpKind kind);

class Group {
 public:
  Group(Segment segment, int rank, std::chrono::milliseconds timeout);
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;
  ~Group();

  int rank() const { return rank_; }
  int world() const { return world_; }
  size_t slot_bytes() const { return segment_.slot_bytes(); }
  int buffers() const { return buffers_; }
  char* stage(int q, uint64_t s) const { return segment_.stage(q, s); }
  char* result(uint64_t s) const { return segment_.result(s); }

  // Membership, from the thread that lives as long as it (the backend's worker): while it holds the liveness lock
  // the other ranks know this process is alive.
  void join();
  void leave();

  // Starts a collective of `steps` steps: checks the group is healthy, waits until the first step's buffers are
  // free and publishes `desc` for it. Returns the first step. `timeout` bounds every wait of the collective (0: the
  // group's).
  uint64_t begin(OpDesc desc, std::chrono::milliseconds timeout, int64_t steps);
  // Whether every rank has reached `step` on `counter` (does not wait).
  bool reached_all(Counter counter, uint64_t step) const;
  void signal(Counter counter, uint64_t step);
  void wait_all(Counter counter, uint64_t step);
  void wait_rank(Counter counter, int q, uint64_t step);
  // After wait_all(kArrive, first) (or wait_rank for one rank): every rank called the same collective?
  void check_same_call(uint64_t first, int only_rank = -1);

  // Marks the group broken for every rank with `message` (the first abort wins) and throws it.
  [[noreturn]] void abort(const std::string& message);
  bool aborted() const;
  std::string abort_message() const;
  void set_default_timeout(std::chrono::milliseconds timeout) { default_timeout_ = timeout; }
  // The longest a wait spins before it sleeps (0: sleep at once). Set before the first collective.
  void set_max_spin(std::chrono::nanoseconds spin);
  std::chrono::nanoseconds max_spin() const { return max_spin_; }

 private:
  template <typename Ready>
  void wait_until(Ready&& ready, Counter counter, uint64_t step, int only_rank);
  [[noreturn]] void throw_aborted() const;
  void check_lagging(Counter counter, uint64_t step, int only_rank, bool timed_out);
  std::string describe(const OpDesc& desc) const;
  std::string where() const;

  Segment segment_;
  Header& header_;
  const int rank_;
  const int world_;
  const int buffers_;
  std::chrono::milliseconds default_timeout_;
  std::chrono::steady_clock::time_point deadline_{};
  std::chrono::milliseconds op_timeout_{0};
  uint64_t step_ = 0;
  OpDesc current_{};
  uint64_t seq_ = 0;
  std::chrono::nanoseconds max_spin_;
  std::chrono::nanoseconds spin_;  // how long the next wait spins before it sleeps (adapts, up to max_spin_)
  bool joined_ = false;
};

}  // namespace fastpar::shm
