// aio_engine.h: the engine behind ds_strategy.ops.aio (NVMe offload's swap files): a request queue and
// thread_count workers, each keeping up to queue_depth block transfers outstanding at the device.
//
// Requests are split into blocks and queued; at most 2 x queue_depth x thread_count blocks are in flight
// per engine (queued or transferring: one queue_depth of blocks waits behind each thread's transfers, so a
// completed slot is refilled at once, without a round trip through the submitting thread), and a submitter
// waits for a free slot, so memory stays bounded whatever it submits. Each worker takes as many queued blocks as it has free slots, issues them through its
// IoQueue (io_uring or Linux AIO when the build found the library, else blocking pread/pwrite: see
// io_queue.h) and reaps completions, continuing partial transfers. No torch types here: aio_ops.cpp is
// the torch boundary (tensors, checks, the custom class).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "io_queue.h"

namespace ds::aio {

constexpr int64_t kAlignment = 4096;  // the O_DIRECT unit; ds_strategy/ops/aio.py: ALIGNMENT

// How one block moves. kDirect: straight between the caller's memory and the O_DIRECT descriptor.
// kBounce: through an aligned staging buffer of the worker (the caller's memory is not aligned).
// kBuffered: through the buffered descriptor (unaligned offset or length). Same values as aio.py.
enum class Mode : int { kDirect = 0, kBounce = 1, kBuffered = 2 };

struct Block {
  int64_t start;        // byte offset in the caller's memory
  int64_t length;       // bytes
  int64_t file_offset;  // byte offset in the file
  Mode mode;
};

// The blocks of one request (aio.py's _plan makes the same plan; tests compare both backends).
std::vector<Block> plan_blocks(uintptr_t address, int64_t nbytes, int64_t offset, bool direct, int64_t block_size);

// The first failed block of a request: errno (0: none), the block's bytes and file offset, and for a
// short transfer (end of file, no room) the bytes moved (-1 otherwise; errno is then EIO).
struct Failure {
  int64_t error = 0;
  int64_t nbytes = 0;
  int64_t offset = 0;
  int64_t got = -1;
};

class Engine {
 public:
  // backend: "auto" (or ""), "io_uring", "libaio" or "blocking" (io_queue.h: make_io_queue).
  Engine(int64_t block_size, int64_t queue_depth, int64_t thread_count, bool single_submit,
         const std::string& backend);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queue the blocks of a transfer of `nbytes` at `base` (kept alive by `keepalive` until done); returns
  // the request id. Blocks while 2 x queue_depth x thread_count blocks are in flight.
  int64_t submit(char* base, int64_t nbytes, int direct_fd, int buffered_fd, int64_t offset, bool is_write,
                 bool direct, std::shared_ptr<void> keepalive);
  bool done(int64_t id);
  Failure wait(int64_t id);  // blocks until the request is complete, then forgets it
  int64_t in_flight();
  int64_t max_in_flight();
  // Per worker: the most transfers it had outstanding at the device at once (the test of real depth).
  std::vector<int64_t> device_max_in_flight() const;
  const std::string& backend() const { return backend_; }
  void shutdown();  // finishes every queued block, then joins the workers

 private:
  struct Request {
    int64_t remaining = 0;
    Failure failure;
    std::shared_ptr<void> keepalive;
  };
  struct Job {
    std::shared_ptr<Request> request;
    char* base = nullptr;
    Block block{};
    int fd = -1;
    bool is_write = false;
    bool skip = false;  // its request already failed: count it done without a transfer
  };
  struct Worker;

  void work(Worker& w);
  void wake_workers();
  void finish(const Job& job, const Failure* failure);

  const int64_t block_size_;
  const int64_t queue_depth_;
  const int64_t capacity_;  // 2 x queue_depth_ x thread_count: blocks queued or in flight per engine
  const bool single_submit_;
  std::string backend_;
  std::mutex mutex_;
  std::condition_variable slot_cv_;  // a slot was freed
  std::condition_variable done_cv_;  // a request completed
  std::deque<Job> jobs_;
  std::unordered_map<int64_t, std::shared_ptr<Request>> requests_;
  int64_t next_id_ = 1;
  int64_t in_flight_ = 0;
  int64_t max_in_flight_ = 0;
  bool stopping_ = false;
  std::vector<std::unique_ptr<Worker>> workers_;
};

}  // namespace ds::aio
