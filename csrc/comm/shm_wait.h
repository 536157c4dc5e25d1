// shm_wait.h: the waiting primitives shared by the shared-memory collectives and channels: a CPU pause
// for short spins, a futex sleep / wake on the low half of a 64-bit counter in shared memory (and the
// publish / sleep_below pair built on it), and the dead-peer test (a pid only compares within one pid
// namespace).
#pragma once

#include <linux/futex.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <ctime>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DS_CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define DS_CPU_RELAX() asm volatile("yield" ::: "memory")
#else
#define DS_CPU_RELAX() ((void)0)
#endif

namespace ds::comm {

// Shared (not PRIVATE) futexes, since the waiters are other processes mapping the same memory; the word is
// the low 32 bits of the counter (little endian: they come first).
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "futex word = low half of the counter");

inline uint32_t* futex_word(std::atomic<uint64_t>* counter) { return reinterpret_cast<uint32_t*>(counter); }

inline void futex_wake_all(std::atomic<uint64_t>* counter) {
  syscall(SYS_futex, futex_word(counter), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

inline void futex_wait(std::atomic<uint64_t>* counter, uint64_t seen, double seconds) {
  seconds = std::max(seconds, 1e-4);
  struct timespec ts {};
  ts.tv_sec = static_cast<time_t>(seconds);
  ts.tv_nsec = static_cast<long>((seconds - static_cast<double>(ts.tv_sec)) * 1e9);
  // Returns at once when the word no longer holds `seen` (EAGAIN), on a wake, a signal or the timeout.
  syscall(SYS_futex, futex_word(counter), FUTEX_WAIT, static_cast<uint32_t>(seen), &ts, nullptr, 0);
}

// The two halves of a sleep on a shared counter with no lost wake-up. Both sides are seq_cst (the
// publisher stores the counter, then loads `sleepers`; a sleeper adds itself to `sleepers`, then loads the
// counter), so either the sleeper sees the new value or the publisher sees the sleeper and wakes it.
inline void publish(std::atomic<uint64_t>& counter, std::atomic<uint32_t>& sleepers, uint64_t value) {
  counter.store(value, std::memory_order_seq_cst);  // also a release: writes before it are visible first
  if (sleepers.load(std::memory_order_seq_cst) != 0) futex_wake_all(&counter);
}

// Sleep while `counter` is below `target`, at most `seconds`; returns on a change, a wake-up or the timeout.
inline void sleep_below(std::atomic<uint64_t>& counter, std::atomic<uint32_t>& sleepers, uint64_t target,
                        double seconds) {
  sleepers.fetch_add(1, std::memory_order_seq_cst);
  const uint64_t seen = counter.load(std::memory_order_seq_cst);
  if (seen < target) futex_wait(&counter, seen, seconds);
  sleepers.fetch_sub(1, std::memory_order_seq_cst);
}

inline uint64_t own_pid_namespace() {
  struct stat st {};
  return stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

// True only when `pid` (seen in pid namespace `ns`) has certainly exited; unknown stays false.
inline bool peer_exited(int64_t pid, uint64_t ns) {
  const uint64_t mine = own_pid_namespace();
  if (mine == 0 || ns != mine || pid <= 0) return false;
  return kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

}  // namespace ds::comm
