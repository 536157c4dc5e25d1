// multi_tensor_norm.cpp: CPU kernel of the fused global L2 norm + inf/nan check (OpenMP across chunks,
// SIMD inside a chunk). Gradient clipping and fp16 overflow detection both need exactly this, once per
// step over every gradient, so it is one read of memory instead of one torch op per tensor.
#include "multi_tensor_norm.h"

#include <omp.h>

#include <algorithm>
#include <vector>

#include "../includes/norm_math.h"
#include "../includes/simd.h"

namespace ds::norm {
namespace {

// 64K elements: big enough to amortise scheduling, small enough to balance 1M-element tails over cores.
constexpr int64_t kChunk = 1 << 16;

struct Chunk {
  int32_t buffer;
  int64_t begin;
  int64_t end;
};

template <typename T>
SumOfSquares chunk_sum_of_squares(const T* x, int64_t begin, int64_t end) {
  using namespace ds::simd;
  // Four independent accumulators hide the FMA latency.
  VecF acc0 = set1(0.0f), acc1 = set1(0.0f), acc2 = set1(0.0f), acc3 = set1(0.0f);
  int64_t i = begin;
  for (; i + 4 * kWidth <= end; i += 4 * kWidth) {
    acc0 = fma(load(x + i), load(x + i), acc0);
    const VecF b = load(x + i + kWidth);
    acc1 = fma(b, b, acc1);
    const VecF c = load(x + i + 2 * kWidth);
    acc2 = fma(c, c, acc2);
    const VecF d = load(x + i + 3 * kWidth);
    acc3 = fma(d, d, acc3);
  }
  for (; i + kWidth <= end; i += kWidth) {
    const VecF a = load(x + i);
    acc0 = fma(a, a, acc0);
  }
  float tail = 0.0f;
  for (; i < end; ++i) tail = accumulate_square(tail, to_float(x[i]));
  const float sum = reduce_add(add(add(acc0, acc1), add(acc2, acc3))) + tail;
  if (!is_nonfinite(sum)) return {static_cast<double>(sum), false};
  // Rare path: a non-finite sum is either a real inf/NaN element or fp32 overflow of huge squares;
  // tell them apart and redo the sum in double.
  SumOfSquares exact{0.0, false};
  for (int64_t j = begin; j < end; ++j) {
    const float v = to_float(x[j]);
    exact.nonfinite |= is_nonfinite(v);
    exact.sum_sq = accumulate_square_exact(exact.sum_sq, v);
  }
  return exact;
}

SumOfSquares dispatch_chunk(const ConstBuffer& b, int64_t begin, int64_t end) {
  switch (b.dtype) {
    case DType::kFloat32:
      return chunk_sum_of_squares(static_cast<const float*>(b.data), begin, end);
    case DType::kBFloat16:
      return chunk_sum_of_squares(static_cast<const bf16*>(b.data), begin, end);
    case DType::kFloat16:
      return chunk_sum_of_squares(static_cast<const fp16*>(b.data), begin, end);
  }
  return {0.0, false};
}

}  // namespace

SumOfSquares multi_tensor_sum_of_squares(const ConstBuffer* buffers, int64_t count, int num_threads) {
  std::vector<Chunk> chunks;
  for (int64_t t = 0; t < count; ++t) {
    for (int64_t begin = 0; begin < buffers[t].numel; begin += kChunk) {
      chunks.push_back({static_cast<int32_t>(t), begin, std::min(begin + kChunk, buffers[t].numel)});
    }
  }
  const int64_t n = static_cast<int64_t>(chunks.size());
  double total = 0.0;
  int nonfinite = 0;
  const int threads = std::max(1, static_cast<int>(std::min<int64_t>(num_threads, n)));
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : total) reduction(| : nonfinite)
  for (int64_t c = 0; c < n; ++c) {
    const SumOfSquares part = dispatch_chunk(buffers[chunks[c].buffer], chunks[c].begin, chunks[c].end);
    total += part.sum_sq;
    nonfinite |= part.nonfinite ? 1 : 0;
  }
  return {total, nonfinite != 0};
}

const char* compiled_isa() { return ds::simd::kIsaName; }

}  // namespace ds::norm
