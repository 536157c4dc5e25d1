// dispatch.h: the one place an ATen dtype becomes the element type (DType) of our raw-pointer kernels.
//
// Every op boundary (CPU and CUDA registrations of the optimizer steps, the norm, the shared-memory
// collectives) accepts float32, bfloat16 and float16 and nothing else. `where...` names the argument at
// fault in the op's own words (e.g. "adam_step_: grads[", i, "]"), so the error says which tensor to fix.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "dtypes.h"

namespace ds {

template <typename... Where>
DType kernel_dtype(const at::Tensor& t, const Where&... where) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kHalf:
      return DType::kFloat16;
    default:
      TORCH_CHECK(false, where..., " has dtype ", t.scalar_type(), "; expected float32, bfloat16 or float16");
  }
}

}  // namespace ds
