// optim_checks.h: the op-boundary checks shared by the CPU (optim_ops.cpp) and CUDA (optim_ops_cuda.cpp)
// registrations of the optimizer steps. Every check names the list and the index at fault; nothing is
// made contiguous here, because a contiguous copy of a strided parameter would be updated and dropped.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <vector>

#include "../includes/dispatch.h"
#include "../includes/dtypes.h"
#include "cpu_optim.h"

namespace ds::optim {

inline void check_like(const at::Tensor& t, const at::Tensor& param, const char* op, const char* list, size_t i) {
  TORCH_CHECK(t.device() == param.device(), op, ": ", list, "[", i, "] is on ", t.device(), " but params[", i,
              "] is on ", param.device());
  TORCH_CHECK(t.sizes() == param.sizes(), op, ": ", list, "[", i, "] has shape ", t.sizes(), " but params[", i,
              "] has shape ", param.sizes());
  TORCH_CHECK(t.is_contiguous(), op, ": ", list, "[", i,
              "] is not contiguous (the step writes in place; pass a contiguous tensor)");
}

// Checks the lists of one step and returns their raw buffers. `states` holds one or two lists of fp32
// state tensors; `out16` is empty or one bf16/fp16 tensor per parameter.
inline std::vector<ParamBuffers> checked_buffers(const char* op, c10::DeviceType device, at::TensorList params,
                                                 at::TensorList grads,
                                                 std::initializer_list<std::pair<const char*, at::TensorList>> states,
                                                 at::TensorList out16) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n, op, ": got ", n, " params but ", grads.size(), " grads");
  for (const auto& [name, list] : states) {
    TORCH_CHECK(list.size() == n, op, ": got ", n, " params but ", list.size(), " ", name);
  }
  TORCH_CHECK(out16.empty() || out16.size() == n, op, ": out_16bit must be empty or hold one tensor per param (got ",
              out16.size(), " for ", n, " params)");
  std::vector<ParamBuffers> buffers;
  buffers.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK(p.device().type() == device, op, ": params[", i, "] is on ", p.device(), "; this kernel needs ",
                c10::DeviceTypeName(device), " tensors");
    TORCH_CHECK(p.scalar_type() == at::kFloat, op, ": params[", i, "] has dtype ", p.scalar_type(),
                "; the kernel steps float32 (master) parameters");
    TORCH_CHECK(p.is_contiguous(), op, ": params[", i,
                "] is not contiguous (the step writes in place; pass a contiguous tensor)");
    ParamBuffers b{};
    b.param = p.data_ptr<float>();
    b.numel = p.numel();
    check_like(grads[i], p, op, "grads", i);
    b.grad_dtype = kernel_dtype(grads[i], op, ": grads[", i, "]");
    b.grad = grads[i].data_ptr();
    int k = 0;
    for (const auto& [name, list] : states) {
      const at::Tensor& s = list[i];
      TORCH_CHECK(s.scalar_type() == at::kFloat, op, ": ", name, "[", i, "] has dtype ", s.scalar_type(),
                  "; optimizer state must be float32");
      check_like(s, p, op, name, i);
      (k++ == 0 ? b.state1 : b.state2) = s.data_ptr<float>();
    }
    if (!out16.empty()) {
      const at::Tensor& o = out16[i];
      TORCH_CHECK(o.scalar_type() == at::kBFloat16 || o.scalar_type() == at::kHalf, op, ": out_16bit[", i,
                  "] has dtype ", o.scalar_type(), "; expected bfloat16 or float16");
      check_like(o, p, op, "out_16bit", i);
      b.out16 = o.data_ptr();
      b.out_dtype = o.scalar_type() == at::kBFloat16 ? DType::kBFloat16 : DType::kFloat16;
    }
    buffers.push_back(b);
  }
  return buffers;
}

inline GradScalars grad_scalars(const char* op, double grad_scale, double clip_coef) {
  TORCH_CHECK(grad_scale > 0.0 && std::isfinite(grad_scale), op, ": grad_scale must be a positive finite loss scale, got ",
              grad_scale);
  TORCH_CHECK(std::isfinite(clip_coef) && clip_coef >= 0.0, op, ": clip_coef must be finite and >= 0, got ",
              clip_coef);
  // As torch's GradScaler: the reciprocal in double, rounded to float once.
  const float inv_scale = static_cast<float>(1.0 / grad_scale);
  const float clip = static_cast<float>(clip_coef);
  return {inv_scale, clip, inv_scale == 1.0f && clip == 1.0f};
}

}  // namespace ds::optim
