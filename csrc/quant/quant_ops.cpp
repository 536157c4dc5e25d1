// quant_ops.cpp: the torch op boundary of block-wise symmetric quantization (ZeRO++). Inputs are checked
// here (quant_checks.h: the argument at fault and what is valid); the kernels in quantize.cpp only see raw,
// contiguous buffers.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <tuple>

#include "../includes/dispatch.h"
#include "quant_checks.h"
#include "quantize.h"

namespace ds::quant {
namespace {

std::tuple<at::Tensor, at::Tensor> quantize_blockwise_cpu(const at::Tensor& x, int64_t block_size, int64_t bits) {
  const char* op = "quantize_blockwise";
  check_format(op, block_size, bits);
  TORCH_CHECK(x.device().is_cpu(), op, ": x is on ", x.device(), "; the CPU kernel needs a CPU tensor");
  const Rows shape = rows_of(x, op, "x");
  const DType dtype = kernel_dtype(x, op, ": x");
  const int b = static_cast<int>(bits);
  auto [q, scales] = empty_quantized(x, shape, block_size, b);
  if (x.numel() > 0) {
    quantize_rows(x.data_ptr(), dtype, shape.rows, shape.n, block_size, b, q.data_ptr<int8_t>(),
                  scales.data_ptr<float>(), at::get_num_threads());
  }
  return {q, scales};
}

void dequantize_blockwise_cpu(const at::Tensor& q, const at::Tensor& scales, int64_t block_size, int64_t bits,
                              const at::Tensor& out) {
  const char* op = "dequantize_blockwise_";
  check_format(op, block_size, bits);
  TORCH_CHECK(out.device().is_cpu() && q.device().is_cpu() && scales.device().is_cpu(), op,
              ": q, scales and out must be CPU tensors for the CPU kernel");
  const Rows shape = rows_of(out, op, "out");
  const DType dtype = kernel_dtype(out, op, ": out");
  check_quantized(op, q, scales, shape.rows, shape.n, block_size, bits);
  if (out.numel() == 0) return;
  dequantize_rows(q.data_ptr<int8_t>(), scales.data_ptr<float>(), shape.rows, shape.n, block_size,
                  static_cast<int>(bits), out.data_ptr(), dtype, at::get_num_threads());
}

void dequantize_sum_cpu(const at::Tensor& q, const at::Tensor& scales, int64_t block_size, int64_t bits,
                        const at::Tensor& out) {
  const char* op = "dequantize_sum_";
  check_format(op, block_size, bits);
  TORCH_CHECK(out.device().is_cpu() && q.device().is_cpu() && scales.device().is_cpu(), op,
              ": q, scales and out must be CPU tensors for the CPU kernel");
  TORCH_CHECK(out.dim() == 1 && out.is_contiguous(), op, ": out must be a contiguous 1-D tensor");
  TORCH_CHECK(out.scalar_type() == at::kFloat, op, ": out has dtype ", out.scalar_type(),
              "; the sum accumulates in float32");
  TORCH_CHECK(q.dim() == 2, op, ": q has ", q.dim(), " dimensions; expected 2 (one row per summand)");
  const int64_t rows = q.size(0);
  check_quantized(op, q, scales, rows, out.size(0), block_size, bits);
  if (out.numel() == 0) return;
  dequantize_sum_rows(q.data_ptr<int8_t>(), scales.data_ptr<float>(), rows, out.size(0), block_size,
                      static_cast<int>(bits), out.data_ptr<float>(), at::get_num_threads());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ds_strategy, m) {
  m.def("quantize_blockwise(Tensor x, int block_size, int bits) -> (Tensor q, Tensor scales)");
  m.def("dequantize_blockwise_(Tensor q, Tensor scales, int block_size, int bits, Tensor(a!) out) -> ()");
  m.def("dequantize_sum_(Tensor q, Tensor scales, int block_size, int bits, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(ds_strategy, CPU, m) {
  m.impl("quantize_blockwise", &quantize_blockwise_cpu);
  m.impl("dequantize_blockwise_", &dequantize_blockwise_cpu);
  m.impl("dequantize_sum_", &dequantize_sum_cpu);
}

}  // namespace ds::quant
