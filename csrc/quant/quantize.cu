// quantize.cu: CUDA twin of quantize.cpp over the same per-element math (quant_math.h).
//
// quantize: one thread block per (row, quantization block): a strided absmax scan, a shared-memory max
// (NaN wins, as on the CPU), then each thread rounds its elements (pairs of them for int4, packed into one
// byte). dequantize and dequantize_sum: grid-stride loops over elements.
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../includes/dtypes.h"
#include "../includes/quant_math.h"
#include "quantize_cuda.h"

namespace ds::quant {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ void store_one(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_one(bf16* p, float v) { *p = to_bf16(v); }
__device__ __forceinline__ void store_one(fp16* p, float v) { *p = to_fp16(v); }

__device__ __forceinline__ int load_q(const int8_t* q_row, int64_t i, int bits) {
  if (bits == 8) return q_row[i];
  return unpack_int4(reinterpret_cast<const uint8_t*>(q_row)[i / 2], static_cast<int>(i & 1));
}

template <typename T>
__global__ void quantize_kernel(const T* x, int64_t n, int64_t nb, int64_t block, int bits, int8_t* q, float* scales) {
  const int64_t r = blockIdx.x / nb, b = blockIdx.x % nb;
  const int64_t first = b * block;
  const int64_t len = (n - first) < block ? (n - first) : block;
  const T* xs = x + r * n + first;
  float m = 0.0f;
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x) m = abs_max(m, to_float(xs[i]));
  __shared__ float partial[kThreads];
  partial[threadIdx.x] = m;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half >>= 1) {
    if (threadIdx.x < half) partial[threadIdx.x] = abs_max(partial[threadIdx.x], partial[threadIdx.x + half]);
    __syncthreads();
  }
  const int qmax = qmax_of(bits);
  const float absmax = partial[0];
  const float inv = block_inv_scale(absmax, qmax);
  if (threadIdx.x == 0) scales[blockIdx.x] = block_scale(absmax, qmax);
  int8_t* q_row = q + r * packed_numel(n, bits);
  if (bits == 8) {
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
      q_row[first + i] = static_cast<int8_t>(quantize_one(to_float(xs[i]), inv, qmax));
    }
    return;
  }
  uint8_t* packed = reinterpret_cast<uint8_t*>(q_row) + first / 2;
  for (int64_t j = threadIdx.x; 2 * j < len; j += blockDim.x) {
    const int lo = quantize_one(to_float(xs[2 * j]), inv, qmax);
    const int hi = 2 * j + 1 < len ? quantize_one(to_float(xs[2 * j + 1]), inv, qmax) : 0;
    packed[j] = pack_int4(lo, hi);
  }
}

template <typename T>
__global__ void dequantize_kernel(const int8_t* q, const float* scales, int64_t rows, int64_t n, int64_t block,
                                  int bits, T* out) {
  const int64_t nb = num_blocks(n, block);
  const int64_t row_bytes = packed_numel(n, bits);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < rows * n; e += stride) {
    const int64_t r = e / n, i = e % n;
    store_one(out + e, dequantize_one(load_q(q + r * row_bytes, i, bits), scales[r * nb + i / block]));
  }
}

__global__ void dequantize_sum_kernel(const int8_t* q, const float* scales, int64_t rows, int64_t n, int64_t block,
                                      int bits, float* out) {
  const int64_t nb = num_blocks(n, block);
  const int64_t row_bytes = packed_numel(n, bits);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += stride) {
    float acc = 0.0f;
    for (int64_t r = 0; r < rows; ++r) {
      acc = fmaf(static_cast<float>(load_q(q + r * row_bytes, i, bits)), scales[r * nb + i / block], acc);
    }
    out[i] = acc;
  }
}

unsigned grid_for(int64_t elements) {
  const int64_t blocks = (elements + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 4096 ? 4096 : blocks));
}

}  // namespace

void launch_quantize(const void* x, DType dtype, int64_t rows, int64_t n, int64_t block, int bits, int8_t* q,
                     float* scales, cudaStream_t stream) {
  const int64_t nb = num_blocks(n, block);
  const unsigned grid = static_cast<unsigned>(rows * nb);
  switch (dtype) {
    case DType::kBFloat16:
      quantize_kernel<<<grid, kThreads, 0, stream>>>(static_cast<const bf16*>(x), n, nb, block, bits, q, scales);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      break;
    case DType::kFloat16:
      quantize_kernel<<<grid, kThreads, 0, stream>>>(static_cast<const fp16*>(x), n, nb, block, bits, q, scales);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      break;
    default:
      quantize_kernel<<<grid, kThreads, 0, stream>>>(static_cast<const float*>(x), n, nb, block, bits, q, scales);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

void launch_dequantize(const int8_t* q, const float* scales, int64_t rows, int64_t n, int64_t block, int bits,
                       void* out, DType dtype, cudaStream_t stream) {
  const unsigned grid = grid_for(rows * n);
  switch (dtype) {
    case DType::kBFloat16:
      dequantize_kernel<<<grid, kThreads, 0, stream>>>(q, scales, rows, n, block, bits, static_cast<bf16*>(out));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      break;
    case DType::kFloat16:
      dequantize_kernel<<<grid, kThreads, 0, stream>>>(q, scales, rows, n, block, bits, static_cast<fp16*>(out));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      break;
    default:
      dequantize_kernel<<<grid, kThreads, 0, stream>>>(q, scales, rows, n, block, bits, static_cast<float*>(out));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

void launch_dequantize_sum(const int8_t* q, const float* scales, int64_t rows, int64_t n, int64_t block, int bits,
                           float* out, cudaStream_t stream) {
  dequantize_sum_kernel<<<grid_for(n), kThreads, 0, stream>>>(q, scales, rows, n, block, bits, out);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace ds::quant
