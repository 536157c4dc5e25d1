// quantize.h: the CPU quantization kernels' plain-C++ interface (no torch headers; the op layer in
// quant_ops.cpp is the only place that knows about tensors). Rows are independent: row r of an
// (rows x n) input has its own blocks (see quant_math.h), which is what a gather of every rank's quantized
// shard, or an all-to-all of every peer's quantized chunk, delivers.
#pragma once

#include <cstdint>

#include "../includes/dtypes.h"

namespace ds::quant {

// x: rows x n elements of `dtype`; q: rows x packed_numel(n, bits) bytes; scales: rows x num_blocks(n).
void quantize_rows(const void* x, DType dtype, int64_t rows, int64_t n, int64_t block, int bits, int8_t* q,
                   float* scales, int num_threads);

// The inverse: out (rows x n, `dtype`) = q * scale.
void dequantize_rows(const int8_t* q, const float* scales, int64_t rows, int64_t n, int64_t block, int bits, void* out,
                     DType dtype, int num_threads);

// out (n, fp32) = sum over the rows of their dequantized values, added in row order in fp32.
void dequantize_sum_rows(const int8_t* q, const float* scales, int64_t rows, int64_t n, int64_t block, int bits,
                         float* out, int num_threads);

}  // namespace ds::quant
