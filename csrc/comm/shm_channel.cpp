// shm_channel.cpp: the one-way shared-memory queue (protocol in shm_channel.h).
#include "shm_channel.h"

#include <c10/util/Exception.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "shm_wait.h"

namespace ds::comm {
namespace {

constexpr uint64_t kMagic = 0x316e6e6168636473ull;  // "dschann1"
constexpr int64_t kAlign = 4096;
constexpr int64_t kSizeWord = 64;  // each slot starts with the message size, on its own cache line
constexpr int kSpins = 4096;      // pause iterations (~100 us) before sleeping on a futex

struct alignas(128) ChannelHeader {
  uint64_t magic;
  int64_t slots;
  int64_t slot_bytes;
  int64_t total_bytes;
};

int64_t round_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

int64_t control_bytes() {
  return round_up(static_cast<int64_t>(sizeof(ChannelHeader) + 2 * sizeof(ChannelSide)), kAlign);
}

}  // namespace

Channel::Channel(const std::string& name, int64_t slots, int64_t slot_bytes) {
  if (name.empty()) {
    TORCH_CHECK(slots >= 1, "shm channel: slots must be at least 1, got ", slots);
    TORCH_CHECK(slot_bytes >= 1, "shm channel: slot_bytes must be positive, got ", slot_bytes);
    producer_ = true;
    slots_ = slots;
    slot_bytes_ = round_up(slot_bytes, kSizeWord);
    const int64_t total = control_bytes() + slots_ * (kSizeWord + slot_bytes_);
    segment_ = Segment::create(static_cast<size_t>(total));
    auto* header = static_cast<ChannelHeader*>(segment_.data());
    header->slots = slots_;
    header->slot_bytes = slot_bytes_;
    header->total_bytes = total;
    std::atomic_thread_fence(std::memory_order_release);
    header->magic = kMagic;
  } else {
    segment_ = Segment::attach(name);
    const auto* header = static_cast<const ChannelHeader*>(segment_.data());
    TORCH_CHECK(segment_.size() >= sizeof(ChannelHeader) && header->magic == kMagic, "shm channel: ", name,
                " is not an initialised ds_strategy channel");
    TORCH_CHECK(static_cast<int64_t>(segment_.size()) == header->total_bytes, "shm channel: segment ", name,
                " has ", segment_.size(), " bytes, its header says ", header->total_bytes);
    slots_ = header->slots;
    slot_bytes_ = header->slot_bytes;
    // Both ends are mapped now: drop the name, so a crash of either cannot leave it in /dev/shm.
    shm_unlink(name.c_str());
  }
  name_ = segment_.name();
  ChannelSide& mine = side(producer_);
  mine.pid_ns.store(own_pid_namespace(), std::memory_order_relaxed);
  mine.pid.store(static_cast<int64_t>(getpid()), std::memory_order_release);
}

ChannelSide& Channel::side(bool producer) const {
  auto* lines = reinterpret_cast<ChannelSide*>(static_cast<char*>(segment_.data()) + sizeof(ChannelHeader));
  return lines[producer ? 0 : 1];
}

char* Channel::slot(uint64_t k) const {
  return static_cast<char*>(segment_.data()) + control_bytes() +
         static_cast<int64_t>(k % static_cast<uint64_t>(slots_)) * (kSizeWord + slot_bytes_);
}

bool Channel::wait_for(ChannelSide& other, uint64_t target, double seconds, const char* what) {
  for (int spins = 0; spins < kSpins; ++spins) {  // a peer on another core usually moves within microseconds
    if (other.count.load(std::memory_order_acquire) >= target) return true;
    DS_CPU_RELAX();
  }
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  for (;;) {
    if (other.count.load(std::memory_order_acquire) >= target) return true;
    if (peer_exited(other.pid.load(std::memory_order_acquire), other.pid_ns.load(std::memory_order_relaxed))) {
      TORCH_CHECK(false, "shm channel ", what, ": the ", producer_ ? "receiving" : "sending", " process (pid ",
                  other.pid.load(std::memory_order_relaxed), ") has exited");
    }
    const double waited = std::chrono::duration<double>(clock::now() - start).count();
    if (waited >= seconds) return false;
    sleep_below(other.count, other.sleepers, target, std::min(0.05, seconds - waited));
  }
}

bool Channel::send(const void* data, int64_t bytes, double seconds) {
  TORCH_CHECK(producer_, "shm channel send: this end attached as the receiver");
  TORCH_CHECK(bytes >= 0 && bytes <= slot_bytes_, "shm channel send: a message of ", bytes,
              " bytes does not fit the channel's ", slot_bytes_, "-byte slots");
  const uint64_t k = next_;
  if (k >= static_cast<uint64_t>(slots_) && !wait_for(side(false), k - slots_ + 1, seconds, "send")) return false;
  if (segment_.linked() && side(false).pid.load(std::memory_order_acquire) != 0) segment_.unlink();  // it did
  char* s = slot(k);
  *reinterpret_cast<int64_t*>(s) = bytes;
  std::memcpy(s + kSizeWord, data, static_cast<size_t>(bytes));
  ChannelSide& me = side(true);
  publish(me.count, me.sleepers, k + 1);  // a release: the bytes above are visible before the count
  next_ = k + 1;
  return true;
}

bool Channel::recv(void* data, int64_t bytes, double seconds) {
  TORCH_CHECK(!producer_, "shm channel recv: this end created the channel and can only send");
  const uint64_t k = next_;
  if (!wait_for(side(true), k + 1, seconds, "recv")) return false;
  const char* s = slot(k);
  const int64_t sent = *reinterpret_cast<const int64_t*>(s);
  TORCH_CHECK(sent == bytes, "shm channel recv: message ", k, " has ", sent, " bytes, the receiver expected ", bytes,
              " (the two ends disagree on the negotiated shapes)");
  std::memcpy(data, s + kSizeWord, static_cast<size_t>(bytes));
  ChannelSide& me = side(false);
  publish(me.count, me.sleepers, k + 1);  // the bytes were read out before the slot is handed back
  next_ = k + 1;
  return true;
}

}  // namespace ds::comm
