// multi_tensor_norm.cu: CUDA twin of multi_tensor_norm.cpp, over the same per-element math (norm_math.h).
//
// Tensors are processed in batches of kMaxTensors per launch (their pointers travel in the kernel
// arguments, as in apex's multi_tensor_apply); blockIdx.y picks the tensor, a grid-stride loop covers it,
// each block reduces in shared memory and adds its partial sum into one double accumulator.
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

__global__ void sum_of_squares_kernel(DeviceBatch batch, double* sum_sq, int* nonfinite) {
  const int t = blockIdx.y;
  const void* data = batch.data[t];
  const int64_t n = batch.numel[t];
  const DType dtype = batch.dtype[t];
  float acc = 0.0f;
  bool bad = false;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float v;
    switch (dtype) {
      case DType::kBFloat16:
        v = load_float<bf16>(data, i);
        break;
      case DType::kFloat16:
        v = load_float<fp16>(data, i);
        break;
      default:
        v = load_float<float>(data, i);
    }
    bad |= is_nonfinite(v);
    acc = accumulate_square(acc, v);
  }
  __shared__ float partial[kThreads];
  partial[threadIdx.x] = acc;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) atomicAdd(sum_sq, static_cast<double>(partial[0]));
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
