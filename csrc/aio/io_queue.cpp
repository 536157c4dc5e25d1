// io_queue.cpp: the backend choice, and the blocking backend (one pread/pwrite per transfer, in submit()).
#include "io_queue.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>

namespace ds::aio {
namespace {

// The fallback that needs no library: the transfer runs in submit(), so the device sees one request per
// worker. Its result is handed back by the next reap(), like an asynchronous completion.
class BlockingQueue final : public IoQueue {
 public:
  int64_t depth() const override { return 1; }

  void submit(const std::vector<IoOp>& ops) override {
    for (const IoOp& op : ops) {
      const ssize_t n = op.is_write ? ::pwrite(op.fd, op.data, static_cast<size_t>(op.length), op.offset)
                                    : ::pread(op.fd, op.data, static_cast<size_t>(op.length), op.offset);
      done_.push_back({op.tag, n < 0 ? -static_cast<int64_t>(errno) : static_cast<int64_t>(n)});
    }
  }

  size_t reap(std::vector<IoDone>& out) override {
    const size_t n = std::min(out.size(), done_.size());
    std::copy(done_.begin(), done_.begin() + static_cast<std::ptrdiff_t>(n), out.begin());
    done_.erase(done_.begin(), done_.begin() + static_cast<std::ptrdiff_t>(n));
    return n;
  }

 private:
  std::vector<IoDone> done_;
};

}  // namespace

std::unique_ptr<IoQueue> make_blocking_queue() { return std::make_unique<BlockingQueue>(); }

std::vector<std::string> compiled_backends() {
  std::vector<std::string> names;
#ifdef DS_AIO_HAVE_URING
  names.emplace_back("io_uring");
#endif
#ifdef DS_AIO_HAVE_LIBAIO
  names.emplace_back("libaio");
#endif
  names.emplace_back("blocking");
  return names;
}

std::unique_ptr<IoQueue> make_io_queue(const std::string& name, int64_t depth, bool single_submit, int event_fd,
                                       std::string* why) {
  if (name == "io_uring") return make_uring_queue(depth, single_submit, event_fd, why);
  if (name == "libaio") return make_libaio_queue(depth, single_submit, event_fd, why);
  return make_blocking_queue();
}

}  // namespace ds::aio
