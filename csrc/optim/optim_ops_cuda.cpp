// optim_ops_cuda.cpp: CUDA implementation of ds_strategy::adam_step_ (schema in optim_ops.cpp, which the
// CPU library registers first). Same checks as on the CPU (optim_checks.h); the skip decision of
// skip_if_nonfinite stays on the device (no host synchronisation): a check pass sets found_inf, every
// block of the step kernel reads it first.
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "fused_adam_cuda.h"
#include "optim_checks.h"

namespace ds::optim {
namespace {

// Calls fn(batch, count, max_numel) for consecutive batches of at most kMaxCudaTensors non-empty buffers.
template <typename Fn>
void for_each_batch(const std::vector<ParamBuffers>& buffers, Fn&& fn) {
  AdamDeviceBatch batch{};
  int count = 0;
  int64_t max_numel = 0;
  for (size_t i = 0; i < buffers.size(); ++i) {
    const ParamBuffers& b = buffers[i];
    if (b.numel > 0) {
      batch.param[count] = b.param;
      batch.grad[count] = b.grad;
      batch.exp_avg[count] = b.state1;
      batch.exp_avg_sq[count] = b.state2;
      batch.out16[count] = b.out16;
      batch.numel[count] = b.numel;
      batch.grad_dtype[count] = b.grad_dtype;
      batch.out_dtype[count] = b.out_dtype;
      max_numel = std::max(max_numel, b.numel);
      ++count;
    }
    if (count > 0 && (count == kMaxCudaTensors || i + 1 == buffers.size())) {
      fn(batch, count, max_numel);
      count = 0;
      max_numel = 0;
    }
  }
}

at::Tensor adam_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                          at::TensorList exp_avg_sqs, at::TensorList out_16bit, double lr, double beta1, double beta2,
                          double eps, double weight_decay, int64_t step, bool adamw_mode, bool bias_correction,
                          double grad_scale, double clip_coef, bool skip_if_nonfinite) {
  constexpr const char* op = "adam_step_";
  TORCH_CHECK(step >= 1, op, ": step must be >= 1 (the count after this update), got ", step);
  TORCH_CHECK(!params.empty(), op, ": empty parameter list");
  const auto buffers = checked_buffers(op, c10::DeviceType::CUDA, params, grads,
                                       {{"exp_avgs", exp_avgs}, {"exp_avg_sqs", exp_avg_sqs}}, out_16bit);
  const at::Device device = params[0].device();
  for (size_t i = 1; i < params.size(); ++i) {
    TORCH_CHECK(params[i].device() == device, op, ": params[", i, "] is on ", params[i].device(),
                " but params[0] is on ", device);
  }
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  const GradScalars gs = grad_scalars(op, grad_scale, clip_coef);
  const auto s = AdamScalars::make(lr, beta1, beta2, eps, weight_decay, step, adamw_mode, bias_correction);
  at::Tensor found_inf = at::zeros({}, params[0].options());
  float* found = found_inf.data_ptr<float>();
  if (skip_if_nonfinite) {
    for_each_batch(buffers, [&](const AdamDeviceBatch& batch, int count, int64_t max_numel) {
      launch_nonfinite_check(batch, count, max_numel, found, stream);
    });
  }
  const float* skip_flag = skip_if_nonfinite ? found : nullptr;
  for_each_batch(buffers, [&](const AdamDeviceBatch& batch, int count, int64_t max_numel) {
    launch_adam(batch, count, max_numel, s, gs, skip_flag, found, stream);  // checks its launch
  });
  return found_inf;
}

}  // namespace

TORCH_LIBRARY_IMPL(ds_strategy, CUDA, m) { m.impl("adam_step_", &adam_step_cuda); }

}  // namespace ds::optim
