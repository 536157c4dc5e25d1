// dtypes.h: the 16-bit float formats our kernels read and write, as plain bit containers.
//
// Conversions round to nearest even and keep NaN a NaN (a truncating bf16 conversion would turn a tiny
// NaN payload into inf); they are the scalar reference the SIMD paths in simd.h must match bit for bit.
#pragma once

#include <cstdint>
#include <cstring>

#include "host_device.h"

namespace ds {

struct bf16 {
  uint16_t bits;
};
struct fp16 {
  uint16_t bits;
};

// Which element type a raw buffer holds; the numbering is shared with the Python side of the op wrappers.
enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

DS_HOST_DEVICE uint32_t float_bits(float x) {
  uint32_t u;
#if defined(__CUDA_ARCH__)
  u = __float_as_uint(x);
#else
  std::memcpy(&u, &x, sizeof(u));
#endif
  return u;
}

DS_HOST_DEVICE float bits_float(uint32_t u) {
  float x;
#if defined(__CUDA_ARCH__)
  x = __uint_as_float(u);
#else
  std::memcpy(&x, &u, sizeof(x));
#endif
  return x;
}

DS_HOST_DEVICE float to_float(float x) { return x; }
DS_HOST_DEVICE float to_float(bf16 x) { return bits_float(static_cast<uint32_t>(x.bits) << 16); }

DS_HOST_DEVICE float to_float(fp16 h) {
  // IEEE binary16 -> binary32, exact (every half is representable as a float).
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  uint32_t exp = (h.bits >> 10) & 0x1Fu;
  uint32_t mant = h.bits & 0x3FFu;
  if (exp == 0x1Fu) return bits_float(sign | 0x7F800000u | (mant << 13));  // inf / nan
  if (exp == 0) {
    if (mant == 0) return bits_float(sign);
    // Subnormal half: normalise it.
    exp = 127 - 15 + 1;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }
    mant &= 0x3FFu;
    return bits_float(sign | (exp << 23) | (mant << 13));
  }
  return bits_float(sign | ((exp + 127 - 15) << 23) | (mant << 13));
}

DS_HOST_DEVICE bf16 to_bf16(float x) {
  const uint32_t u = float_bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x0040u)};  // quiet NaN
  const uint32_t rounding = 0x7FFFu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return bf16{static_cast<uint16_t>((u + rounding) >> 16)};
}

DS_HOST_DEVICE fp16 to_fp16(float x) {
  // IEEE binary32 -> binary16, round to nearest even, overflow to inf, NaN kept quiet.
  const uint32_t u = float_bits(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return fp16{static_cast<uint16_t>(sign | 0x7E00u | ((abs >> 13) & 0x3FFu))};
  if (abs >= 0x477FF000u) return fp16{static_cast<uint16_t>(sign | 0x7C00u)};  // rounds past 65504
  if (abs < 0x38800000u) {
    // Result is subnormal (or zero) in half: shift the implicit-one mantissa into place, then round.
    if (abs < 0x33000000u) return fp16{sign};  // below half of the smallest subnormal
    const uint32_t exp = abs >> 23;
    const uint32_t mant = (abs & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126 - exp;  // 14 + (113 - exp) - 1 ... places the value in units of 2^-24
    const uint32_t q = mant >> (shift - 0);
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1);
    uint32_t r = q;
    if (rem > half || (rem == half && (q & 1u))) ++r;
    return fp16{static_cast<uint16_t>(sign | r)};
  }
  // Normal: rebias the exponent, round the 13 dropped mantissa bits to nearest even.
  const uint32_t rebiased = abs - (112u << 23);
  const uint32_t rounding = 0xFFFu + ((rebiased >> 13) & 1u);
  return fp16{static_cast<uint16_t>(sign | ((rebiased + rounding) >> 13))};
}

}  // namespace ds
