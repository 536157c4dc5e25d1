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

std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm_cpu(at::TensorList tensors) {
  std::vector<ConstBuffer> buffers;
  buffers.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.device().is_cpu(), "multi_tensor_l2norm: tensors[", i, "] is on ", t.device(),
                "; the CPU kernel needs CPU tensors");
    TORCH_CHECK(t.is_contiguous(), "multi_tensor_l2norm: tensors[", i, "] is not contiguous");
    buffers.push_back({t.data_ptr(), t.numel(), kernel_dtype(t, "multi_tensor_l2norm: tensors[", i, "]")});
  }
  SumOfSquares result{0.0, false};
  {
    // Pure C++ from here on: no Python objects are touched, so the caller's GIL is not needed.
    result = multi_tensor_sum_of_squares(buffers.data(), static_cast<int64_t>(buffers.size()),
                                         at::get_num_threads());
  }
  const auto options = at::TensorOptions().dtype(at::kFloat);
  return {at::full({}, static_cast<float>(std::sqrt(result.sum_sq)), options),
          at::full({}, result.nonfinite ? 1.0f : 0.0f, options)};
}

std::string simd_isa() { return compiled_isa(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(ds_strategy, m) {
  m.def("multi_tensor_l2norm(Tensor[] tensors) -> (Tensor norm, Tensor found_inf)");
  m.def("simd_isa() -> str");
  m.impl("simd_isa", &simd_isa);
}

TORCH_LIBRARY_IMPL(ds_strategy, CPU, m) { m.impl("multi_tensor_l2norm", &multi_tensor_l2norm_cpu); }

}  // namespace ds::norm
