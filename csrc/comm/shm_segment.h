// shm_segment.h: one POSIX shared-memory segment, owner-only, mapped for the lifetime of the object.
//
// Security and leak model (see docs of ds_strategy.comm.shm):
// - the creator opens the name with O_CREAT | O_EXCL and mode 0600 under 128 random bits from getrandom,
//   so another local user can neither guess the name in advance nor open it (permission), and a planted
//   file of the same name makes creation fail instead of being reused;
// - an attacher checks with fstat that the segment belongs to its own effective uid and is 0600;
// - the name is unlinked as soon as every rank has attached (unlink()), so nothing is left in /dev/shm
//   whatever happens afterwards, crash included; the memory itself goes away with the last munmap.
#pragma once

#include <cstddef>
#include <string>

namespace ds::comm {

class Segment {
 public:
  // New segment of `bytes` bytes under a fresh random name (retrieved with name()).
  static Segment create(size_t bytes);
  // Existing segment created by a peer; its size comes from fstat.
  static Segment attach(const std::string& name);

  Segment() = default;
  Segment(Segment&& other) noexcept;
  Segment& operator=(Segment&& other) noexcept;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  ~Segment();

  // Remove the name from /dev/shm (creator only; a no-op when already done or when attached).
  void unlink() noexcept;

  void* data() const { return base_; }
  size_t size() const { return bytes_; }
  const std::string& name() const { return name_; }
  bool linked() const { return linked_; }
  unsigned mode() const { return mode_; }  // permission bits seen by fstat when the segment was opened
  unsigned uid() const { return uid_; }    // owner seen by fstat

 private:
  void release() noexcept;  // unlink (creator) and munmap

  void* base_ = nullptr;
  size_t bytes_ = 0;
  std::string name_;
  bool linked_ = false;  // this object created the name and has not unlinked it yet
  unsigned mode_ = 0;
  unsigned uid_ = 0;
};

}  // namespace ds::comm
