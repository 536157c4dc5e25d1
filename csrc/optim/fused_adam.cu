// fused_adam.cu: CUDA twin of the CPU Adam kernel (cpu_optim.cpp), over the same per-element math
// (optim_math.h, whose float operations use the non-contracting _rn intrinsics on the device).
//
// Multi-tensor: up to kMaxCudaTensors tensors per launch, their pointers in the kernel arguments (as in
// apex's multi_tensor_apply); blockIdx.y picks the tensor, a grid-stride loop covers it. The optional
// unscale/clip, the inf/nan report and the bf16/fp16 copy-out happen in the same pass, as on the CPU.
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "../includes/dtypes.h"
#include "../includes/optim_math.h"
#include "fused_adam_cuda.h"

namespace ds::optim {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocksPerTensor = 1024;

__device__ __forceinline__ float load_grad(const void* g, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kBFloat16:
      return to_float(static_cast<const bf16*>(g)[i]);
    case DType::kFloat16:
      return to_float(static_cast<const fp16*>(g)[i]);
    default:
      return static_cast<const float*>(g)[i];
  }
}

__device__ __forceinline__ void store_out(void* out, DType dtype, int64_t i, float p) {
  if (dtype == DType::kBFloat16) {
    static_cast<bf16*>(out)[i] = to_bf16(p);
  } else {
    static_cast<fp16*>(out)[i] = to_fp16(p);
  }
}

__global__ void nonfinite_kernel(AdamDeviceBatch batch, float* found_inf) {
  const int t = blockIdx.y;
  bool bad = false;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < batch.numel[t];
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    bad |= is_nonfinite(load_grad(batch.grad[t], batch.grad_dtype[t], i));
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) *found_inf = 1.0f;  // every writer stores the same value
}

__global__ void adam_kernel(AdamDeviceBatch batch, AdamScalars s, GradScalars gs, const float* skip_flag,
                            float* found_inf) {
  if (skip_flag != nullptr && *skip_flag != 0.0f) return;
  const int t = blockIdx.y;
  float* __restrict__ param = batch.param[t];
  float* __restrict__ exp_avg = batch.exp_avg[t];
  float* __restrict__ exp_avg_sq = batch.exp_avg_sq[t];
  const bool l2 = s.has_weight_decay && !s.adamw_mode;
  const bool decoupled = s.has_weight_decay && s.adamw_mode;
  const AdamConsts<float> c{s.beta2, s.one_minus_beta1, s.one_minus_beta2, s.eps,
                            s.neg_step_size, s.bc2_sqrt, s.weight_decay, s.decay};
  bool bad = false;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < batch.numel[t];
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float g = load_grad(batch.grad[t], batch.grad_dtype[t], i);
    bad |= is_nonfinite(g);
    if (!gs.identity) g = prepare_grad(g, gs.inv_scale, gs.clip_coef);
    float p = param[i], m = exp_avg[i], v = exp_avg_sq[i];
    adam_update(p, g, m, v, c, l2, decoupled);
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if (batch.out16[t] != nullptr) store_out(batch.out16[t], batch.out_dtype[t], i, p);
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) *found_inf = 1.0f;
}

dim3 grid_for(int count, int64_t max_numel) {
  const int64_t blocks = std::min<int64_t>(kMaxBlocksPerTensor, (max_numel + kThreads - 1) / kThreads);
  return dim3(static_cast<unsigned>(std::max<int64_t>(1, blocks)), static_cast<unsigned>(count));
}

}  // namespace

void launch_nonfinite_check(const AdamDeviceBatch& batch, int count, int64_t max_numel, float* found_inf,
                            cudaStream_t stream) {
  if (count == 0) return;
  nonfinite_kernel<<<grid_for(count, max_numel), kThreads, 0, stream>>>(batch, found_inf);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void launch_adam(const AdamDeviceBatch& batch, int count, int64_t max_numel, const AdamScalars& s,
                 const GradScalars& gs, const float* skip_flag, float* found_inf, cudaStream_t stream) {
  if (count == 0) return;
  adam_kernel<<<grid_for(count, max_numel), kThreads, 0, stream>>>(batch, s, gs, skip_flag, found_inf);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace ds::optim
