// Buffers in shared memory that every rank of a group maps: fastpar's DDP keeps its buckets in them, so an
// all-reduce of a bucket reads the other ranks' gradients where they lie and writes the sums straight into every
// rank's bucket -- no staging copy into the segment's slots, and per rank one read and one write of the bucket
// instead of three reads and two writes. Each rank creates its own file per buffer; the others map it; the names
// are unlinked once all have mapped them, so a crash leaves nothing behind in /dev/shm. Creation is collective
// (every rank in the same order, same sizes); fastpar/comm/shared_buffers.py drives it and falls back to private
// memory on every rank when one cannot.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace fastpar::shm {

// One buffer of `bytes` per rank, mapped here: bases[q] is rank q's (bases[rank] this process's own).
struct SharedRegion {
  int64_t id = -1;
  size_t bytes = 0;
  int rank = 0;
  std::string own_name;
  bool own_linked = false;
  std::vector<char*> bases;
  ~SharedRegion();
};

// Marks, on this thread, that the all-reduce being issued is one of DDP's bucket collectives (every rank reduces the
// same bucket at the same offset of its shared buffer). Only such an all-reduce takes the shared protocol: any other
// tensor that happens to lie in a shared buffer (a user's own all_reduce(p.grad)) goes the usual way, so ranks that
// disagree about it are not mismatched by protocol.
class BucketCollectiveScope {
 public:
  BucketCollectiveScope() : previous_(set(true)) {}
  ~BucketCollectiveScope() { set(previous_); }
  BucketCollectiveScope(const BucketCollectiveScope&) = delete;
  BucketCollectiveScope& operator=(const BucketCollectiveScope&) = delete;
  static bool active();
  static bool set(bool active);  // returns the previous value

 private:
  bool previous_;
};

class SharedBuffers {
 public:
  SharedBuffers(std::string prefix, int rank, int world) : prefix_(std::move(prefix)), rank_(rank), world_(world) {}

  // Step 1 on every rank: create and map this rank's file of buffer number `id` (ids count calls, from 0, the same
  // on every rank). Throws with the reason (e.g. /dev/shm full); the id is used up either way.
  int64_t create(size_t bytes);
  // Step 2, after every rank's step 1 succeeded: map the other ranks' files of buffer `id`.
  void map_peers(int64_t id);
  // Step 3, after every rank's step 2: remove this rank's name (the mappings stay).
  void unlink_own(int64_t id);
  // A flat tensor over this rank's buffer `id` (its last step); the mappings live as long as the tensor.
  at::Tensor tensor(int64_t id, at::ScalarType dtype, int64_t numel);
  // Drops buffer `id` (a failed creation on some rank): unlinks and unmaps what was made here.
  void release(int64_t id);

  // The region holding [data, data + bytes) of this rank's memory, and the offset of `data` in it; null if none.
  std::shared_ptr<SharedRegion> find(const void* data, size_t bytes, int64_t* offset);

 private:
  std::string name_of(int64_t id, int rank) const;
  std::shared_ptr<SharedRegion> pending(int64_t id);

  std::string prefix_;
  int rank_, world_;
  std::mutex mutex_;
  int64_t next_id_ = 0;
  std::map<int64_t, std::shared_ptr<SharedRegion>> pending_;  // created, not yet a tensor
  std::map<uintptr_t, std::weak_ptr<SharedRegion>> live_;  // by this rank's base address
};

}  // namespace fastpar::shm
