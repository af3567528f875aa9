// Shared-memory buffers every rank of a group maps (see shared_buffers.h).
#include "shm/shared_buffers.h"
#include "text.h"

#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace fastpar::shm {
namespace {

std::string errno_text(int err) { return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")"; }

struct Fd {
  int fd;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

char* map_file(int fd, size_t bytes, const std::string& name) {
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  TORCH_CHECK(base != MAP_FAILED, text("fastpar shm: cannot map ", name, ": ", errno_text(errno)));
  return static_cast<char*>(base);
}

}  // namespace

SharedRegion::~SharedRegion() {
  for (char* base : bases) {
    if (base != nullptr) ::munmap(base, bytes);
  }
  if (own_linked) ::shm_unlink(own_name.c_str());
}

std::string SharedBuffers::name_of(int64_t id, int rank) const {
  return prefix_ + ".b" + std::to_string(id) + ".r" + std::to_string(rank);
}

int64_t SharedBuffers::create(size_t bytes) {
  int64_t id;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    id = next_id_++;
  }
  TORCH_CHECK(bytes > 0, "fastpar shm: a shared buffer needs at least one byte");
  auto region = std::make_shared<SharedRegion>();
  region->id = id;
  region->bytes = bytes;
  region->rank = rank_;
  region->own_name = name_of(id, rank_);
  region->bases.assign(world_, nullptr);
  Fd file{::shm_open(region->own_name.c_str(), O_CREAT | O_EXCL | O_RDWR, S_IRUSR | S_IWUSR)};
  TORCH_CHECK(file.fd >= 0, text("fastpar shm: cannot create ", region->own_name, ": ", errno_text(errno)));
  region->own_linked = true;  // from here the region's destructor removes the name again
  ::fchmod(file.fd, S_IRUSR | S_IWUSR);
  // Every page now: on a full /dev/shm a sparse file's first touch would be a SIGBUS, not an error.
  const int err = ::posix_fallocate(file.fd, 0, static_cast<off_t>(bytes));
  TORCH_CHECK(err == 0, text("fastpar shm: cannot reserve ", bytes >> 20, " MB in /dev/shm for ", region->own_name,
                             ": ", errno_text(err)));
  region->bases[rank_] = map_file(file.fd, bytes, region->own_name);
  std::lock_guard<std::mutex> lock(mutex_);
  pending_[id] = std::move(region);
  return id;
}

std::shared_ptr<SharedRegion> SharedBuffers::pending(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = pending_.find(id);
  TORCH_CHECK(it != pending_.end(), text("fastpar shm: no shared buffer ", id, " is being created here"));
  return it->second;
}

void SharedBuffers::map_peers(int64_t id) {
  auto region = pending(id);
  for (int q = 0; q < world_; ++q) {
    if (q == rank_ || region->bases[q] != nullptr) continue;
    const std::string name = name_of(id, q);
    Fd file{::shm_open(name.c_str(), O_RDWR, 0)};
    TORCH_CHECK(file.fd >= 0, text("fastpar shm: cannot open rank ", q, "'s buffer ", name, ": ", errno_text(errno)));
    struct stat st {};
    const bool same = ::fstat(file.fd, &st) == 0 && st.st_uid == ::geteuid() &&
                      static_cast<size_t>(st.st_size) == region->bytes;
    TORCH_CHECK(same, text("fastpar shm: ", name, " is not rank ", q, "'s buffer of ", region->bytes, " bytes"));
    region->bases[q] = map_file(file.fd, region->bytes, name);
  }
}

void SharedBuffers::unlink_own(int64_t id) {
  auto region = pending(id);
  if (region->own_linked) ::shm_unlink(region->own_name.c_str());
  region->own_linked = false;
}

void SharedBuffers::release(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  pending_.erase(id);  // the region's destructor unmaps and unlinks
}

at::Tensor SharedBuffers::tensor(int64_t id, at::ScalarType dtype, int64_t numel) {
  std::shared_ptr<SharedRegion> region;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = pending_.find(id);
    TORCH_CHECK(it != pending_.end(), text("fastpar shm: no shared buffer ", id, " is being created here"));
    region = std::move(it->second);
    pending_.erase(it);
    TORCH_CHECK(numel >= 0 && static_cast<size_t>(numel) * c10::elementSize(dtype) <= region->bytes,
                text("fastpar shm: ", numel, " elements do not fit shared buffer ", id));
    for (int q = 0; q < world_; ++q) {
      TORCH_CHECK(region->bases[q] != nullptr,
                  text("fastpar shm: shared buffer ", id, " lacks rank ", q, "'s mapping"));
    }
    for (auto stale = live_.begin(); stale != live_.end();) {  // regions whose tensors are gone
      stale = stale->second.expired() ? live_.erase(stale) : std::next(stale);
    }
    live_[reinterpret_cast<uintptr_t>(region->bases[rank_])] = region;
  }
  char* base = region->bases[rank_];
  return at::from_blob(
      base, {numel}, [region](void*) mutable { region.reset(); }, at::TensorOptions().dtype(dtype));
}

namespace {
thread_local bool bucket_collective = false;
}  // namespace

bool BucketCollectiveScope::active() { return bucket_collective; }

bool BucketCollectiveScope::set(bool active) {
  const bool previous = bucket_collective;
  bucket_collective = active;
  return previous;
}

std::shared_ptr<SharedRegion> SharedBuffers::find(const void* data, size_t bytes, int64_t* offset) {
  const auto p = reinterpret_cast<uintptr_t>(data);
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.upper_bound(p);
  if (it == live_.begin()) return nullptr;
  --it;
  auto region = it->second.lock();
  if (!region) {
    live_.erase(it);
    return nullptr;
  }
  if (p + bytes > it->first + region->bytes) return nullptr;
  *offset = static_cast<int64_t>(p - it->first);
  return region;
}

}  // namespace fastpar::shm
