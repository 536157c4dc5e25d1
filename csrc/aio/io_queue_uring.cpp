// io_queue_uring.cpp: the io_uring backend (liburing). One ring per worker, as many entries as the
// queue depth, so the submission queue can never be full; completions signal the worker's eventfd.
#include "io_queue.h"

#ifdef DS_AIO_HAVE_URING
#include <liburing.h>

#include <sched.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#endif

namespace ds::aio {

#ifdef DS_AIO_HAVE_URING
namespace {

class UringQueue final : public IoQueue {
 public:
  UringQueue(int64_t depth, bool single_submit) : depth_(depth), single_submit_(single_submit) {}
  ~UringQueue() override {
    if (ready_) io_uring_queue_exit(&ring_);
  }

  // 0, or -errno of the failed setup step.
  int setup(int event_fd) {
    const int rc = io_uring_queue_init(static_cast<unsigned>(depth_), &ring_, 0);
    if (rc < 0) return rc;
    ready_ = true;
    return io_uring_register_eventfd(&ring_, event_fd);
  }

  int64_t depth() const override { return depth_; }

  void submit(const std::vector<IoOp>& ops) override {
    for (const IoOp& op : ops) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);  // never null: at most depth_ outstanding, depth_ entries
      if (op.is_write) {
        io_uring_prep_write(sqe, op.fd, op.data, static_cast<unsigned>(op.length), static_cast<uint64_t>(op.offset));
      } else {
        io_uring_prep_read(sqe, op.fd, op.data, static_cast<unsigned>(op.length), static_cast<uint64_t>(op.offset));
      }
      io_uring_sqe_set_data(sqe, reinterpret_cast<void*>(static_cast<uintptr_t>(op.tag)));  // _data64: liburing >= 2.2
      if (single_submit_) flush();
    }
    flush();
  }

  size_t reap(std::vector<IoDone>& out) override {
    size_t n = 0;
    io_uring_cqe* cqe = nullptr;
    while (n < out.size() && io_uring_peek_cqe(&ring_, &cqe) == 0) {
      out[n++] = {static_cast<uint64_t>(reinterpret_cast<uintptr_t>(io_uring_cqe_get_data(cqe))),
                  static_cast<int64_t>(cqe->res)};
      io_uring_cqe_seen(&ring_, cqe);
    }
    return n;
  }

 private:
  // Hand every prepared entry to the kernel; a transfer's own errors come back in its completion.
  // EINTR/EAGAIN/EBUSY leave the entries queued: try again. Anything else means the ring itself is broken
  // and the entries would never complete (every waiter would hang): stop the process loudly instead.
  void flush() {
    while (io_uring_sq_ready(&ring_) > 0) {
      const int rc = io_uring_submit(&ring_);
      if (rc >= 0 || rc == -EINTR) continue;
      if (rc == -EAGAIN || rc == -EBUSY) {
        sched_yield();
        continue;
      }
      std::fprintf(stderr, "ds_strategy aio engine: io_uring_submit failed: %s\n", std::strerror(-rc));
      std::abort();
    }
  }

  const int64_t depth_;
  const bool single_submit_;
  io_uring ring_{};
  bool ready_ = false;
};

}  // namespace
#endif

std::unique_ptr<IoQueue> make_uring_queue(int64_t depth, bool single_submit, int event_fd, std::string* why) {
#ifdef DS_AIO_HAVE_URING
  auto queue = std::make_unique<UringQueue>(depth, single_submit);
  const int rc = queue->setup(event_fd);
  if (rc < 0) {
    *why = std::string("io_uring setup failed: ") + std::strerror(-rc);
    return nullptr;
  }
  return queue;
#else
  (void)depth, (void)single_submit, (void)event_fd;
  *why = "not compiled in (liburing was not found at build time)";
  return nullptr;
#endif
}

}  // namespace ds::aio
