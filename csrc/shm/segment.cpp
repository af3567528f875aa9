// POSIX shared memory for fastpar's same-host collectives: create/open/unlink a group's segment and the robust
// mutexes that tell the other ranks a process died (the kernel marks them when their owner exits, kill -9 included).
#include "shm/segment.h"
#include "text.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>
#include <utility>

namespace fastpar::shm {
namespace {

constexpr uint64_t kMagic = 0x66617374706172'04ULL;  // "fastpar", layout version 4
constexpr size_t kPage = 4096;

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

size_t data_offset(int world) { return round_up(sizeof(Header) + world * sizeof(RankBlock), kPage); }

std::string errno_text(int err) { return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")"; }

// Closes a descriptor on every path.
struct Fd {
  int fd;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

void init_robust_mutex(pthread_mutex_t* mutex) {
  pthread_mutexattr_t attr;
  pthread_mutexattr_init(&attr);
  pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  const int err = pthread_mutex_init(mutex, &attr);
  pthread_mutexattr_destroy(&attr);
  TORCH_CHECK(err == 0, text("fastpar shm: cannot initialise a process-shared robust mutex: ", errno_text(err)));
}

}  // namespace

size_t Segment::size_for(int world, size_t slot_bytes, int buffers) {
  // a staging slot per rank and buffer, plus one result slot per buffer
  return data_offset(world) + static_cast<size_t>(world + 1) * buffers * slot_bytes;
}

void Segment::create(const std::string& name, int world, size_t slot_bytes, int buffers, uint64_t token) {
  TORCH_CHECK(world >= 1 && world <= kMaxRanks, text("fastpar shm: world size ", world, " outside 1..", kMaxRanks));
  TORCH_CHECK(slot_bytes % kPage == 0 && slot_bytes > 0, "fastpar shm: slot size must be a multiple of 4096");
  TORCH_CHECK(buffers >= 2 && buffers <= kMaxBuffers, text("fastpar shm: buffers must be 2..", kMaxBuffers));
  const size_t size = size_for(world, slot_bytes, buffers);
  Fd file{::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, S_IRUSR | S_IWUSR)};
  TORCH_CHECK(file.fd >= 0, text("fastpar shm: cannot create ", name, ": ", errno_text(errno)));
  ::fchmod(file.fd, S_IRUSR | S_IWUSR);  // 0600 whatever the umask: gradients are nobody else's business
  // Reserve every page now: on a full /dev/shm, touching a page of a sparse file kills the process with SIGBUS.
  const int err = ::posix_fallocate(file.fd, 0, static_cast<off_t>(size));
  if (err != 0) {
    ::shm_unlink(name.c_str());
    TORCH_CHECK(false, text("fastpar shm: cannot reserve ", size >> 20, " MB in /dev/shm for ", name, ": ",
                            errno_text(err),
                            ". Free space there (df -h /dev/shm; in Docker pass --shm-size) or use gloo"));
  }
  void* base = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, file.fd, 0);
  if (base == MAP_FAILED) {
    const int map_err = errno;
    ::shm_unlink(name.c_str());
    TORCH_CHECK(false, text("fastpar shm: cannot map ", name, ": ", errno_text(map_err)));
  }
  auto* header = new (base) Header();
  for (int r = 0; r < world; ++r) {
    auto* block = new (static_cast<char*>(base) + sizeof(Header) + r * sizeof(RankBlock)) RankBlock();
    init_robust_mutex(&block->alive);
  }
  header->token = token;
  header->world = static_cast<uint32_t>(world);
  header->buffers = static_cast<uint32_t>(buffers);
  header->slot_bytes = slot_bytes;
  header->data_offset = data_offset(world);
  header->total_bytes = size;
  std::atomic_thread_fence(std::memory_order_release);
  header->magic = kMagic;  // last: a segment with the magic is complete
  ::munmap(base, size);
}

Segment Segment::open(const std::string& name, int world, uint64_t token) {
  Fd file{::shm_open(name.c_str(), O_RDWR, 0)};
  TORCH_CHECK(file.fd >= 0, text("fastpar shm: cannot open ", name, ": ", errno_text(errno),
              " (is /dev/shm shared by all ranks, e.g. the same container?)"));
  struct stat st {};
  TORCH_CHECK(::fstat(file.fd, &st) == 0, text("fastpar shm: cannot stat ", name, ": ", errno_text(errno)));
  TORCH_CHECK(st.st_uid == ::geteuid(),
              text("fastpar shm: ", name, " belongs to uid ", st.st_uid, ", not to this user"));
  const size_t size = static_cast<size_t>(st.st_size);
  TORCH_CHECK(size >= sizeof(Header), text("fastpar shm: ", name, " is too small to be a fastpar segment"));
  void* base = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, file.fd, 0);
  TORCH_CHECK(base != MAP_FAILED, text("fastpar shm: cannot map ", name, ": ", errno_text(errno)));
  Segment segment;
  segment.base_ = static_cast<char*>(base);
  segment.size_ = size;
  const Header& header = segment.header();
  TORCH_CHECK(header.magic == kMagic && header.token == token, text("fastpar shm: ", name,
              " is not this group's segment (another job's, or another /dev/shm)"));
  TORCH_CHECK(header.world == static_cast<uint32_t>(world) && header.total_bytes == size,
              text("fastpar shm: ", name, " was made for ", header.world, " ranks, this group has ", world));
  return segment;
}

void Segment::unlink(const std::string& name) { ::shm_unlink(name.c_str()); }

Segment::Segment(Segment&& other) noexcept
    : base_(std::exchange(other.base_, nullptr)), size_(std::exchange(other.size_, 0)) {}

Segment& Segment::operator=(Segment&& other) noexcept {
  if (this != &other) {
    if (base_ != nullptr) ::munmap(base_, size_);
    base_ = std::exchange(other.base_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

Segment::~Segment() {
  if (base_ != nullptr) ::munmap(base_, size_);
}

RankBlock& Segment::rank(int r) const {
  return *reinterpret_cast<RankBlock*>(base_ + sizeof(Header) + r * sizeof(RankBlock));
}

char* Segment::stage(int q, uint64_t s) const {
  const Header& h = header();
  return base_ + h.data_offset + (static_cast<size_t>(q) * h.buffers + s % h.buffers) * h.slot_bytes;
}

char* Segment::result(uint64_t s) const {
  const Header& h = header();
  return base_ + h.data_offset + (static_cast<size_t>(h.world) * h.buffers + s % h.buffers) * h.slot_bytes;
}

void join(RankBlock& block, int pid) {
  const int err = pthread_mutex_lock(&block.alive);
  TORCH_CHECK(err == 0, text("fastpar shm: cannot take this rank's liveness lock: ", errno_text(err)));
  block.pid = pid;
  block.state.store(static_cast<uint32_t>(RankState::kJoined), std::memory_order_release);
}

void leave(RankBlock& block) {
  block.state.store(static_cast<uint32_t>(RankState::kLeft), std::memory_order_release);
  pthread_mutex_unlock(&block.alive);
}

Liveness probe(RankBlock& block) {
  const auto state = static_cast<RankState>(block.state.load(std::memory_order_acquire));
  if (state == RankState::kLeft) return Liveness::kLeft;
  const int err = pthread_mutex_trylock(&block.alive);
  if (err == EBUSY) return Liveness::kAlive;
  if (err == EOWNERDEAD || err == ENOTRECOVERABLE) {
    // Unlocking without pthread_mutex_consistent leaves it ENOTRECOVERABLE: every later probe says dead too.
    if (err == EOWNERDEAD) pthread_mutex_unlock(&block.alive);
    return Liveness::kDead;
  }
  if (err == 0) pthread_mutex_unlock(&block.alive);
  return state == RankState::kJoined ? Liveness::kLeft : Liveness::kAbsent;
}

}  // namespace fastpar::shm
