// quant_math.h: per-element math of block-wise symmetric quantization (ZeRO++'s int8 weight gathers and
// int4/int8 gradient all-to-alls), shared by the CPU kernel (csrc/quant/quantize.cpp) and its CUDA twin
// (csrc/quant/quantize.cu), and mirrored by the pure-torch reference in ds_strategy/ops/fallback.py.
//
// A block of `block_size` consecutive elements of one row shares one fp32 scale = absmax / qmax, with
// qmax = 127 (int8) or 7 (int4); q = rint(x * (qmax / absmax)) clamped to [-qmax, qmax] (round half to
// even, as torch.round); x' = q * scale. So |x - x'| <= scale / 2 (plus fp32 rounding of the product).
// An all-zero block has scale 0 and q 0. A block holding inf or NaN gets a NaN scale, so every element
// of it dequantizes to NaN: overflow stays visible to the loss scaler after a quantized reduction.
// int4 values are packed two per byte: element 2j in the low nibble, 2j+1 in the high one (two's
// complement nibbles); an odd row length leaves the last high nibble 0.
#pragma once

#include <cmath>
#include <cstdint>

#include "host_device.h"

namespace ds::quant {

DS_HOST_DEVICE int qmax_of(int bits) { return bits == 4 ? 7 : 127; }

DS_HOST_DEVICE float abs_max(float acc, float x) {
  const float a = fabsf(x);
  return (a > acc || a != a) ? a : acc;  // NaN wins, so a NaN element poisons its block
}

// The scale stored with a block: absmax / qmax; NaN when the block holds inf or NaN.
DS_HOST_DEVICE float block_scale(float absmax, int qmax) {
  if (!(absmax - absmax == 0.0f)) return NAN;  // inf or NaN
  return absmax / static_cast<float>(qmax);
}

// The factor a block's elements are multiplied by before rounding: qmax / absmax (0 for an all-zero or
// non-finite block, whose q are all 0).
DS_HOST_DEVICE float block_inv_scale(float absmax, int qmax) {
  if (!(absmax - absmax == 0.0f) || absmax == 0.0f) return 0.0f;
  return static_cast<float>(qmax) / absmax;
}

DS_HOST_DEVICE int quantize_one(float x, float inv_scale, int qmax) {
  float q = rintf(x * inv_scale);
  q = q > static_cast<float>(qmax) ? static_cast<float>(qmax) : q;
  q = q < -static_cast<float>(qmax) ? -static_cast<float>(qmax) : q;
  return static_cast<int>(q);
}

DS_HOST_DEVICE float dequantize_one(int q, float scale) { return static_cast<float>(q) * scale; }

DS_HOST_DEVICE uint8_t pack_int4(int lo, int hi) {
  return static_cast<uint8_t>((lo & 0xF) | ((hi & 0xF) << 4));
}

DS_HOST_DEVICE int unpack_int4(uint8_t byte, int high) {
  const int nib = high ? (byte >> 4) & 0xF : byte & 0xF;
  return nib >= 8 ? nib - 16 : nib;
}

// Bytes one row of n elements takes.
DS_HOST_DEVICE int64_t packed_numel(int64_t n, int bits) { return bits == 4 ? (n + 1) / 2 : n; }

DS_HOST_DEVICE int64_t num_blocks(int64_t n, int64_t block_size) { return (n + block_size - 1) / block_size; }

}  // namespace ds::quant
