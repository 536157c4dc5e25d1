// multi_tensor_norm.cu: CUDA twin of multi_tensor_norm.cpp, over the same per-element math (norm_math.h).
//
// Tensors are processed in batches of kMaxTensors per launch (their pointers travel in the kernel
// arguments, as in apex's multi_tensor_apply); blockIdx.y picks the tensor, a grid-stride loop covers it,
// each block reduces in shared memory (in double) and adds its partial sum into one double accumulator;
// a thread whose fp32 sum overflowed on finite values redoes it in double, as the CPU kernel does.
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../includes/dtypes.h"
#include "../includes/norm_math.h"
#include "multi_tensor_norm_cuda.h"

namespace ds::norm {
namespace {

constexpr int kThreads = 256;

template <typename T>
__device__ float load_float(const void* p, int64_t i) {
  return to_float(static_cast<const T*>(p)[i]);
}

__device__ float load_any(const void* data, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kBFloat16:
      return load_float<bf16>(data, i);
    case DType::kFloat16:
      return load_float<fp16>(data, i);
    default:
      return load_float<float>(data, i);
  }
}

__global__ void sum_of_squares_kernel(DeviceBatch batch, double* sum_sq, int* nonfinite) {
  const int t = blockIdx.y;
  const void* data = batch.data[t];
  const int64_t n = batch.numel[t];
  const DType dtype = batch.dtype[t];
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  float acc = 0.0f;
  bool bad = false;
  for (int64_t i = first; i < n; i += stride) {
    const float v = load_any(data, dtype, i);
    bad |= is_nonfinite(v);
    acc = accumulate_square(acc, v);
  }
  double mine = static_cast<double>(acc);
  if (is_nonfinite(acc) && !bad) {  // squares beyond fp32's range, not an inf/NaN element (as on the CPU)
    mine = 0.0;
    for (int64_t i = first; i < n; i += stride) mine = accumulate_square_exact(mine, load_any(data, dtype, i));
  }
  // The block's partial sums add in double: fp32 partials can overflow where every one of them is finite.
  __shared__ double partial[kThreads];
  partial[threadIdx.x] = mine;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half >>= 1) {
    if (threadIdx.x < half) partial[threadIdx.x] += partial[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) atomicAdd(sum_sq, partial[0]);
  if (bad) atomicOr(nonfinite, 1);
}

__global__ void finish_kernel(const double* sum_sq, const int* nonfinite, float* norm, float* found_inf) {
  *norm = static_cast<float>(sqrt(*sum_sq));
  *found_inf = *nonfinite ? 1.0f : 0.0f;
}

}  // namespace

void launch_sum_of_squares(const DeviceBatch& batch, int count, int64_t max_numel, double* sum_sq, int* nonfinite,
                           cudaStream_t stream) {
  const int64_t blocks_needed = (max_numel + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(blocks_needed < 1024 ? (blocks_needed > 0 ? blocks_needed : 1) : 1024);
  sum_of_squares_kernel<<<dim3(blocks, static_cast<unsigned>(count)), kThreads, 0, stream>>>(batch, sum_sq, nonfinite);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void launch_finish(const double* sum_sq, const int* nonfinite, float* norm, float* found_inf, cudaStream_t stream) {
  finish_kernel<<<1, 1, 0, stream>>>(sum_sq, nonfinite, norm, found_inf);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace ds::norm
