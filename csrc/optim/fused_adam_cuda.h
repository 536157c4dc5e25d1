// fused_adam_cuda.h: launchers of the CUDA Adam kernels (plain types only, shared by fused_adam.cu and the
// op registration in optim_ops_cuda.cpp).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../includes/dtypes.h"
#include "../includes/optim_math.h"

namespace ds::optim {

constexpr int kMaxCudaTensors = 24;  // per launch: pointers travel in the kernel arguments (< 4 KB)

struct AdamDeviceBatch {
  float* param[kMaxCudaTensors];
  const void* grad[kMaxCudaTensors];
  float* exp_avg[kMaxCudaTensors];
  float* exp_avg_sq[kMaxCudaTensors];
  void* out16[kMaxCudaTensors];  // nullptr: no copy-out for that tensor
  int64_t numel[kMaxCudaTensors];
  DType grad_dtype[kMaxCudaTensors];
  DType out_dtype[kMaxCudaTensors];
};

// Sets *found_inf to 1 when some gradient of the batch holds inf or NaN (never writes 0).
void launch_nonfinite_check(const AdamDeviceBatch& batch, int count, int64_t max_numel, float* found_inf,
                            cudaStream_t stream);

// One Adam step over the batch. With skip_flag set, every block first reads *skip_flag and returns when it
// is nonzero (so the skip decision needs no host synchronisation); found_inf as above.
void launch_adam(const AdamDeviceBatch& batch, int count, int64_t max_numel, const AdamScalars& s,
                 const GradScalars& gs, const float* skip_flag, float* found_inf, cudaStream_t stream);

}  // namespace ds::optim
