// quant_ops_cuda.cpp: CUDA implementations of the quantization ops (schemas defined in quant_ops.cpp, which
// the CPU library registers first; the same checks, quant_checks.h).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "../includes/dispatch.h"
#include "quant_checks.h"
#include "quantize_cuda.h"

namespace ds::quant {
namespace {

cudaStream_t stream_of(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

std::tuple<at::Tensor, at::Tensor> quantize_blockwise_cuda(const at::Tensor& x, int64_t block_size, int64_t bits) {
  const char* op = "quantize_blockwise";
  check_format(op, block_size, bits);
  const Rows shape = rows_of(x, op, "x");
  const DType dtype = kernel_dtype(x, op, ": x");
  const c10::cuda::CUDAGuard guard(x.device());
  const int b = static_cast<int>(bits);
  auto [q, scales] = empty_quantized(x, shape, block_size, b);
  if (x.numel() > 0) {
    launch_quantize(x.data_ptr(), dtype, shape.rows, shape.n, block_size, b, q.data_ptr<int8_t>(),
                    scales.data_ptr<float>(), stream_of(x));
  }
  return {q, scales};
}

void dequantize_blockwise_cuda(const at::Tensor& q, const at::Tensor& scales, int64_t block_size, int64_t bits,
                               const at::Tensor& out) {
  const char* op = "dequantize_blockwise_";
  check_format(op, block_size, bits);
  TORCH_CHECK(q.device() == out.device() && scales.device() == out.device(), op,
              ": q, scales and out must be on one device");
  const Rows shape = rows_of(out, op, "out");
  const DType dtype = kernel_dtype(out, op, ": out");
  check_quantized(op, q, scales, shape.rows, shape.n, block_size, bits);
  if (out.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  launch_dequantize(q.data_ptr<int8_t>(), scales.data_ptr<float>(), shape.rows, shape.n, block_size,
                    static_cast<int>(bits), out.data_ptr(), dtype, stream_of(out));
}

void dequantize_sum_cuda(const at::Tensor& q, const at::Tensor& scales, int64_t block_size, int64_t bits,
                         const at::Tensor& out) {
  const char* op = "dequantize_sum_";
  check_format(op, block_size, bits);
  TORCH_CHECK(q.device() == out.device() && scales.device() == out.device(), op,
              ": q, scales and out must be on one device");
  TORCH_CHECK(out.dim() == 1 && out.is_contiguous(), op, ": out must be a contiguous 1-D tensor");
  TORCH_CHECK(out.scalar_type() == at::kFloat, op, ": out has dtype ", out.scalar_type(),
              "; the sum accumulates in float32");
  TORCH_CHECK(q.dim() == 2, op, ": q has ", q.dim(), " dimensions; expected 2 (one row per summand)");
  check_quantized(op, q, scales, q.size(0), out.size(0), block_size, bits);
  if (out.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  launch_dequantize_sum(q.data_ptr<int8_t>(), scales.data_ptr<float>(), q.size(0), out.size(0), block_size,
                        static_cast<int>(bits), out.data_ptr<float>(), stream_of(out));
}

}  // namespace

TORCH_LIBRARY_IMPL(ds_strategy, CUDA, m) {
  m.impl("quantize_blockwise", &quantize_blockwise_cuda);
  m.impl("dequantize_blockwise_", &dequantize_blockwise_cuda);
  m.impl("dequantize_sum_", &dequantize_sum_cuda);
}

}  // namespace ds::quant
