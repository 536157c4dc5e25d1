// aio_engine.cpp: the thread pool behind ds_strategy.ops.aio (see aio_engine.h for why a thread pool).
//
// One mutex guards the job queue, the request table and the in-flight count; transfers run outside it.
// A request's blocks may complete in any order on any worker; the request is complete when its count
// of remaining blocks reaches zero. After a block fails, the request's remaining blocks are skipped
// (its data is unusable anyway) but still counted, so wait() always returns.
#include "aio_engine.h"

#include <c10/util/Exception.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace ds::aio {

std::vector<Block> plan_blocks(uintptr_t address, int64_t nbytes, int64_t offset, bool direct, int64_t block_size) {
  int64_t body = 0;
  Mode mode = Mode::kBuffered;
  if (direct && offset % kAlignment == 0) {
    body = nbytes - nbytes % kAlignment;
    mode = address % kAlignment == 0 ? Mode::kDirect : Mode::kBounce;
  }
  std::vector<Block> blocks;
  blocks.reserve(static_cast<size_t>((nbytes + block_size - 1) / block_size + 1));
  for (int64_t s = 0; s < body; s += block_size) {
    blocks.push_back({s, std::min(block_size, body - s), offset + s, mode});
  }
  for (int64_t s = body; s < nbytes; s += block_size) {
    blocks.push_back({s, std::min(block_size, nbytes - s), offset + s, Mode::kBuffered});
  }
  return blocks;
}

namespace {

// pread/pwrite until `length` bytes moved, retrying interrupted calls and continuing partial ones.
// Returns the bytes moved (< length: end of file, or a write the device took none of), or -errno. On an
// O_DIRECT descriptor a partial transfer that ends unaligned is final: the rest could not be issued
// (EINVAL), and it only happens at the end of the file or of the device's room.
int64_t transfer(int fd, char* data, int64_t length, int64_t offset, bool is_write, bool direct) {
  int64_t done = 0;
  while (done < length) {
    const ssize_t n = is_write ? ::pwrite(fd, data + done, static_cast<size_t>(length - done), offset + done)
                               : ::pread(fd, data + done, static_cast<size_t>(length - done), offset + done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return -static_cast<int64_t>(errno);
    }
    if (n == 0) break;
    done += n;
    if (direct && done % kAlignment != 0) break;
  }
  return done;
}

struct FreeDeleter {
  void operator()(char* p) const { std::free(p); }
};

}  // namespace

Engine::Engine(int64_t block_size, int64_t queue_depth, int64_t thread_count, bool single_submit)
    : block_size_(block_size), queue_depth_(queue_depth), single_submit_(single_submit) {
  workers_.reserve(static_cast<size_t>(thread_count));
  for (int64_t i = 0; i < thread_count; ++i) workers_.emplace_back([this] { worker(); });
}

Engine::~Engine() { shutdown(); }

int64_t Engine::submit(char* base, int64_t nbytes, int direct_fd, int buffered_fd, int64_t offset, bool is_write,
                       bool direct, std::shared_ptr<void> keepalive) {
  const auto blocks = plan_blocks(reinterpret_cast<uintptr_t>(base), nbytes, offset, direct, block_size_);
  auto request = std::make_shared<Request>();
  request->remaining = static_cast<int64_t>(blocks.size());
  request->keepalive = blocks.empty() ? nullptr : std::move(keepalive);
  std::unique_lock<std::mutex> lock(mutex_);
  TORCH_CHECK(!stopping_, "aio engine: submit after close, create a new AsyncIO");
  const int64_t id = next_id_++;
  requests_[id] = request;
  size_t i = 0;
  while (i < blocks.size()) {
    slot_cv_.wait(lock, [this] { return in_flight_ < queue_depth_; });
    // single_submit: one block per wake-up; otherwise a batch of every block that fits in the free slots.
    const int64_t room = single_submit_ ? 1 : queue_depth_ - in_flight_;
    const size_t end = std::min(blocks.size(), i + static_cast<size_t>(room));
    for (; i < end; ++i) {
      const Block& b = blocks[i];
      jobs_.push_back({request, base, b, b.mode == Mode::kBuffered ? buffered_fd : direct_fd, is_write});
      ++in_flight_;
    }
    max_in_flight_ = std::max(max_in_flight_, in_flight_);
    if (single_submit_) {
      work_cv_.notify_one();
    } else {
      work_cv_.notify_all();
    }
  }
  return id;
}

bool Engine::done(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = requests_.find(id);
  return it == requests_.end() || it->second->remaining == 0;
}

Failure Engine::wait(int64_t id) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto it = requests_.find(id);
  TORCH_CHECK(it != requests_.end(), "aio engine: request ", id, " is unknown or was already waited for");
  std::shared_ptr<Request> request = it->second;
  done_cv_.wait(lock, [&] { return request->remaining == 0; });
  requests_.erase(id);
  return request->failure;
}

int64_t Engine::in_flight() {
  std::lock_guard<std::mutex> lock(mutex_);
  return in_flight_;
}

int64_t Engine::max_in_flight() {
  std::lock_guard<std::mutex> lock(mutex_);
  return max_in_flight_;
}

void Engine::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) return;
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
  workers_.clear();
}

void Engine::worker() {
  std::unique_ptr<char, FreeDeleter> staging;  // allocated on the first bounced block
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_cv_.wait(lock, [this] { return stopping_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopping, and every queued block is done
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    if (job.block.mode == Mode::kBounce && !staging) {
      void* p = nullptr;
      if (posix_memalign(&p, static_cast<size_t>(kAlignment), static_cast<size_t>(block_size_)) != 0) p = nullptr;
      staging.reset(static_cast<char*>(p));
    }
    run(job, staging.get());
  }
}

void Engine::run(const Job& job, char* staging) {
  const Block& b = job.block;
  bool skip = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    skip = job.request->failure.error != 0;
  }
  if (skip) return finish(job, nullptr);
  Failure failure;
  char* data = job.base + b.start;
  int64_t got = 0;
  if (b.mode == Mode::kBounce) {
    if (staging == nullptr) {
      failure = {ENOMEM, b.length, b.file_offset, -1};
      return finish(job, &failure);
    }
    if (job.is_write) std::memcpy(staging, data, static_cast<size_t>(b.length));
    got = transfer(job.fd, staging, b.length, b.file_offset, job.is_write, true);
    if (!job.is_write && got > 0) std::memcpy(data, staging, static_cast<size_t>(got));
  } else {
    got = transfer(job.fd, data, b.length, b.file_offset, job.is_write, b.mode == Mode::kDirect);
  }
  if (got < 0) {
    failure = {-got, b.length, b.file_offset, -1};
    return finish(job, &failure);
  }
  if (got < b.length) {
    failure = {EIO, b.length, b.file_offset, got};
    return finish(job, &failure);
  }
  finish(job, nullptr);
}

void Engine::finish(const Job& job, const Failure* failure) {
  std::shared_ptr<void> release;  // the caller's memory: dropped outside the lock
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Request& r = *job.request;
    if (failure != nullptr && r.failure.error == 0) r.failure = *failure;
    --in_flight_;
    if (--r.remaining == 0) {
      release = std::move(r.keepalive);
      done_cv_.notify_all();
    }
  }
  slot_cv_.notify_all();
}

}  // namespace ds::aio
