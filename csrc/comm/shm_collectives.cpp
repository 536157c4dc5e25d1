// shm_collectives.cpp: the barrier and the three collectives (algorithms described in shm_collectives.h).
#include "shm_collectives.h"

#include <c10/util/Exception.h>
#include <omp.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <ctime>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <vector>

#include "../includes/slot_reduce.h"
#include "shm_wait.h"

namespace ds::comm {
namespace {

constexpr uint64_t kMagic = 0x31626d6d6f636473ull;  // "dscommb1"
constexpr int64_t kAlign = 4096;
constexpr int64_t kMinSlotBytes = 64 * 1024;
constexpr int kMaxWorld = 1024;
constexpr int kSpins = 4096;  // pause iterations (~100 us) before sleeping on a futex
constexpr int64_t kCopyGrain = 256 * 1024;    // bytes per thread below which one thread copies
constexpr int64_t kReduceGrain = 64 * 1024;   // elements per thread below which one thread reduces
constexpr int64_t kSliceAlign = 64;           // elements: slices start on cache-line boundaries
constexpr int64_t kStreamBytes = 8 << 20;     // default: all_gather outputs from 8 MiB use streaming stores

struct alignas(128) SegmentHeader {
  uint64_t magic;
  int32_t world_size;
  std::atomic<int32_t> attached;  // ranks mapped so far; the last one to attach unlinks the name
  int64_t slot_bytes;
  int64_t total_bytes;
};

int64_t round_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

int64_t control_bytes(int world) {
  return round_up(static_cast<int64_t>(sizeof(SegmentHeader)) + world * static_cast<int64_t>(sizeof(RankControl)),
                  kAlign);
}

int64_t element_size(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

const char* dtype_name(int32_t d) {
  switch (static_cast<DType>(d)) {
    case DType::kFloat32:
      return "float32";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat16:
      return "float16";
  }
  return "?";
}

const char* kind_name(int32_t k) {
  switch (static_cast<OpKind>(k)) {
    case OpKind::kAllReduce:
      return "all_reduce";
    case OpKind::kReduceScatter:
      return "reduce_scatter";
    case OpKind::kAllGather:
      return "all_gather";
    case OpKind::kAllToAll:
      return "all_to_all";
    case OpKind::kNone:
      break;
  }
  return "none";
}

// Split [0, n) over up to `threads` OpenMP threads in pieces of at least `grain` (aligned to `align`).
template <typename F>
void parallel_ranges(int64_t n, int threads, int64_t grain, int64_t align, const F& f) {
  const int64_t useful = std::min<int64_t>(threads, n / std::max<int64_t>(grain, 1));
  if (useful <= 1) {
    if (n > 0) f(0, n);
    return;
  }
  const int64_t per = round_up((n + useful - 1) / useful, align);
#pragma omp parallel for num_threads(static_cast<int>(useful)) schedule(static, 1)
  for (int64_t t = 0; t < useful; ++t) {
    const int64_t begin = std::min(n, t * per);
    const int64_t end = std::min(n, begin + per);
    if (begin < end) f(begin, end);
  }
}

// memcpy with non-temporal stores: for big outputs that won't be read back soon, it skips the read for
// ownership of every destination line (a third of a copy's memory traffic) and leaves the cache to the
// shared slots.
void stream_copy(char* dst, const char* src, int64_t bytes) {
#if defined(__AVX512F__) || defined(__AVX2__)
  const auto misalign = static_cast<int64_t>(reinterpret_cast<uintptr_t>(dst) & 63);
  const int64_t head = std::min<int64_t>(bytes, (64 - misalign) & 63);
  std::memcpy(dst, src, static_cast<size_t>(head));
  int64_t i = head;
#if defined(__AVX512F__)
  for (; i + 64 <= bytes; i += 64) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), _mm512_loadu_si512(src + i));
  }
#else
  for (; i + 32 <= bytes; i += 32) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
  }
#endif
  std::memcpy(dst + i, src + i, static_cast<size_t>(bytes - i));
  _mm_sfence();  // streaming stores are weakly ordered: complete them before the next barrier
#else
  std::memcpy(dst, src, static_cast<size_t>(bytes));
#endif
}

// src -> a and src -> b in one read of src (all_gather's own piece goes to its slot and its output place).
void dual_copy(char* a, char* b, const char* src, int64_t bytes, bool stream_b) {
#if defined(__AVX512F__)
  const auto misalign = static_cast<int64_t>(reinterpret_cast<uintptr_t>(b) & 63);
  const int64_t head = std::min<int64_t>(bytes, (64 - misalign) & 63);  // b is 64-byte aligned after it
  std::memcpy(a, src, static_cast<size_t>(head));
  std::memcpy(b, src, static_cast<size_t>(head));
  int64_t i = head;
  if (stream_b) {
    for (; i + 64 <= bytes; i += 64) {
      const __m512i v = _mm512_loadu_si512(src + i);
      _mm512_storeu_si512(a + i, v);
      _mm512_stream_si512(reinterpret_cast<__m512i*>(b + i), v);
    }
  } else {
    for (; i + 64 <= bytes; i += 64) {
      const __m512i v = _mm512_loadu_si512(src + i);
      _mm512_storeu_si512(a + i, v);
      _mm512_storeu_si512(b + i, v);
    }
  }
  std::memcpy(a + i, src + i, static_cast<size_t>(bytes - i));
  std::memcpy(b + i, src + i, static_cast<size_t>(bytes - i));
  if (stream_b) _mm_sfence();
#else
  std::memcpy(a, src, static_cast<size_t>(bytes));
  if (stream_b) {
    stream_copy(b, src, bytes);
  } else {
    std::memcpy(b, src, static_cast<size_t>(bytes));
  }
#endif
}

void copy_bytes(void* dst, const void* src, int64_t bytes, int threads, bool stream = false) {
  if (bytes <= 0 || dst == src) return;
  parallel_ranges(bytes, threads, kCopyGrain, 64, [&](int64_t b, int64_t e) {
    char* d = static_cast<char*>(dst) + b;
    const char* s = static_cast<const char*>(src) + b;
    if (stream) {
      stream_copy(d, s, e - b);
    } else {
      std::memcpy(d, s, static_cast<size_t>(e - b));
    }
  });
}

template <typename T>
void reduce_typed(const void* const* in, int count, void* out, void* out2, int64_t n, bool avg, int threads) {
  const float divisor = static_cast<float>(count);
  parallel_ranges(n, threads, kReduceGrain, kSliceAlign, [&](int64_t b, int64_t e) {
    // Per-thread pointer table shifted to this thread's range (world sizes are small).
    std::vector<const T*> ptrs(static_cast<size_t>(count));
    for (int k = 0; k < count; ++k) ptrs[k] = static_cast<const T*>(in[k]) + b;
    T* o2 = out2 != nullptr ? static_cast<T*>(out2) + b : nullptr;
    reduce::sum_inputs<T>(ptrs.data(), count, static_cast<T*>(out) + b, o2, e - b, avg, divisor);
  });
}

void reduce(DType dtype, const void* const* in, int count, void* out, void* out2, int64_t n, bool avg,
            int threads) {
  switch (dtype) {
    case DType::kFloat32:
      return reduce_typed<float>(in, count, out, out2, n, avg, threads);
    case DType::kBFloat16:
      return reduce_typed<bf16>(in, count, out, out2, n, avg, threads);
    case DType::kFloat16:
      return reduce_typed<fp16>(in, count, out, out2, n, avg, threads);
  }
}

}  // namespace

Communicator::Communicator(int rank, int world_size, int64_t slot_bytes, int64_t small_bytes, double timeout_s,
                           const std::string& name)
    : rank_(rank), world_(world_size), slot_bytes_(0), small_bytes_(small_bytes), timeout_s_(timeout_s) {
  TORCH_CHECK(world_size >= 2 && world_size <= kMaxWorld, "shm communicator: world_size must be in [2, ",
              kMaxWorld, "], got ", world_size);
  TORCH_CHECK(rank >= 0 && rank < world_size, "shm communicator: rank ", rank, " is not in [0, ", world_size, ")");
  set_timeout(timeout_s);
  // Tuning knob (bytes; a huge value disables streaming stores).
  const char* stream_env = std::getenv("DS_STRATEGY_SHM_STREAM_BYTES");
  stream_bytes_ = stream_env != nullptr && *stream_env != '\0' ? std::atoll(stream_env) : kStreamBytes;
  if (name.empty()) {
    TORCH_CHECK(slot_bytes >= kMinSlotBytes, "shm communicator: slot_bytes must be at least ", kMinSlotBytes,
                ", got ", slot_bytes);
    slot_bytes_ = round_up(slot_bytes, kAlign);
    const int64_t total = control_bytes(world_size) + 2 * world_size * slot_bytes_;
    segment_ = Segment::create(static_cast<size_t>(total));
    auto* header = static_cast<SegmentHeader*>(segment_.data());
    header->world_size = world_size;
    header->slot_bytes = slot_bytes_;
    header->total_bytes = total;
    header->attached.store(1, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
    header->magic = kMagic;
  } else {
    segment_ = Segment::attach(name);
    const auto* header = static_cast<const SegmentHeader*>(segment_.data());
    TORCH_CHECK(segment_.size() >= sizeof(SegmentHeader) && header->magic == kMagic, "shm communicator: ", name,
                " is not an initialised ds_strategy segment");
    TORCH_CHECK(header->world_size == world_size, "shm communicator: segment ", name, " was made for ",
                header->world_size, " ranks, but this group has ", world_size);
    TORCH_CHECK(static_cast<int64_t>(segment_.size()) == header->total_bytes, "shm communicator: segment ", name,
                " has ", segment_.size(), " bytes, its header says ", header->total_bytes);
    slot_bytes_ = header->slot_bytes;
    // Unlink as soon as the last rank is in, whoever that is: from here on a crash of any rank (the
    // creator included) cannot leave the name behind in /dev/shm.
    auto* shared = static_cast<SegmentHeader*>(segment_.data());
    if (shared->attached.fetch_add(1, std::memory_order_acq_rel) + 1 == world_size) shm_unlink(name.c_str());
  }
  data_ = static_cast<char*>(segment_.data()) + control_bytes(world_size);
  RankControl& mine = control(rank);
  mine.pid.store(static_cast<int64_t>(getpid()), std::memory_order_relaxed);
  mine.pid_ns.store(own_pid_namespace(), std::memory_order_relaxed);
  mine.arrived.store(0, std::memory_order_release);
}

void Communicator::set_timeout(double seconds) {
  TORCH_CHECK(seconds > 0, "shm communicator: timeout must be positive, got ", seconds);
  timeout_s_ = seconds;
}

RankControl& Communicator::control(int r) const {
  auto* lines = reinterpret_cast<RankControl*>(static_cast<char*>(segment_.data()) + sizeof(SegmentHeader));
  return lines[r];
}

char* Communicator::slot(int set, int r) const { return data_ + (static_cast<int64_t>(set) * world_ + r) * slot_bytes_; }

void Communicator::begin_op(OpKind kind, DType dtype, int64_t numel, const char* op, int64_t tag) {
  TORCH_CHECK(!broken_, "shm ", op, ": this communicator timed out earlier (the ranks no longer agree on where ",
              "they are); create a new one");
  ++ops_;
  current_ = {static_cast<int32_t>(kind), static_cast<int32_t>(dtype), numel, tag};
  control(rank_).desc[ops_ & 1] = current_;  // made visible by the release store of the first barrier
}

void Communicator::check_peers(const char* op) const {
  bool same = true;
  for (int r = 0; r < world_; ++r) {
    const OpDesc& d = control(r).desc[ops_ & 1];
    same = same && d.kind == current_.kind && d.dtype == current_.dtype && d.numel == current_.numel &&
           d.tag == current_.tag;
  }
  if (same) return;
  // Every rank sees the same descriptors after the barrier, so all of them raise here together and the
  // communicator stays consistent (usable for the next, matching, call).
  std::ostringstream msg;
  msg << "shm " << op << ": the ranks called different collectives (every rank must call the same op with the "
      << "same dtype and size, in the same order):";
  for (int r = 0; r < world_; ++r) {
    const OpDesc& d = control(r).desc[ops_ & 1];
    msg << "\n  rank " << r << ": " << kind_name(d.kind) << " " << dtype_name(d.dtype) << " numel=" << d.numel;
    if (d.tag != 0) msg << " tag=" << d.tag;
  }
  TORCH_CHECK(false, msg.str());
}

void Communicator::barrier(const char* op) {
  const uint64_t target = ++arrivals_;
  RankControl& me = control(rank_);
  publish(me.arrived, me.sleepers, target);  // no lost wake-up: see shm_wait.h
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  auto last_liveness = start;
  int next = 0;  // ranks below `next` are known to have arrived
  for (int spins = 0;; ++spins) {
    while (next < world_ && control(next).arrived.load(std::memory_order_acquire) >= target) ++next;
    if (next == world_) return;
    if (spins < kSpins) {  // a peer running on another core usually arrives within microseconds
      DS_CPU_RELAX();
      continue;
    }
    const auto now = clock::now();
    const double waited = std::chrono::duration<double>(now - start).count();
    if (waited > timeout_s_) fail_waiting(op, target, false);
    if (check_liveness_ && waited > 0.05 && now - last_liveness > std::chrono::milliseconds(50)) {
      last_liveness = now;
      fail_waiting(op, target, true);  // returns when every missing rank is still alive
    }
    // Sleep in the kernel until that rank's counter changes: with more runnable processes than cores the
    // rank we wait for may need this very core. Slices of at most 50 ms keep the timeout and the
    // dead-peer check going.
    RankControl& peer = control(next);
    sleep_below(peer.arrived, peer.sleepers, target, std::min(0.05, timeout_s_ - waited + 1e-3));
  }
}

void Communicator::fail_waiting(const char* op, uint64_t target, bool dead_only) {
  std::vector<int> missing, dead;
  for (int r = 0; r < world_; ++r) {
    if (control(r).arrived.load(std::memory_order_acquire) >= target) continue;
    missing.push_back(r);
    const RankControl& c = control(r);
    if (peer_exited(c.pid.load(std::memory_order_relaxed), c.pid_ns.load(std::memory_order_relaxed))) dead.push_back(r);
  }
  if (missing.empty()) return;  // arrived meanwhile
  if (dead_only && dead.empty()) return;
  broken_ = true;
  std::ostringstream msg;
  const auto& who = dead_only ? dead : missing;
  msg << "shm " << op << ": rank" << (who.size() > 1 ? "s " : " ");
  for (size_t i = 0; i < who.size(); ++i) {
    msg << (i ? ", " : "") << who[i];
    if (dead_only) msg << " (pid " << control(who[i]).pid.load(std::memory_order_relaxed) << ")";
  }
  if (dead_only) {
    msg << (who.size() > 1 ? " have" : " has") << " exited while rank " << rank_ << " of " << world_
        << " waited for it at barrier " << target << ".";
  } else {
    msg << " did not arrive within the " << timeout_s_ << " s timeout (rank " << rank_ << " of " << world_
        << " waited at barrier " << target << "). Every rank must call the same collectives in the same order; "
        << "a rank that hangs, crashed or called something else leaves the others waiting.";
  }
  msg << " This communicator can no longer be used.";
  TORCH_CHECK(false, msg.str());
}

void Communicator::all_reduce(void* data, int64_t numel, DType dtype, bool avg, int threads) {
  const char* op = "all_reduce";
  begin_op(OpKind::kAllReduce, dtype, numel, op);
  const int64_t esz = element_size(dtype);
  char* base = static_cast<char*>(data);
  std::vector<const void*> in(static_cast<size_t>(world_));

  if (numel * esz <= small_bytes_) {
    // Latency path, one barrier per chunk: every rank sums the whole chunk from all slots in rank order.
    const int64_t chunk = slot_bytes_ / esz;
    int64_t off = 0;
    do {
      const int64_t len = std::min(chunk, numel - off);
      const int set = static_cast<int>(steps_++ & 1);
      copy_bytes(slot(set, rank_), base + off * esz, len * esz, threads);
      barrier(op);
      if (off == 0) check_peers(op);
      for (int r = 0; r < world_; ++r) in[r] = slot(set, r);
      reduce(dtype, in.data(), world_, base + off * esz, nullptr, len, avg, threads);
      off += len;
    } while (off < numel);
    return;
  }

  const int64_t chunk = slot_bytes_ / esz;
  bool first = true;
  for (int64_t off = 0; off < numel; off += chunk) {
    const int64_t len = std::min(chunk, numel - off);
    const int set = static_cast<int>(steps_++ & 1);
    const int64_t slice = round_up((len + world_ - 1) / world_, kSliceAlign);
    auto lo = [&](int r) { return std::min<int64_t>(len, r * slice); };
    auto hi = [&](int r) { return std::min<int64_t>(len, (r + 1) * slice); };
    char* src = base + off * esz;
    char* mine = slot(set, rank_);
    for (int r = 0; r < world_; ++r) {
      if (r != rank_) copy_bytes(mine + lo(r) * esz, src + lo(r) * esz, (hi(r) - lo(r)) * esz, threads);
    }
    barrier(op);
    if (first) check_peers(op);
    first = false;
    for (int r = 0; r < world_; ++r) in[r] = (r == rank_ ? src : slot(set, r)) + lo(rank_) * esz;
    reduce(dtype, in.data(), world_, src + lo(rank_) * esz, mine + lo(rank_) * esz, hi(rank_) - lo(rank_), avg,
           threads);
    barrier(op);
    for (int r = 0; r < world_; ++r) {
      if (r != rank_) copy_bytes(src + lo(r) * esz, slot(set, r) + lo(r) * esz, (hi(r) - lo(r)) * esz, threads);
    }
  }
}

void Communicator::reduce_scatter(void* out, const void* in_data, int64_t out_numel, DType dtype, bool avg,
                                  int threads) {
  const char* op = "reduce_scatter";
  begin_op(OpKind::kReduceScatter, dtype, out_numel, op);
  const int64_t esz = element_size(dtype);
  const char* src = static_cast<const char*>(in_data);
  char* dst = static_cast<char*>(out);
  const int64_t chunk = std::max<int64_t>(kSliceAlign, slot_bytes_ / esz / world_ / kSliceAlign * kSliceAlign);
  std::vector<const void*> in(static_cast<size_t>(world_));
  int64_t off = 0;
  do {  // at least once, so that ranks with empty tensors still meet (and check each other)
    const int64_t len = std::min(chunk, out_numel - off);
    const int set = static_cast<int>(steps_++ & 1);
    char* mine = slot(set, rank_);
    for (int r = 0; r < world_; ++r) {
      if (r != rank_) copy_bytes(mine + r * chunk * esz, src + (r * out_numel + off) * esz, len * esz, threads);
    }
    barrier(op);
    if (off == 0) check_peers(op);
    for (int r = 0; r < world_; ++r) {
      in[r] = r == rank_ ? src + (rank_ * out_numel + off) * esz : slot(set, r) + rank_ * chunk * esz;
    }
    reduce(dtype, in.data(), world_, dst + off * esz, nullptr, len, avg, threads);
    off += len;
  } while (off < out_numel);
}

std::vector<int64_t> Communicator::peer_tags() const {
  std::vector<int64_t> tags(static_cast<size_t>(world_));
  for (int r = 0; r < world_; ++r) tags[static_cast<size_t>(r)] = control(r).desc[ops_ & 1].tag;
  return tags;
}

void Communicator::all_gather(void* out, const void* in_data, int64_t in_numel, DType dtype, int threads,
                              int64_t tag) {
  const char* op = "all_gather";
  begin_op(OpKind::kAllGather, dtype, in_numel, op, tag);
  const int64_t esz = element_size(dtype);
  const char* src = static_cast<const char*>(in_data);
  char* dst = static_cast<char*>(out);
  const int64_t chunk = slot_bytes_ / esz;
  // The output is written once and not read here: past the cache, stream it (see stream_copy).
  const bool stream = world_ * in_numel * esz >= stream_bytes_;
  int64_t off = 0;
  do {
    const int64_t len = std::min(chunk, in_numel - off);
    const int set = static_cast<int>(steps_++ & 1);
    // Own piece to its slot and to its place in the output (only to the slot when gathering in place).
    char* own_out = dst + (rank_ * in_numel + off) * esz;
    if (own_out == src + off * esz) {
      copy_bytes(slot(set, rank_), src + off * esz, len * esz, threads);
    } else {
      parallel_ranges(len * esz, threads, kCopyGrain, 64, [&](int64_t b, int64_t e) {
        dual_copy(slot(set, rank_) + b, own_out + b, src + off * esz + b, e - b, stream);
      });
    }
    barrier(op);
    if (off == 0) check_peers(op);
    for (int r = 0; r < world_; ++r) {
      if (r != rank_) copy_bytes(dst + (r * in_numel + off) * esz, slot(set, r), len * esz, threads, stream);
    }
    off += len;
  } while (off < in_numel);
}

// All-to-all, per chunk (reduce_scatter without the sum): copy the W-1 pieces bound for the others into
// this rank's slot (piece r at r * chunk) and the own piece straight to the output, barrier, copy piece
// `rank` of every other rank's slot out (1 barrier per chunk; double buffering as above).
void Communicator::all_to_all(void* out, const void* in_data, int64_t piece_numel, DType dtype, int threads) {
  const char* op = "all_to_all";
  begin_op(OpKind::kAllToAll, dtype, piece_numel, op);
  const int64_t esz = element_size(dtype);
  const char* src = static_cast<const char*>(in_data);
  char* dst = static_cast<char*>(out);
  const int64_t chunk = std::max<int64_t>(kSliceAlign, slot_bytes_ / esz / world_ / kSliceAlign * kSliceAlign);
  int64_t off = 0;
  do {  // at least once, so that ranks with empty tensors still meet (and check each other)
    const int64_t len = std::min(chunk, piece_numel - off);
    const int set = static_cast<int>(steps_++ & 1);
    char* mine = slot(set, rank_);
    for (int r = 0; r < world_; ++r) {
      if (r != rank_) copy_bytes(mine + r * chunk * esz, src + (r * piece_numel + off) * esz, len * esz, threads);
    }
    copy_bytes(dst + (rank_ * piece_numel + off) * esz, src + (rank_ * piece_numel + off) * esz, len * esz, threads);
    barrier(op);
    if (off == 0) check_peers(op);
    for (int r = 0; r < world_; ++r) {
      if (r != rank_) copy_bytes(dst + (r * piece_numel + off) * esz, slot(set, r) + rank_ * chunk * esz, len * esz, threads);
    }
    off += len;
  } while (off < piece_numel);
}

}  // namespace ds::comm
