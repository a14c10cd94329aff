#include "runtime/shm_segment.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>

#include "core/error.hpp"
#include "core/log.hpp"
#include "runtime/huge_pages.hpp"

namespace tutti {
namespace {
std::atomic<uint64_t> g_counter{0};

// An address for `bytes` at a huge-page boundary: a reservation one huge page larger, trimmed.
// nullptr (any address) for small segments or when the reservation fails.
void* huge_aligned_address(size_t bytes) {
  if (bytes < kHugePageBytes) return nullptr;
  void* r = mmap(nullptr, bytes + kHugePageBytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (r == MAP_FAILED) return nullptr;
  const auto begin = reinterpret_cast<uintptr_t>(r), end = begin + bytes + kHugePageBytes;
  const uintptr_t at = (begin + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  if (at > begin) munmap(r, at - begin);
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t tail = (at + bytes + page - 1) / page * page;
  if (end > tail) munmap(reinterpret_cast<void*>(tail), end - tail);
  return reinterpret_cast<void*>(at);
}

std::shared_ptr<ShmSegment::Mapping> map(int fd, size_t bytes, const std::string& name) {
  // MAP_FIXED replaces our own reservation, nothing else.
  void* at = huge_aligned_address(bytes);
  void* p = mmap(at, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | (at ? MAP_FIXED : 0), fd, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    if (at) munmap(at, bytes);
    throw SystemError(fmt::format("mmap of shared segment {} ({} bytes)", name, bytes), err);
  }
  auto m = std::make_shared<ShmSegment::Mapping>();
  m->data = p;
  m->size = bytes;
  return m;
}

// This process's mappings by segment name (entries of unmapped segments expire).
std::mutex g_mappings_mutex;
std::map<std::string, std::weak_ptr<ShmSegment::Mapping>> g_mappings;

void remember(const std::string& name, const std::shared_ptr<ShmSegment::Mapping>& m) {
  std::lock_guard lock(g_mappings_mutex);
  for (auto it = g_mappings.begin(); it != g_mappings.end();) it = it->second.expired() ? g_mappings.erase(it) : std::next(it);
  g_mappings[name] = m;
}

std::shared_ptr<ShmSegment::Mapping> recall(const std::string& name, size_t bytes) {
  std::lock_guard lock(g_mappings_mutex);
  auto it = g_mappings.find(name);
  if (it == g_mappings.end()) return nullptr;
  auto m = it->second.lock();
  return m && (bytes == 0 || bytes <= m->size) ? m : nullptr;
}
}  // namespace

ShmSegment::Mapping::~Mapping() {
  if (data) munmap(data, size);
}

ShmSegment ShmSegment::create(const std::string& what, size_t bytes) {
  ShmSegment s;
  // Owner-only, never reused, and named with 64 random bits: another user on the host can neither
  // guess a name to create it first (which would make this rank fail or, worse, use their memory)
  // nor open it. The pid stays first so sweep_stale_segments() can tell whose it was.
  int fd = -1;
  for (int attempt = 0; fd < 0; ++attempt) {
    uint64_t nonce = 0;
    if (getrandom(&nonce, sizeof(nonce), 0) != static_cast<ssize_t>(sizeof(nonce)))
      throw_system_error("getrandom() for a shared segment name");
    s.name_ = fmt::format("/tutti-{}-{:016x}-{}-{}", getpid(), nonce, g_counter.fetch_add(1), what);
    fd = shm_open(s.name_.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0 && (errno != EEXIST || attempt == 3)) throw_system_error(fmt::format("shm_open({})", s.name_));
  }
  s.owner_ = true;
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    int err = errno;
    ::close(fd);
    shm_unlink(s.name_.c_str());
    throw SystemError(fmt::format("ftruncate of shared segment {} to {} bytes (is /dev/shm full?)", s.name_, bytes), err);
  }
  // The pages are reserved now: tmpfs grants a size without backing it, and a write to a page that
  // then finds /dev/shm full is a SIGBUS in the middle of a collective (a container's /dev/shm is
  // often 64 MiB). Filesystems without fallocate keep the sparse segment.
  int err = 0;
  do err = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  while (err == EINTR);  // a signal during a large reservation
  if (err != 0 && err != EOPNOTSUPP && err != EINVAL) {
    ::close(fd);
    shm_unlink(s.name_.c_str());
    throw SystemError(fmt::format("shared segment {} of {} bytes does not fit in /dev/shm", s.name_, bytes), err);
  }
  try {
    s.mapping_ = map(fd, bytes, s.name_);
  } catch (...) {
    ::close(fd);
    shm_unlink(s.name_.c_str());
    throw;
  }
  ::close(fd);
  remember(s.name_, s.mapping_);
  TUTTI_TRACE(log::kShm, "created shared segment {} ({} bytes)", s.name_, bytes);
  return s;
}

ShmSegment ShmSegment::open(const std::string& name, size_t bytes) {
  ShmSegment s;
  s.name_ = name;
  if ((s.mapping_ = recall(name, bytes))) return s;  // a rank of this process made it
  int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) throw_system_error(fmt::format("shm_open({}) of a peer's segment", name));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    throw SystemError(fmt::format("fstat of a peer's segment {}", name), err);
  }
  // A peer of this job runs as this user and makes its segments owner-only: anything else was made
  // by someone else under the name a peer announced.
  if (st.st_uid != geteuid() || (st.st_mode & 077) != 0) {
    ::close(fd);
    throw RemoteError(fmt::format("shared segment {} is owned by uid {} with mode {:o}, not by this user (uid {}) "
                                  "with mode 600: refusing a segment this job did not create",
                                  name, st.st_uid, st.st_mode & 0777, geteuid()));
  }
  if (bytes == 0) bytes = static_cast<size_t>(st.st_size);
  try {
    s.mapping_ = map(fd, bytes, name);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  remember(name, s.mapping_);
  return s;
}

ShmSegment& ShmSegment::operator=(ShmSegment&& o) noexcept {
  if (this != &o) {
    unlink();  // (calling the destructor here ended the members' lifetimes before assigning to them)
    mapping_ = std::move(o.mapping_);
    name_ = std::move(o.name_);
    owner_ = std::exchange(o.owner_, false);
  }
  return *this;
}

void ShmSegment::unlink() {
  if (owner_) {
    shm_unlink(name_.c_str());
    owner_ = false;
  }
}

ShmSegment::~ShmSegment() {
  unlink();
  mapping_.reset();
}

int sweep_stale_segments() {
  int removed = 0;
  DIR* dir = opendir("/dev/shm");
  if (!dir) return 0;
  while (dirent* e = readdir(dir)) {
    int pid = 0;
    if (std::sscanf(e->d_name, "tutti-%d-", &pid) != 1 || pid <= 0) continue;
    if (kill(pid, 0) == 0 || errno != ESRCH) continue;
    if (shm_unlink((std::string("/") + e->d_name).c_str()) == 0) {
      ++removed;
      TUTTI_INFO(log::kShm, "removed stale shared segment /dev/shm/{} of dead process {}", e->d_name, pid);
    }
  }
  closedir(dir);
  return removed;
}

}  // namespace tutti
