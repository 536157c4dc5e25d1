// shm_channel.h: a one-way, bounded queue of byte messages from one process to another on the same host,
// through one shared-memory segment: the pipeline's point-to-point path between neighbouring stages.
//
// Segment layout: [header][producer line][consumer line][slots x (64-byte size word + slot_bytes)]
//
// Message k goes into slot k % slots. The producer waits until the consumer has taken message k - slots
// (consumed >= k - slots + 1), copies the bytes in, then publishes produced = k + 1 (release); the consumer
// waits until produced > k (acquire), copies the bytes out, then publishes consumed = k + 1. So a send
// only blocks when `slots` messages are unread, and nothing is ever overwritten before it was read.
// Waits spin briefly, then sleep on a futex on the other side's counter (woken when it moves); they give
// up after the caller's `seconds` and return false, so the caller can look at its own failure notices
// between tries, and raise at once when the peer's process has exited.
//
// Lifetime (the segment rules of shm_segment.h): the producer creates the segment owner-only under a
// random name; the consumer attaches and unlinks the name straight away, so nothing is left in /dev/shm
// once both ends are mapped, whatever happens afterwards.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "shm_segment.h"

namespace ds::comm {

struct alignas(128) ChannelSide {
  std::atomic<uint64_t> count;     // messages this side has produced / consumed
  std::atomic<int64_t> pid;        // 0 until this side has mapped the segment
  std::atomic<uint64_t> pid_ns;    // inode of its pid namespace (pids only compare within one)
  std::atomic<uint32_t> sleepers;  // waiters asleep on `count`: wake them when it moves
};

class Channel {
 public:
  // An empty `name` creates a new channel (the producer end; publish name() to the consumer), otherwise
  // attaches to it as the consumer (then slots and slot_bytes come from the segment and are ignored).
  Channel(const std::string& name, int64_t slots, int64_t slot_bytes);

  const std::string& name() const { return name_; }
  int64_t slots() const { return slots_; }
  int64_t slot_bytes() const { return slot_bytes_; }

  // Copy `bytes` (at most slot_bytes) into the next slot; false when no slot freed up within `seconds`.
  bool send(const void* data, int64_t bytes, double seconds);
  // Copy the next message (which must be `bytes` long) out; false when none arrived within `seconds`.
  bool recv(void* data, int64_t bytes, double seconds);

 private:
  ChannelSide& side(bool producer) const;
  char* slot(uint64_t k) const;
  // Wait until `other`'s count reaches `target`; false after `seconds`.
  bool wait_for(ChannelSide& other, uint64_t target, double seconds, const char* what);

  Segment segment_;
  std::string name_;
  bool producer_ = false;
  int64_t slots_ = 0;
  int64_t slot_bytes_ = 0;
  uint64_t next_ = 0;  // this end's next message number
};

}  // namespace ds::comm
