// quantize.cpp: CPU kernels of block-wise symmetric int8/int4 quantization (OpenMP across blocks, SIMD
// inside a block for the absmax scan, the scaling and the dequantized stores). The per-element math is
// quant_math.h's, shared with the CUDA twin quantize.cu.
#include "quantize.h"

#include <omp.h>

#include <algorithm>

#include "../includes/quant_math.h"
#include "../includes/simd.h"

namespace ds::quant {
namespace {

inline void store_one(float* p, float v) { *p = v; }
inline void store_one(bf16* p, float v) { *p = to_bf16(v); }
inline void store_one(fp16* p, float v) { *p = to_fp16(v); }

template <typename T>
float block_absmax(const T* x, int64_t len) {
  using namespace ds::simd;
  const VecF zero = set1(0.0f);
  VecF acc = zero;
  bool nonfinite = false;
  int64_t i = 0;
  for (; i + kWidth <= len; i += kWidth) {
    const VecF a = load(x + i);
    nonfinite |= any_nonfinite(a);
    acc = max(acc, max(a, sub(zero, a)));
  }
  float lanes[kWidth];
  store(lanes, acc);
  float m = 0.0f;
  for (int l = 0; l < kWidth; ++l) m = abs_max(m, lanes[l]);
  for (; i < len; ++i) m = abs_max(m, to_float(x[i]));
  return nonfinite ? NAN : m;  // SIMD max drops NaN lanes: the flag keeps a poisoned block poisoned
}

template <typename T>
void quantize_block(const T* x, int64_t len, int bits, int8_t* q_row, int64_t first, float* scale) {
  using namespace ds::simd;
  const int qmax = qmax_of(bits);
  const float absmax = block_absmax(x, len);
  *scale = block_scale(absmax, qmax);
  const float inv = block_inv_scale(absmax, qmax);
  // Scale in SIMD, then round/clamp/narrow (quantize_one) lane by lane.
  float scaled[kWidth];
  const VecF vinv = set1(inv);
  int64_t i = 0;
  if (bits == 8) {
    for (; i + kWidth <= len; i += kWidth) {
      store(scaled, mul(load(x + i), vinv));
      for (int l = 0; l < kWidth; ++l) q_row[first + i + l] = static_cast<int8_t>(quantize_one(scaled[l], 1.0f, qmax));
    }
    for (; i < len; ++i) q_row[first + i] = static_cast<int8_t>(quantize_one(to_float(x[i]), inv, qmax));
    return;
  }
  // int4: blocks start at even offsets (the block size is even), so pairs never straddle blocks.
  uint8_t* packed = reinterpret_cast<uint8_t*>(q_row) + first / 2;
  for (; i + kWidth <= len; i += kWidth) {
    store(scaled, mul(load(x + i), vinv));
    for (int l = 0; l < kWidth; l += 2) {
      packed[(i + l) / 2] = pack_int4(quantize_one(scaled[l], 1.0f, qmax), quantize_one(scaled[l + 1], 1.0f, qmax));
    }
  }
  for (; i < len; i += 2) {
    const int lo = quantize_one(to_float(x[i]), inv, qmax);
    const int hi = i + 1 < len ? quantize_one(to_float(x[i + 1]), inv, qmax) : 0;
    packed[i / 2] = pack_int4(lo, hi);
  }
}

inline int load_q(const int8_t* q_row, int64_t i, int bits) {
  if (bits == 8) return q_row[i];
  return unpack_int4(reinterpret_cast<const uint8_t*>(q_row)[i / 2], static_cast<int>(i & 1));
}

template <typename T>
void dequantize_block(const int8_t* q_row, int64_t first, int64_t len, int bits, float scale, T* out) {
  using namespace ds::simd;
  float vals[kWidth];
  const VecF vscale = set1(scale);
  int64_t i = 0;
  for (; i + kWidth <= len; i += kWidth) {
    for (int l = 0; l < kWidth; ++l) vals[l] = static_cast<float>(load_q(q_row, first + i + l, bits));
    store(out + i, mul(load(vals), vscale));
  }
  for (; i < len; ++i) store_one(out + i, dequantize_one(load_q(q_row, first + i, bits), scale));
}

template <typename T>
void quantize_typed(const T* x, int64_t rows, int64_t n, int64_t block, int bits, int8_t* q, float* scales,
                    int threads) {
  const int64_t nb = num_blocks(n, block);
  const int64_t row_bytes = packed_numel(n, bits);
  const int64_t total = rows * nb;
#pragma omp parallel for num_threads(std::max<int64_t>(1, std::min<int64_t>(threads, total))) schedule(static)
  for (int64_t t = 0; t < total; ++t) {
    const int64_t r = t / nb, b = t % nb;
    const int64_t first = b * block;
    const int64_t len = std::min(block, n - first);
    quantize_block(x + r * n + first, len, bits, q + r * row_bytes, first, scales + t);
  }
}

template <typename T>
void dequantize_typed(const int8_t* q, const float* scales, int64_t rows, int64_t n, int64_t block, int bits, T* out,
                      int threads) {
  const int64_t nb = num_blocks(n, block);
  const int64_t row_bytes = packed_numel(n, bits);
  const int64_t total = rows * nb;
#pragma omp parallel for num_threads(std::max<int64_t>(1, std::min<int64_t>(threads, total))) schedule(static)
  for (int64_t t = 0; t < total; ++t) {
    const int64_t r = t / nb, b = t % nb;
    const int64_t first = b * block;
    dequantize_block(q + r * row_bytes, first, std::min(block, n - first), bits, scales[t], out + r * n + first);
  }
}

}  // namespace

void quantize_rows(const void* x, DType dtype, int64_t rows, int64_t n, int64_t block, int bits, int8_t* q,
                   float* scales, int num_threads) {
  switch (dtype) {
    case DType::kFloat32:
      return quantize_typed(static_cast<const float*>(x), rows, n, block, bits, q, scales, num_threads);
    case DType::kBFloat16:
      return quantize_typed(static_cast<const bf16*>(x), rows, n, block, bits, q, scales, num_threads);
    case DType::kFloat16:
      return quantize_typed(static_cast<const fp16*>(x), rows, n, block, bits, q, scales, num_threads);
  }
}

void dequantize_rows(const int8_t* q, const float* scales, int64_t rows, int64_t n, int64_t block, int bits, void* out,
                     DType dtype, int num_threads) {
  switch (dtype) {
    case DType::kFloat32:
      return dequantize_typed(q, scales, rows, n, block, bits, static_cast<float*>(out), num_threads);
    case DType::kBFloat16:
      return dequantize_typed(q, scales, rows, n, block, bits, static_cast<bf16*>(out), num_threads);
    case DType::kFloat16:
      return dequantize_typed(q, scales, rows, n, block, bits, static_cast<fp16*>(out), num_threads);
  }
}

void dequantize_sum_rows(const int8_t* q, const float* scales, int64_t rows, int64_t n, int64_t block, int bits,
                         float* out, int num_threads) {
  using namespace ds::simd;
  const int64_t nb = num_blocks(n, block);
  const int64_t row_bytes = packed_numel(n, bits);
#pragma omp parallel for num_threads(std::max<int64_t>(1, std::min<int64_t>(num_threads, nb))) schedule(static)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t first = b * block;
    const int64_t len = std::min(block, n - first);
    float* dst = out + first;
    std::fill(dst, dst + len, 0.0f);
    float vals[kWidth];
    for (int64_t r = 0; r < rows; ++r) {
      const int8_t* q_row = q + r * row_bytes;
      const float scale = scales[r * nb + b];
      const VecF vscale = set1(scale);
      int64_t i = 0;
      for (; i + kWidth <= len; i += kWidth) {
        for (int l = 0; l < kWidth; ++l) vals[l] = static_cast<float>(load_q(q_row, first + i + l, bits));
        store(dst + i, fma(load(vals), vscale, load(dst + i)));
      }
      for (; i < len; ++i) dst[i] = fmaf(static_cast<float>(load_q(q_row, first + i, bits)), scale, dst[i]);
    }
  }
}

}  // namespace ds::quant
