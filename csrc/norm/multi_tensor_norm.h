// multi_tensor_norm.h: the CPU kernel's plain-C++ interface (no torch headers, so it compiles fast and the
// op layer in norm_ops.cpp stays the only place that knows about tensors).
#pragma once

#include <cstdint>

#include "../includes/dtypes.h"

namespace ds::norm {

struct ConstBuffer {
  const void* data;
  int64_t numel;
  DType dtype;
};

struct SumOfSquares {
  double sum_sq;    // sum over every element of every buffer of x*x
  bool nonfinite;   // some element is inf or NaN
};

// One pass over all buffers, split into fixed-size chunks so that threads stay balanced whatever the
// mix of tensor sizes.
SumOfSquares multi_tensor_sum_of_squares(const ConstBuffer* buffers, int64_t count, int num_threads);

// Name of the SIMD instruction set this translation unit was compiled for.
const char* compiled_isa();

}  // namespace ds::norm
