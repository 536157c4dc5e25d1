// shm_ops.cpp: the torch boundary of the shared-memory collectives (ShmComm) and channels (ShmChannel).
// Both are torch custom classes, so their C++ state is owned by the Python object that holds it (no
// global table): dropping or close()-ing one unmaps its segment. Tensors are checked here, naming the
// argument at fault; the collectives themselves only see raw contiguous buffers. Methods called from
// Python run with the GIL released by torch's script-method call path (tested in tests/comm/test_shm.py).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <memory>
#include <string>

#include "../includes/dispatch.h"
#include "shm_channel.h"
#include "shm_collectives.h"

namespace ds::comm {
namespace {

void check_tensor(const at::Tensor& t, const char* op, const char* arg) {
  TORCH_CHECK(t.defined(), "shm ", op, ": ", arg, " is undefined");
  TORCH_CHECK(t.device().is_cpu(), "shm ", op, ": ", arg, " is on ", t.device(), "; expected a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), "shm ", op, ": ", arg, " is not contiguous (a collective writes it in place; ",
              "pass a contiguous tensor and copy back)");
}

bool parse_avg(const std::string& op_name, const char* op) {
  TORCH_CHECK(op_name == "sum" || op_name == "avg", "shm ", op, ": op must be 'sum' or 'avg', got '", op_name, "'");
  return op_name == "avg";
}

bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  const auto* a0 = static_cast<const char*>(a.data_ptr());
  const auto* b0 = static_cast<const char*>(b.data_ptr());
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

class ShmComm : public torch::CustomClassHolder {
 public:
  ShmComm(int64_t rank, int64_t world_size, int64_t slot_bytes, int64_t small_bytes, double timeout_s,
          std::string name)
      : comm_(std::make_unique<Communicator>(static_cast<int>(rank), static_cast<int>(world_size), slot_bytes,
                                             small_bytes, timeout_s, name)),
        rank_(rank),
        world_(world_size) {}

  std::string name() { return get("name").name(); }
  void unlink() { get("unlink").unlink(); }
  bool linked() { return get("linked").linked(); }
  int64_t mode() { return get("mode").mode(); }
  int64_t uid() { return get("uid").uid(); }
  int64_t segment_bytes() { return static_cast<int64_t>(get("segment_bytes").segment_bytes()); }
  int64_t slot_bytes() { return get("slot_bytes").slot_bytes(); }
  double timeout() { return get("timeout").timeout(); }
  void set_timeout(double seconds) { get("set_timeout").set_timeout(seconds); }
  bool closed() { return comm_ == nullptr; }
  void close() { comm_.reset(); }

  void all_reduce(at::Tensor tensor, std::string op_name) {
    const char* op = "all_reduce";
    Communicator& c = get(op);
    check_tensor(tensor, op, "tensor");
    const bool avg = parse_avg(op_name, op);
    const DType dtype = kernel_dtype(tensor, "shm ", op, ": tensor");
    c.all_reduce(tensor.data_ptr(), tensor.numel(), dtype, avg, at::get_num_threads());
  }

  void reduce_scatter(at::Tensor output, at::Tensor input, std::string op_name) {
    const char* op = "reduce_scatter";
    Communicator& c = get(op);
    check_tensor(output, op, "output");
    check_tensor(input, op, "input");
    const bool avg = parse_avg(op_name, op);
    const DType dtype = kernel_dtype(input, "shm ", op, ": input");
    TORCH_CHECK(output.scalar_type() == input.scalar_type(), "shm ", op, ": output has dtype ", output.scalar_type(),
                " but input has ", input.scalar_type(), "; they must match");
    TORCH_CHECK(input.numel() == world_ * output.numel(), "shm ", op, ": input has ", input.numel(),
                " elements; expected world_size (", world_, ") x output.numel() (", output.numel(), ") = ",
                world_ * output.numel());
    // The one overlap that works: output is exactly this rank's shard of input (each element of it is
    // read once, then written, at the same index).
    const auto* own = static_cast<const char*>(input.data_ptr()) + rank_ * output.nbytes();
    TORCH_CHECK(!overlaps(output, input) || output.data_ptr() == own, "shm ", op,
                ": output overlaps input other than as exactly this rank's shard input[rank * n:(rank + 1) * n]");
    c.reduce_scatter(output.data_ptr(), input.data_ptr(), output.numel(), dtype, avg, at::get_num_threads());
  }

  void all_gather(at::Tensor output, at::Tensor input) { all_gather_tagged(std::move(output), std::move(input), 0); }

  std::vector<int64_t> peer_tags() { return get("peer_tags").peer_tags(); }

  void all_to_all(at::Tensor output, at::Tensor input) {
    const char* op = "all_to_all";
    Communicator& c = get(op);
    check_tensor(output, op, "output");
    check_tensor(input, op, "input");
    const DType dtype = kernel_dtype(input, "shm ", op, ": input");
    TORCH_CHECK(output.scalar_type() == input.scalar_type(), "shm ", op, ": output has dtype ", output.scalar_type(),
                " but input has ", input.scalar_type(), "; they must match");
    TORCH_CHECK(output.numel() == input.numel() && input.numel() % world_ == 0, "shm ", op, ": input has ",
                input.numel(), " and output ", output.numel(), " elements; both must be one size, a multiple of ",
                "world_size (", world_, ")");
    TORCH_CHECK(!overlaps(output, input), "shm ", op, ": output overlaps input; pass disjoint tensors");
    c.all_to_all(output.data_ptr(), input.data_ptr(), input.numel() / world_, dtype, at::get_num_threads());
  }

  void all_gather_tagged(at::Tensor output, at::Tensor input, int64_t tag) {
    const char* op = "all_gather";
    Communicator& c = get(op);
    check_tensor(output, op, "output");
    check_tensor(input, op, "input");
    const DType dtype = kernel_dtype(input, "shm ", op, ": input");
    TORCH_CHECK(output.scalar_type() == input.scalar_type(), "shm ", op, ": output has dtype ", output.scalar_type(),
                " but input has ", input.scalar_type(), "; they must match");
    TORCH_CHECK(output.numel() == world_ * input.numel(), "shm ", op, ": output has ", output.numel(),
                " elements; expected world_size (", world_, ") x input.numel() (", input.numel(), ") = ",
                world_ * input.numel());
    const auto* own = static_cast<const char*>(output.data_ptr()) + rank_ * input.nbytes();
    TORCH_CHECK(!overlaps(output, input) || input.data_ptr() == own, "shm ", op,
                ": input overlaps output other than as exactly this rank's shard output[rank * n:(rank + 1) * n]");
    c.all_gather(output.data_ptr(), input.data_ptr(), input.numel(), dtype, at::get_num_threads(), tag);
  }

 private:
  Communicator& get(const char* what) {
    TORCH_CHECK(comm_ != nullptr, "shm ", what, ": the communicator is closed");
    return *comm_;
  }

  std::unique_ptr<Communicator> comm_;
  int64_t rank_;
  int64_t world_;
};

// One end of a one-way point-to-point channel (shm_channel.h): the pipeline's activations and gradients
// between neighbouring stages on one host. Tensors of any dtype travel as their bytes.
class ShmChannel : public torch::CustomClassHolder {
 public:
  ShmChannel(std::string name, int64_t slots, int64_t slot_bytes)
      : chan_(std::make_unique<Channel>(name, slots, slot_bytes)) {}

  std::string name() { return get("name").name(); }
  int64_t slots() { return get("slots").slots(); }
  int64_t slot_bytes() { return get("slot_bytes").slot_bytes(); }
  void close() { chan_.reset(); }

  bool send(at::Tensor tensor, double seconds) {
    Channel& c = get("send");
    check_tensor(tensor, "channel send", "tensor");
    return c.send(tensor.data_ptr(), static_cast<int64_t>(tensor.nbytes()), seconds);
  }

  bool recv(at::Tensor tensor, double seconds) {
    Channel& c = get("recv");
    check_tensor(tensor, "channel recv", "tensor");
    return c.recv(tensor.data_ptr(), static_cast<int64_t>(tensor.nbytes()), seconds);
  }

 private:
  Channel& get(const char* what) {
    TORCH_CHECK(chan_ != nullptr, "shm channel ", what, ": the channel is closed");
    return *chan_;
  }

  std::unique_ptr<Channel> chan_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(ds_strategy, m) {
  m.class_<ShmComm>("ShmComm")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, double, std::string>())
      .def("name", &ShmComm::name)
      .def("unlink", &ShmComm::unlink)
      .def("linked", &ShmComm::linked)
      .def("mode", &ShmComm::mode)
      .def("uid", &ShmComm::uid)
      .def("segment_bytes", &ShmComm::segment_bytes)
      .def("slot_bytes", &ShmComm::slot_bytes)
      .def("timeout", &ShmComm::timeout)
      .def("set_timeout", &ShmComm::set_timeout)
      .def("closed", &ShmComm::closed)
      .def("close", &ShmComm::close)
      .def("all_reduce", &ShmComm::all_reduce)
      .def("reduce_scatter", &ShmComm::reduce_scatter)
      .def("all_gather", &ShmComm::all_gather)
      .def("all_gather_tagged", &ShmComm::all_gather_tagged)
      .def("peer_tags", &ShmComm::peer_tags)
      .def("all_to_all", &ShmComm::all_to_all);
  m.class_<ShmChannel>("ShmChannel")
      .def(torch::init<std::string, int64_t, int64_t>())
      .def("name", &ShmChannel::name)
      .def("slots", &ShmChannel::slots)
      .def("slot_bytes", &ShmChannel::slot_bytes)
      .def("close", &ShmChannel::close)
      .def("send", &ShmChannel::send)
      .def("recv", &ShmChannel::recv);
}

}  // namespace ds::comm
