// multi_tensor_norm_cuda.h: launchers of the CUDA norm kernels (plain types only, shared by the .cu and the
// op registration in norm_ops_cuda.cpp).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../includes/dtypes.h"

namespace ds::norm {

constexpr int kMaxTensors = 48;  // per launch; kernel arguments stay well under the 4 KB limit

struct DeviceBatch {
  const void* data[kMaxTensors];
  int64_t numel[kMaxTensors];
  DType dtype[kMaxTensors];
};

// Adds the sum of squares of `count` tensors into *sum_sq and sets *nonfinite when one holds inf/NaN.
void launch_sum_of_squares(const DeviceBatch& batch, int count, int64_t max_numel, double* sum_sq, int* nonfinite,
                           cudaStream_t stream);
void launch_finish(const double* sum_sq, const int* nonfinite, float* norm, float* found_inf, cudaStream_t stream);

}  // namespace ds::norm
