// aio_engine.cpp: the request queue and the workers behind ds_strategy.ops.aio (see aio_engine.h).
//
// One mutex guards the job queue, the request table and the in-flight count; transfers run outside it.
// A request's blocks may complete in any order on any worker; the request is complete when its count
// of remaining blocks reaches zero. After a block fails, the request's remaining blocks are skipped
// (its data is unusable anyway) but still counted, so wait() always returns.
#include "aio_engine.h"

#include <c10/util/Exception.h>
#include <sys/eventfd.h>
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

constexpr int64_t kMaxTransfer = int64_t{1} << 30;  // one read/write; Linux moves at most ~2 GiB per call

struct FreeDeleter {
  void operator()(char* p) const { std::free(p); }
};

}  // namespace

struct Engine::Worker {
  int event_fd = -1;  // the kernel (completions) and submitters (new jobs, shutdown) write it
  std::unique_ptr<IoQueue> queue;
  std::atomic<int64_t> max_outstanding{0};
  std::thread thread;

  ~Worker() {
    queue.reset();  // before its eventfd goes
    if (event_fd >= 0) ::close(event_fd);
  }

  void sleep() const {  // until the eventfd was written since the last sleep() (it keeps a count)
    uint64_t count = 0;
    while (::read(event_fd, &count, sizeof(count)) < 0 && errno == EINTR) {
    }
  }

  void wake() const {
    const uint64_t one = 1;
    while (::write(event_fd, &one, sizeof(one)) < 0 && errno == EINTR) {
    }
  }
};

Engine::Engine(int64_t block_size, int64_t queue_depth, int64_t thread_count, bool single_submit,
               const std::string& backend)
    : block_size_(block_size),
      queue_depth_(queue_depth),
      capacity_(2 * queue_depth * thread_count),
      single_submit_(single_submit) {
  const bool any = backend.empty() || backend == "auto";
  TORCH_CHECK(any || backend == "io_uring" || backend == "libaio" || backend == "blocking",
              "aio engine: unknown I/O backend '", backend, "'; expected auto, io_uring, libaio or blocking");
  const std::vector<std::string> candidates = any ? compiled_backends() : std::vector<std::string>{backend};
  std::string why;
  // Every worker gets the same backend: the first candidate that sets up for all of them (a sandbox may
  // refuse io_uring_setup, the system's aio-max-nr may be used up); "blocking" always does.
  for (const std::string& name : candidates) {
    workers_.clear();
    for (int64_t i = 0; i < thread_count; ++i) {
      auto w = std::make_unique<Worker>();
      w->event_fd = ::eventfd(0, EFD_CLOEXEC);
      TORCH_CHECK(w->event_fd >= 0, "aio engine: eventfd failed: ", std::strerror(errno));
      w->queue = make_io_queue(name, queue_depth, single_submit, w->event_fd, &why);
      if (!w->queue) break;
      workers_.push_back(std::move(w));
    }
    if (static_cast<int64_t>(workers_.size()) == thread_count) {
      backend_ = name;
      break;
    }
  }
  TORCH_CHECK(!backend_.empty(), "aio engine: the ", backend, " I/O backend cannot be used here: ", why);
  for (auto& w : workers_) {
    Worker* worker = w.get();
    w->thread = std::thread([this, worker] { work(*worker); });
  }
}

Engine::~Engine() { shutdown(); }

void Engine::wake_workers() {
  for (auto& w : workers_) w->wake();
}

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
    slot_cv_.wait(lock, [this] { return in_flight_ < capacity_; });
    // single_submit: one block per wake-up; otherwise a batch of every block that fits in the free slots.
    const int64_t room = single_submit_ ? 1 : capacity_ - in_flight_;
    const size_t end = std::min(blocks.size(), i + static_cast<size_t>(room));
    for (; i < end; ++i) {
      const Block& b = blocks[i];
      jobs_.push_back({request, base, b, b.mode == Mode::kBuffered ? buffered_fd : direct_fd, is_write});
      ++in_flight_;
    }
    max_in_flight_ = std::max(max_in_flight_, in_flight_);
    wake_workers();
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

std::vector<int64_t> Engine::device_max_in_flight() const {
  std::vector<int64_t> out;
  for (const auto& w : workers_) out.push_back(w->max_outstanding.load());
  return out;
}

void Engine::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) return;
    stopping_ = true;
  }
  wake_workers();
  for (auto& w : workers_) {
    if (w->thread.joinable()) w->thread.join();
  }
  workers_.clear();
}

// One worker: take queued blocks into free slots, issue them, reap completions (continuing partial
// transfers the way a pread/pwrite loop would), sleep on the eventfd when there is nothing to do.
void Engine::work(Worker& w) {
  IoQueue& queue = *w.queue;
  const int64_t depth = queue.depth();
  struct Slot {
    Job job;
    int64_t moved = 0;                             // bytes transferred so far
    std::unique_ptr<char, FreeDeleter> staging;  // aligned, block_size_ bytes: allocated on its first bounce
  };
  std::vector<Slot> slots(static_cast<size_t>(depth));
  std::vector<uint64_t> free_tags;
  for (int64_t t = depth - 1; t >= 0; --t) free_tags.push_back(static_cast<uint64_t>(t));
  std::vector<Job> taken;
  std::vector<IoOp> ops;
  std::vector<IoDone> completions(static_cast<size_t>(depth));
  int64_t outstanding = 0;

  // The next transfer of a slot's block: what remains of it.
  auto next_op = [](const Slot& s, uint64_t tag) {
    const Block& b = s.job.block;
    char* data = b.mode == Mode::kBounce ? s.staging.get() : s.job.base + b.start;
    return IoOp{s.job.fd, data + s.moved, std::min(b.length - s.moved, kMaxTransfer), b.file_offset + s.moved,
                s.job.is_write, tag};
  };

  for (;;) {
    taken.clear();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      while (taken.size() < free_tags.size() && !jobs_.empty()) {
        taken.push_back(std::move(jobs_.front()));
        jobs_.pop_front();
        taken.back().skip = taken.back().request->failure.error != 0;
      }
      if (taken.empty() && outstanding == 0 && stopping_) return;  // every queued block is done
    }
    ops.clear();
    for (Job& job : taken) {
      if (job.skip) {
        finish(job, nullptr);
        continue;
      }
      const uint64_t tag = free_tags.back();
      Slot& s = slots[tag];
      const Block b = job.block;
      if (b.mode == Mode::kBounce && !s.staging) {
        void* p = nullptr;
        if (posix_memalign(&p, static_cast<size_t>(kAlignment), static_cast<size_t>(block_size_)) != 0) p = nullptr;
        s.staging.reset(static_cast<char*>(p));
        if (!s.staging) {
          const Failure failure{ENOMEM, b.length, b.file_offset, -1};
          finish(job, &failure);
          continue;
        }
      }
      free_tags.pop_back();
      s.job = std::move(job);
      s.moved = 0;
      if (b.mode == Mode::kBounce && s.job.is_write) {
        std::memcpy(s.staging.get(), s.job.base + b.start, static_cast<size_t>(b.length));
      }
      ops.push_back(next_op(s, tag));
    }
    if (!ops.empty()) {
      outstanding += static_cast<int64_t>(ops.size());
      if (outstanding > w.max_outstanding.load()) w.max_outstanding.store(outstanding);
      queue.submit(ops);
    }

    const size_t reaped = queue.reap(completions);
    ops.clear();
    for (size_t i = 0; i < reaped; ++i) {
      const uint64_t tag = completions[i].tag;
      const int64_t result = completions[i].result;
      Slot& s = slots[tag];
      const Block& b = s.job.block;
      if (result == -EINTR || result == -EAGAIN) {  // nothing moved: issue the same transfer again
        ops.push_back(next_op(s, tag));
        continue;
      }
      Failure failure;
      if (result < 0) {
        failure = {-result, b.length, b.file_offset, -1};
      } else {
        s.moved += result;
        // An O_DIRECT transfer that ends unaligned is final (the rest would fail with EINVAL; it only
        // happens at the end of the file); a buffered or aligned partial one continues.
        const bool ended = result == 0 || (b.mode != Mode::kBuffered && s.moved % kAlignment != 0);
        if (s.moved < b.length && !ended) {
          ops.push_back(next_op(s, tag));
          continue;
        }
        if (b.mode == Mode::kBounce && !s.job.is_write && s.moved > 0) {
          std::memcpy(s.job.base + b.start, s.staging.get(), static_cast<size_t>(s.moved));
        }
        if (s.moved < b.length) failure = {EIO, b.length, b.file_offset, s.moved};
      }
      --outstanding;
      free_tags.push_back(tag);
      const Job job = std::move(s.job);
      s.job = Job{};
      finish(job, failure.error != 0 ? &failure : nullptr);
    }
    if (!ops.empty()) queue.submit(ops);  // continued transfers: their slots stay outstanding

    if (taken.empty() && reaped == 0) w.sleep();
  }
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
