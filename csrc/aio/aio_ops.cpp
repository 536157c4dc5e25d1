// aio_ops.cpp: the torch boundary of the asynchronous I/O engine. AioEngine is a torch custom class, so
// the C++ engine (its threads, I/O queues and requests) is owned by the Python object that holds it: close()
// or dropping it drains the queue and joins the workers. Methods called from Python run with the GIL
// released by torch's script-method call path, so a wait() that blocks lets Python threads run (tested in
// tests/ops/test_aio.py). Files are opened, and errors worded, in ds_strategy/ops/aio.py: wait() returns
// the failed block's (errno, bytes, offset, bytes moved) rather than raising, so both backends raise the
// same AioError.
#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <memory>
#include <string>
#include <vector>

#include "aio_engine.h"

namespace ds::aio {
namespace {

class AioEngine : public torch::CustomClassHolder {
 public:
  AioEngine(int64_t block_size, int64_t queue_depth, int64_t thread_count, bool single_submit, std::string backend) {
    TORCH_CHECK(block_size > 0 && block_size % kAlignment == 0, "aio engine: block_size must be a positive multiple of ",
                kAlignment, ", got ", block_size);
    TORCH_CHECK(queue_depth > 0 && thread_count > 0, "aio engine: queue_depth and thread_count must be positive, got ",
                queue_depth, " and ", thread_count);
    engine_ = std::make_unique<Engine>(block_size, queue_depth, thread_count, single_submit, backend);
  }

  int64_t submit(at::Tensor tensor, int64_t fd, int64_t buffered_fd, int64_t offset, bool is_write, bool direct) {
    TORCH_CHECK(tensor.device().is_cpu() && tensor.is_contiguous(),
                "aio engine: expected a contiguous CPU tensor, got one on ", tensor.device());
    TORCH_CHECK(offset >= 0, "aio engine: offset must be >= 0, got ", offset);
    auto keepalive = std::make_shared<at::Tensor>(tensor);
    return get().submit(static_cast<char*>(tensor.data_ptr()), static_cast<int64_t>(tensor.nbytes()),
                        static_cast<int>(fd), static_cast<int>(buffered_fd), offset, is_write, direct,
                        std::move(keepalive));
  }

  bool done(int64_t id) { return get().done(id); }

  std::vector<int64_t> wait(int64_t id) {
    const Failure f = get().wait(id);
    return {f.error, f.nbytes, f.offset, f.got};
  }

  int64_t in_flight() { return engine_ ? engine_->in_flight() : 0; }
  int64_t max_in_flight() { return engine_ ? engine_->max_in_flight() : 0; }
  std::vector<int64_t> device_max_in_flight() { return get().device_max_in_flight(); }
  std::string backend() { return get().backend(); }
  void close() { engine_.reset(); }  // ~Engine finishes the queued blocks and joins the workers

 private:
  Engine& get() {
    TORCH_CHECK(engine_ != nullptr, "aio engine: used after close, create a new AsyncIO");
    return *engine_;
  }

  std::unique_ptr<Engine> engine_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(ds_strategy, m) {
  m.class_<AioEngine>("AioEngine")
      .def(torch::init<int64_t, int64_t, int64_t, bool, std::string>())
      .def_static("compiled_backends", &compiled_backends)
      .def("submit", &AioEngine::submit)
      .def("done", &AioEngine::done)
      .def("wait", &AioEngine::wait)
      .def("in_flight", &AioEngine::in_flight)
      .def("max_in_flight", &AioEngine::max_in_flight)
      .def("device_max_in_flight", &AioEngine::device_max_in_flight)
      .def("backend", &AioEngine::backend)
      .def("close", &AioEngine::close);
}

}  // namespace ds::aio
