// norm_ops_cuda.cpp: CUDA implementation of ds_strategy::multi_tensor_l2norm (schema defined in
// norm_ops.cpp, which the CPU library registers first).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "../includes/dispatch.h"
#include "multi_tensor_norm_cuda.h"

namespace ds::norm {
namespace {

std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm_cuda(at::TensorList tensors) {
  TORCH_CHECK(!tensors.empty(), "multi_tensor_l2norm: empty tensor list");
  const at::Device device = tensors[0].device();
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  at::Tensor sum_sq = at::zeros({}, tensors[0].options().dtype(at::kDouble));
  at::Tensor nonfinite = at::zeros({}, tensors[0].options().dtype(at::kInt));
  DeviceBatch batch{};
  int count = 0;
  int64_t max_numel = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.device() == device, "multi_tensor_l2norm: tensors[", i, "] is on ", t.device(), ", tensors[0] on ",
                device);
    TORCH_CHECK(t.is_contiguous(), "multi_tensor_l2norm: tensors[", i, "] is not contiguous");
    batch.data[count] = t.data_ptr();
    batch.numel[count] = t.numel();
    batch.dtype[count] = kernel_dtype(t, "multi_tensor_l2norm: tensors[", i, "]");
    max_numel = std::max(max_numel, t.numel());
    if (++count == kMaxTensors || i + 1 == tensors.size()) {
      launch_sum_of_squares(batch, count, max_numel, sum_sq.data_ptr<double>(), nonfinite.data_ptr<int>(), stream);
      count = 0;
      max_numel = 0;
    }
  }
  at::Tensor norm = at::empty({}, tensors[0].options().dtype(at::kFloat));
  at::Tensor found_inf = at::empty({}, tensors[0].options().dtype(at::kFloat));
  launch_finish(sum_sq.data_ptr<double>(), nonfinite.data_ptr<int>(), norm.data_ptr<float>(),
                found_inf.data_ptr<float>(), stream);
  return {norm, found_inf};
}

}  // namespace

TORCH_LIBRARY_IMPL(ds_strategy, CUDA, m) { m.impl("multi_tensor_l2norm", &multi_tensor_l2norm_cuda); }

}  // namespace ds::norm
