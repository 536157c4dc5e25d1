// shm_segment.cpp: POSIX shm_open / mmap / shm_unlink behind the RAII Segment (see shm_segment.h).
#include "shm_segment.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <utility>

namespace ds::comm {
namespace {

constexpr const char* kPrefix = "/ds_strategy_shm.";

std::string errno_text(int err) { return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")"; }

void random_bytes(unsigned char* out, size_t n) {
  size_t got = 0;
  while (got < n) {
    const ssize_t r = getrandom(out + got, n - got, 0);
    if (r < 0 && errno == EINTR) continue;
    TORCH_CHECK(r > 0, "shm segment: getrandom failed: ", errno_text(errno));
    got += static_cast<size_t>(r);
  }
}

std::string random_name() {
  unsigned char raw[16];
  random_bytes(raw, sizeof(raw));
  static const char* hex = "0123456789abcdef";
  std::string name(kPrefix);
  for (unsigned char b : raw) {
    name.push_back(hex[b >> 4]);
    name.push_back(hex[b & 15]);
  }
  return name;
}

void* map_fd(int fd, size_t bytes, const std::string& name) {
  // MAP_POPULATE: fault every page in now, not inside the first (timed) collective.
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  TORCH_CHECK(p != MAP_FAILED, "shm segment ", name, ": mmap of ", bytes, " bytes failed: ", errno_text(errno));
  return p;
}

}  // namespace

Segment Segment::create(size_t bytes) {
  TORCH_CHECK(bytes > 0, "shm segment: size must be positive");
  Segment seg;
  int fd = -1;
  for (int attempt = 0; attempt < 4 && fd < 0; ++attempt) {
    seg.name_ = random_name();
    fd = shm_open(seg.name_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    TORCH_CHECK(fd >= 0 || errno == EEXIST, "shm segment: shm_open(", seg.name_, ") failed: ", errno_text(errno));
  }
  TORCH_CHECK(fd >= 0, "shm segment: 4 random names in a row already existed; refusing to continue");
  seg.linked_ = true;  // from here on the destructor unlinks the name if anything below throws
  // The umask can only narrow 0600, but make the mode explicit anyway.
  const bool ok = fchmod(fd, 0600) == 0 && ftruncate(fd, static_cast<off_t>(bytes)) == 0;
  const int err = errno;
  struct stat st {};
  const bool stat_ok = ok && fstat(fd, &st) == 0;
  if (!stat_ok) {
    close(fd);
    TORCH_CHECK(false, "shm segment ", seg.name_, ": sizing to ", bytes, " bytes failed: ", errno_text(err),
                " (is /dev/shm large enough?)");
  }
  seg.mode_ = st.st_mode & 07777;
  seg.uid_ = st.st_uid;
  try {
    seg.base_ = map_fd(fd, bytes, seg.name_);
  } catch (...) {
    close(fd);
    throw;
  }
  close(fd);
  seg.bytes_ = bytes;
  return seg;
}

Segment Segment::attach(const std::string& name) {
  TORCH_CHECK(name.rfind(kPrefix, 0) == 0, "shm segment: refusing to attach to '", name,
              "', which is not a ds_strategy segment name");
  const int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  TORCH_CHECK(fd >= 0, "shm segment: attaching to ", name, " failed: ", errno_text(errno),
              " (the creating rank unlinks it once every rank attached; was it created on another host?)");
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    TORCH_CHECK(false, "shm segment ", name, ": fstat failed: ", errno_text(err));
  }
  // Someone else's segment under our name would let them read or write our gradients: refuse it.
  if (st.st_uid != geteuid() || (st.st_mode & 0777) != 0600) {
    close(fd);
    TORCH_CHECK(false, "shm segment ", name, " is owned by uid ", st.st_uid, " with mode ", std::oct,
                (st.st_mode & 0777), std::dec, "; expected our uid ", geteuid(), " and mode 600. Refusing it.");
  }
  Segment seg;
  seg.name_ = name;
  seg.mode_ = st.st_mode & 07777;
  seg.uid_ = st.st_uid;
  try {
    TORCH_CHECK(st.st_size > 0, "shm segment ", name, " is empty");
    seg.base_ = map_fd(fd, static_cast<size_t>(st.st_size), name);
  } catch (...) {
    close(fd);
    throw;
  }
  close(fd);
  seg.bytes_ = static_cast<size_t>(st.st_size);
  return seg;
}

Segment::Segment(Segment&& other) noexcept { *this = std::move(other); }

Segment& Segment::operator=(Segment&& other) noexcept {
  if (this != &other) {
    release();
    base_ = std::exchange(other.base_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    name_ = std::move(other.name_);
    linked_ = std::exchange(other.linked_, false);
    mode_ = other.mode_;
    uid_ = other.uid_;
  }
  return *this;
}

void Segment::unlink() noexcept {
  if (linked_) {
    shm_unlink(name_.c_str());
    linked_ = false;
  }
}

Segment::~Segment() { release(); }

void Segment::release() noexcept {
  unlink();
  if (base_ != nullptr) munmap(base_, bytes_);
  base_ = nullptr;
  bytes_ = 0;
}

}  // namespace ds::comm
