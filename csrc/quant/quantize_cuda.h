// quantize_cuda.h: launchers of the CUDA quantization kernels (plain types only, shared by quantize.cu and
// the op registration in quant_ops_cuda.cpp).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../includes/dtypes.h"

namespace ds::quant {

void launch_quantize(const void* x, DType dtype, int64_t rows, int64_t n, int64_t block, int bits, int8_t* q,
                     float* scales, cudaStream_t stream);
void launch_dequantize(const int8_t* q, const float* scales, int64_t rows, int64_t n, int64_t block, int bits,
                       void* out, DType dtype, cudaStream_t stream);
void launch_dequantize_sum(const int8_t* q, const float* scales, int64_t rows, int64_t n, int64_t block, int bits,
                           float* out, cudaStream_t stream);

}  // namespace ds::quant
