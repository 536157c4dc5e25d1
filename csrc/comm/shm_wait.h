// shm_wait.h: the waiting primitives shared by the shared-memory collectives and channels: a CPU pause
// for short spins, a futex sleep / wake on the low half of a 64-bit counter in shared memory, and the
// dead-peer test (a pid only compares within one pid namespace).
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
