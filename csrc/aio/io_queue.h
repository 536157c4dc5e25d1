// io_queue.h: how one engine worker hands transfers to the kernel and learns that they completed.
//
// Three implementations, chosen per engine at creation: io_uring (liburing) and Linux AIO (libaio) keep up
// to depth() transfers outstanding at the device from one thread; "blocking" runs each transfer with
// pread/pwrite inside submit() (depth 1). The asynchronous two are compiled only when the build found
// their header and library (ds_strategy/ops/aio_libs.py defines DS_AIO_HAVE_URING / DS_AIO_HAVE_LIBAIO),
// so the blocking one is the fallback that always exists.
//
// Completions are announced on an eventfd the worker sleeps on (the kernel writes it for io_uring and
// libaio; submitters write it for new work), so one read() waits for either a completion or a job.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace ds::aio {

// One transfer at the device. `tag` comes back with its completion (the worker's slot index).
struct IoOp {
  int fd;
  char* data;
  int64_t length;
  int64_t offset;
  bool is_write;
  uint64_t tag;
};

// A completed transfer: bytes moved, or -errno (also for a transfer the kernel refused at submission).
struct IoDone {
  uint64_t tag;
  int64_t result;
};

class IoQueue {
 public:
  virtual ~IoQueue() = default;
  // Transfers this queue keeps outstanding at most (the worker never submits beyond it).
  virtual int64_t depth() const = 0;
  // Issue `ops` (outstanding + ops.size() <= depth()). single_submit: one system call per transfer.
  virtual void submit(const std::vector<IoOp>& ops) = 0;
  // Completions available now (never blocks); at most `out.size()`.
  virtual size_t reap(std::vector<IoDone>& out) = 0;
};

// The backends this library was compiled with, best first ("io_uring", "libaio", "blocking").
std::vector<std::string> compiled_backends();

// A queue of the backend `name` ("io_uring", "libaio" or "blocking") keeping up to `depth` transfers
// outstanding (blocking: 1); `event_fd` is written on completions. nullptr, with `why` set, when that
// backend is not compiled in or its setup fails here (the engine then tries the next one, or reports it).
std::unique_ptr<IoQueue> make_io_queue(const std::string& name, int64_t depth, bool single_submit, int event_fd,
                                       std::string* why);

// Factories of each backend: nullptr with `why` set when it is not compiled in or its setup fails.
std::unique_ptr<IoQueue> make_uring_queue(int64_t depth, bool single_submit, int event_fd, std::string* why);
std::unique_ptr<IoQueue> make_libaio_queue(int64_t depth, bool single_submit, int event_fd, std::string* why);
std::unique_ptr<IoQueue> make_blocking_queue();

}  // namespace ds::aio
