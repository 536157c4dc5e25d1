// shm_collectives.h: all-reduce, reduce-scatter and all-gather between the ranks of one node through one
// shared-memory segment (plain C++ on raw buffers; the tensor checks live in shm_ops.cpp).
//
// Segment layout:  [header][one 128-byte control line per rank][data: 2 sets x W slots x slot_bytes]
//
// Synchronisation is a sense-free counting barrier: rank r publishes "I have arrived k times" in its own
// control line and waits until every other line shows >= k. Waits spin briefly (~100 us), then sleep on
// a futex on the missing rank's counter (woken by its arrival; the machine may have fewer cores than
// runnable processes), check the clock every 50 ms at most, and raise after `timeout` seconds naming the
// ranks that never arrived, or within ~50 ms when such a rank's process has exited.
//
// Double buffering: consecutive steps (chunks) alternate between the two slot sets. A step's writes into
// a set happen before that step's first barrier, and every read of step k happens before the reading
// rank arrives at step k+1's first barrier; so once a rank has passed step k+1's first barrier nobody
// still reads step k's set, and step k+2 may overwrite it. No trailing barrier is needed, within an op
// or between ops.
//
// Algorithms (W ranks, N bytes per rank for all-reduce; see docs/performance.md for the traffic bounds):
// - all_reduce, small (<= small_bytes): copy in, barrier, every rank sums all slots itself (1 barrier).
// - all_reduce, large, per chunk: each rank copies the W-1 slices it does not own into its slot, barrier,
//   sums its own slice over all slots (its own part read from its tensor) into its tensor and its slot,
//   barrier, copies the W-1 reduced slices of the others out (reduce-scatter + all-gather, 2 barriers).
// - reduce_scatter, per chunk: copy the W-1 foreign pieces in, barrier, sum own piece (1 barrier).
// - all_gather, per chunk: copy own piece in and to its place in the output (one read), barrier, copy the
//   others out; outputs from 8 MiB are written with streaming stores (no read-for-ownership of cold lines).
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "../includes/dtypes.h"
#include "shm_segment.h"

namespace ds::comm {

enum class OpKind : int32_t { kNone = 0, kAllReduce = 1, kReduceScatter = 2, kAllGather = 3, kAllToAll = 4 };

struct OpDesc {
  int32_t kind;
  int32_t dtype;
  int64_t numel;
  int64_t tag;  // the caller's label for this call (0: none); must match too, see all_gather
};

// One cache-line pair per rank so that a rank's stores never invalidate a line another rank polls.
struct alignas(128) RankControl {
  std::atomic<uint64_t> arrived;  // barriers this rank has reached
  std::atomic<int64_t> pid;       // for the dead-peer check
  std::atomic<uint64_t> pid_ns;   // inode of the rank's pid namespace (pids only compare within one)
  std::atomic<uint32_t> sleepers; // ranks asleep on this rank's `arrived` futex: wake them on arrival
  OpDesc desc[2];                 // the current op (index = op count % 2), checked after its first barrier
};
static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared-memory atomics must be lock free");

class Communicator {
 public:
  // An empty `name` creates a new segment (then publish name() to the peers); otherwise attaches to it.
  Communicator(int rank, int world_size, int64_t slot_bytes, int64_t small_bytes, double timeout_s,
               const std::string& name);

  const std::string& name() const { return segment_.name(); }
  void unlink() { segment_.unlink(); }
  bool linked() const { return segment_.linked(); }
  unsigned mode() const { return segment_.mode(); }
  unsigned uid() const { return segment_.uid(); }
  size_t segment_bytes() const { return segment_.size(); }
  int64_t slot_bytes() const { return slot_bytes_; }
  int64_t small_bytes() const { return small_bytes_; }
  void set_timeout(double seconds);
  double timeout() const { return timeout_s_; }

  void all_reduce(void* data, int64_t numel, DType dtype, bool avg, int threads);
  void reduce_scatter(void* out, const void* in, int64_t out_numel, DType dtype, bool avg, int threads);
  // `tag` is compared across ranks like the op, dtype and size (ZeRO-3 passes which module's gather this is,
  // so ranks on different code paths fail here, naming their modules, instead of pairing wrong buckets).
  void all_gather(void* out, const void* in, int64_t in_numel, DType dtype, int threads, int64_t tag = 0);
  // out[r * n:(r + 1) * n] = rank r's in[rank * n:(rank + 1) * n] (n = piece_numel); out and in disjoint.
  void all_to_all(void* out, const void* in, int64_t piece_numel, DType dtype, int threads);
  // Every rank's tag for the latest collective (valid after it returned or raised a mismatch).
  std::vector<int64_t> peer_tags() const;

 private:
  RankControl& control(int r) const;
  char* slot(int set, int r) const;
  void begin_op(OpKind kind, DType dtype, int64_t numel, const char* op, int64_t tag = 0);
  void barrier(const char* op);
  void check_peers(const char* op) const;
  // Raise naming the missing ranks; with dead_only, only when one of them has exited (else return).
  void fail_waiting(const char* op, uint64_t target, bool dead_only);

  Segment segment_;
  int rank_;
  int world_;
  int64_t slot_bytes_;
  int64_t small_bytes_;
  int64_t stream_bytes_ = 0;  // all_gather outputs of at least this size are written with streaming stores
  double timeout_s_;
  char* data_ = nullptr;
  uint64_t arrivals_ = 0;  // barriers passed (the same on every rank)
  uint64_t steps_ = 0;     // chunks processed: picks the slot set
  uint64_t ops_ = 0;       // collectives started
  OpDesc current_{};
  bool broken_ = false;  // a wait timed out: the ranks' counters no longer agree
  bool check_liveness_ = true;
};

}  // namespace ds::comm
