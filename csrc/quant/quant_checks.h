// quant_checks.h: argument checks and output shapes of the quantization ops, shared by the CPU (quant_ops.cpp)
// and CUDA (quant_ops_cuda.cpp) registrations so both refuse the same inputs with the same words and return
// the same shapes.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <tuple>

#include "../includes/quant_math.h"

namespace ds::quant {

struct Rows {
  int64_t rows;
  int64_t n;
};

inline void check_format(const char* op, int64_t block_size, int64_t bits) {
  TORCH_CHECK(bits == 8 || bits == 4, op, ": bits is ", bits, "; expected 8 or 4");
  TORCH_CHECK(block_size > 0, op, ": block_size is ", block_size, "; expected a positive number of elements");
  TORCH_CHECK(bits == 8 || block_size % 2 == 0, op, ": block_size is ", block_size,
              "; int4 packs two elements per byte, so it must be even");
}

// A 1-D tensor is one row; a 2-D one is rows x n.
inline Rows rows_of(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.dim() == 1 || t.dim() == 2, op, ": ", name, " has ", t.dim(), " dimensions; expected 1 or 2");
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " is not contiguous");
  return t.dim() == 1 ? Rows{1, t.size(0)} : Rows{t.size(0), t.size(1)};
}

// q and scales as quantize_blockwise made them for `rows` rows of n elements.
inline void check_quantized(const char* op, const at::Tensor& q, const at::Tensor& scales, int64_t rows, int64_t n,
                            int64_t block_size, int64_t bits) {
  TORCH_CHECK(q.scalar_type() == at::kChar, op, ": q has dtype ", q.scalar_type(), "; expected int8");
  TORCH_CHECK(scales.scalar_type() == at::kFloat, op, ": scales has dtype ", scales.scalar_type(), "; expected float32");
  TORCH_CHECK(q.is_contiguous() && scales.is_contiguous(), op, ": q and scales must be contiguous");
  TORCH_CHECK(q.numel() == rows * packed_numel(n, static_cast<int>(bits)), op, ": q has ", q.numel(),
              " bytes; ", rows, " rows of ", n, " elements at ", bits, " bits need ",
              rows * packed_numel(n, static_cast<int>(bits)));
  TORCH_CHECK(scales.numel() == rows * num_blocks(n, block_size), op, ": scales has ", scales.numel(),
              " elements; ", rows, " rows of ", n, " elements in blocks of ", block_size, " need ",
              rows * num_blocks(n, block_size));
}

// The (q, scales) that quantize_blockwise returns for x: int8 bytes (two int4 values per byte at 4 bits) and
// one float32 scale per block, per row of a 2-D x; 1-D for a 1-D x. Allocated on x's device.
inline std::tuple<at::Tensor, at::Tensor> empty_quantized(const at::Tensor& x, const Rows& shape, int64_t block_size,
                                                          int bits) {
  const auto options = x.options();
  const int64_t bytes = packed_numel(shape.n, bits), blocks = num_blocks(shape.n, block_size);
  if (x.dim() == 1) {
    return {at::empty({bytes}, options.dtype(at::kChar)), at::empty({blocks}, options.dtype(at::kFloat))};
  }
  return {at::empty({shape.rows, bytes}, options.dtype(at::kChar)),
          at::empty({shape.rows, blocks}, options.dtype(at::kFloat))};
}

}  // namespace ds::quant
