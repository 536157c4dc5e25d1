// norm_ops.cpp: the torch op boundary of the fused norm kernel. Inputs are checked here (TORCH_CHECK
// names the offending list index) and the kernel itself only ever sees raw, contiguous buffers.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <torch/library.h>

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "../includes/dispatch.h"
#include "multi_tensor_norm.h"

namespace ds::norm {
namespace {

SumOfSquares sum_of_squares_cpu(at::TensorList tensors, const char* op) {
  std::vector<ConstBuffer> buffers;
  buffers.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.device().is_cpu(), op, ": tensors[", i, "] is on ", t.device(), "; the CPU kernel needs CPU tensors");
    TORCH_CHECK(t.is_contiguous(), op, ": tensors[", i, "] is not contiguous");
    buffers.push_back({t.data_ptr(), t.numel(), kernel_dtype(t, op, ": tensors[", i, "]")});
  }
  // Pure C++ from here on: no Python objects are touched, so the caller's GIL is not needed.
  return multi_tensor_sum_of_squares(buffers.data(), static_cast<int64_t>(buffers.size()), at::get_num_threads());
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm_cpu(at::TensorList tensors) {
  const SumOfSquares result = sum_of_squares_cpu(tensors, "multi_tensor_l2norm");
  const auto options = at::TensorOptions().dtype(at::kFloat);
  return {at::full({}, static_cast<float>(std::sqrt(result.sum_sq)), options),
          at::full({}, result.nonfinite ? 1.0f : 0.0f, options)};
}

// The unrounded double sum behind multi_tensor_l2norm: sums over disjoint sets of tensors (NVMe offload
// streams its gradients a sub-group at a time) add up to the norm multi_tensor_l2norm gives for them all.
std::tuple<at::Tensor, at::Tensor> multi_tensor_sum_of_squares_cpu(at::TensorList tensors) {
  const SumOfSquares result = sum_of_squares_cpu(tensors, "multi_tensor_sum_of_squares");
  return {at::full({}, result.sum_sq, at::TensorOptions().dtype(at::kDouble)),
          at::full({}, result.nonfinite ? 1.0f : 0.0f, at::TensorOptions().dtype(at::kFloat))};
}

std::string simd_isa() { return compiled_isa(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(ds_strategy, m) {
  m.def("multi_tensor_l2norm(Tensor[] tensors) -> (Tensor norm, Tensor found_inf)");
  m.def("multi_tensor_sum_of_squares(Tensor[] tensors) -> (Tensor sum_sq, Tensor found_inf)");
  m.def("simd_isa() -> str");
  m.impl("simd_isa", &simd_isa);
}

TORCH_LIBRARY_IMPL(ds_strategy, CPU, m) {
  m.impl("multi_tensor_l2norm", &multi_tensor_l2norm_cpu);
  m.impl("multi_tensor_sum_of_squares", &multi_tensor_sum_of_squares_cpu);
}

}  // namespace ds::norm
