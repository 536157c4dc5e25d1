// io_queue_libaio.cpp: the Linux AIO backend (libaio, what DeepSpeed's aio_handle uses). One context per
// worker with room for the queue depth; every iocb carries the worker's eventfd, so the kernel wakes it.
// Linux AIO is asynchronous for O_DIRECT descriptors; on buffered ones io_submit does the transfer itself
// (correct, just not overlapped), and a descriptor it refuses (EINVAL) gets a plain pread/pwrite.
#include "io_queue.h"

#ifdef DS_AIO_HAVE_LIBAIO
#include <libaio.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>
#endif

namespace ds::aio {

#ifdef DS_AIO_HAVE_LIBAIO
namespace {

class LibaioQueue final : public IoQueue {
 public:
  LibaioQueue(int64_t depth, bool single_submit, int event_fd)
      : depth_(depth), single_submit_(single_submit), event_fd_(event_fd), iocbs_(static_cast<size_t>(depth)),
        events_(static_cast<size_t>(depth)) {}
  ~LibaioQueue() override {
    if (ready_) io_destroy(ctx_);
  }

  int setup() {
    const int rc = io_setup(static_cast<int>(depth_), &ctx_);
    ready_ = rc == 0;
    return rc;
  }

  int64_t depth() const override { return depth_; }

  // Tags are the worker's slot indices (< depth), so each transfer's iocb lives in iocbs_[tag] until done.
  void submit(const std::vector<IoOp>& ops) override {
    std::vector<iocb*> batch;
    batch.reserve(ops.size());
    for (const IoOp& op : ops) {
      iocb* cb = &iocbs_[op.tag];
      if (op.is_write) {
        io_prep_pwrite(cb, op.fd, op.data, static_cast<size_t>(op.length), op.offset);
      } else {
        io_prep_pread(cb, op.fd, op.data, static_cast<size_t>(op.length), op.offset);
      }
      io_set_eventfd(cb, event_fd_);
      cb->data = reinterpret_cast<void*>(static_cast<uintptr_t>(op.tag));
      batch.push_back(cb);
    }
    const size_t step = single_submit_ ? 1 : batch.size();
    for (size_t i = 0; i < batch.size();) {
      const long n = static_cast<long>(std::min(step, batch.size() - i));
      const int rc = io_submit(ctx_, n, batch.data() + i);
      if (rc > 0) {
        i += static_cast<size_t>(rc);
      } else if (rc == -EAGAIN || rc == -EINTR || rc == 0) {
        sched_yield();  // no room in the kernel right now: retry
      } else {
        // The kernel cannot do this one asynchronously (EINVAL: a file without AIO support, such as a
        // character device): run it with pread/pwrite, as the blocking backend would, and go on.
        run_blocking(*batch[i]);
        ++i;
      }
    }
  }

  size_t reap(std::vector<IoDone>& out) override {
    size_t n = 0;
    while (n < out.size() && !ran_.empty()) {
      out[n++] = ran_.back();
      ran_.pop_back();
    }
    if (n == out.size()) return n;
    timespec now{0, 0};  // poll: never wait
    const long room = static_cast<long>(std::min(out.size() - n, events_.size()));
    const int got = io_getevents(ctx_, 0, room, events_.data(), &now);  // < 0 (EINTR): none this time
    for (int i = 0; i < got; ++i) {
      out[n++] = {static_cast<uint64_t>(reinterpret_cast<uintptr_t>(events_[i].data)),
                  static_cast<int64_t>(static_cast<long>(events_[i].res))};
    }
    return n;
  }

 private:
  void run_blocking(const iocb& cb) {
    const auto tag = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(cb.data));
    void* buf = cb.u.c.buf;
    const auto length = static_cast<size_t>(cb.u.c.nbytes);
    const ssize_t n = cb.aio_lio_opcode == IO_CMD_PWRITE ? ::pwrite(cb.aio_fildes, buf, length, cb.u.c.offset)
                                                         : ::pread(cb.aio_fildes, buf, length, cb.u.c.offset);
    ran_.push_back({tag, n < 0 ? -static_cast<int64_t>(errno) : static_cast<int64_t>(n)});
  }

  const int64_t depth_;
  const bool single_submit_;
  const int event_fd_;
  io_context_t ctx_ = nullptr;
  bool ready_ = false;
  std::vector<iocb> iocbs_;
  std::vector<io_event> events_;
  std::vector<IoDone> ran_;  // completed by run_blocking, handed out by the next reap()
};

}  // namespace
#endif

std::unique_ptr<IoQueue> make_libaio_queue(int64_t depth, bool single_submit, int event_fd, std::string* why) {
#ifdef DS_AIO_HAVE_LIBAIO
  auto queue = std::make_unique<LibaioQueue>(depth, single_submit, event_fd);
  const int rc = queue->setup();
  if (rc < 0) {
    *why = std::string("io_setup failed: ") + std::strerror(-rc);
    return nullptr;
  }
  return queue;
#else
  (void)depth, (void)single_submit, (void)event_fd;
  *why = "not compiled in (libaio was not found at build time)";
  return nullptr;
#endif
}

}  // namespace ds::aio
