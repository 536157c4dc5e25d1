// simd.h: one typed vector of floats for every ISA we compile (AVX-512, AVX2, NEON, scalar).
//
// The build picks exactly one of DS_SIMD_AVX512 / DS_SIMD_AVX2 / DS_SIMD_NEON / DS_SIMD_SCALAR (see
// ds_strategy/ops/builder.py); the name of the one compiled is reported by kIsaName so the cache key and
// `python -m ds_strategy.report` can say what a binary really contains. Kernels are written once against
// VecF; loads and stores convert from/to bf16 and fp16 with the same rounding as the scalar reference
// in dtypes.h (round to nearest even, NaN kept). Tails shorter than kWidth use the scalar functions.
#pragma once

#include <cmath>
#include <cstdint>

#include "dtypes.h"

#if defined(DS_SIMD_AVX512) || defined(DS_SIMD_AVX2)
#include <immintrin.h>
#elif defined(DS_SIMD_NEON)
#include <arm_neon.h>
#elif !defined(DS_SIMD_SCALAR)
#define DS_SIMD_SCALAR
#endif

namespace ds::simd {

#if defined(DS_SIMD_AVX512)
inline constexpr const char* kIsaName = "avx512";
inline constexpr int kWidth = 16;
struct VecF {
  __m512 v;
};
inline VecF set1(float x) { return {_mm512_set1_ps(x)}; }
inline VecF load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline VecF load(const bf16* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
}
inline VecF load(const fp16* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
inline void store(float* p, VecF a) { _mm512_storeu_ps(p, a.v); }
inline __m256i pack_bf16(VecF a) {
  const __m512i u = _mm512_castps_si512(a.v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
  return _mm512_cvtepi32_epi16(r);
}
inline __m256i pack_fp16(VecF a) { return _mm512_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT); }
inline void store(bf16* p, VecF a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), pack_bf16(a)); }
inline void store(fp16* p, VecF a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), pack_fp16(a)); }
// Non-temporal stores of a write-only 16-bit output (no read-for-ownership of the line); p must be
// aligned to kStreamAlign bytes, and stream_fence() must run before another thread reads the data.
inline constexpr int kStreamAlign = 32;
inline void store_stream(bf16* p, VecF a) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), pack_bf16(a)); }
inline void store_stream(fp16* p, VecF a) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), pack_fp16(a)); }
inline void stream_fence() { _mm_sfence(); }
inline VecF add(VecF a, VecF b) { return {_mm512_add_ps(a.v, b.v)}; }
inline VecF sub(VecF a, VecF b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline VecF mul(VecF a, VecF b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline VecF div(VecF a, VecF b) { return {_mm512_div_ps(a.v, b.v)}; }
inline VecF fma(VecF a, VecF b, VecF c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline VecF sqrt(VecF a) { return {_mm512_sqrt_ps(a.v)}; }
inline VecF max(VecF a, VecF b) { return {_mm512_max_ps(a.v, b.v)}; }
// -1, 0 or +1 (0 for zero and NaN), as Lion's sign() of the interpolated update.
inline VecF sign(VecF a) {
  const __m512 zero = _mm512_setzero_ps();
  const __mmask16 pos = _mm512_cmp_ps_mask(a.v, zero, _CMP_GT_OQ);
  const __mmask16 neg = _mm512_cmp_ps_mask(a.v, zero, _CMP_LT_OQ);
  __m512 r = _mm512_mask_mov_ps(zero, pos, _mm512_set1_ps(1.0f));
  return {_mm512_mask_mov_ps(r, neg, _mm512_set1_ps(-1.0f))};
}
inline float reduce_add(VecF a) { return _mm512_reduce_add_ps(a.v); }
// True when any lane is inf or NaN (x - x is NaN exactly for those).
inline bool any_nonfinite(VecF a) {
  const __m512 d = _mm512_sub_ps(a.v, a.v);
  return _mm512_cmp_ps_mask(d, d, _CMP_UNORD_Q) != 0;
}

#elif defined(DS_SIMD_AVX2)
inline constexpr const char* kIsaName = "avx2";
inline constexpr int kWidth = 8;
struct VecF {
  __m256 v;
};
inline VecF set1(float x) { return {_mm256_set1_ps(x)}; }
inline VecF load(const float* p) { return {_mm256_loadu_ps(p)}; }
inline VecF load(const bf16* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16))};
}
inline VecF load(const fp16* p) { return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
inline void store(float* p, VecF a) { _mm256_storeu_ps(p, a.v); }
inline __m128i pack_bf16(VecF a) {
  const __m256i u = _mm256_castps_si256(a.v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q));
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  r = _mm256_blendv_epi8(r, quiet, nan);
  // Pack 8 x u32 (all < 2^16) into 8 x u16: packus works per 128-bit lane, so fix the lane order after.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
  return _mm256_castsi256_si128(packed);
}
inline __m128i pack_fp16(VecF a) { return _mm256_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT); }
inline void store(bf16* p, VecF a) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), pack_bf16(a)); }
inline void store(fp16* p, VecF a) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), pack_fp16(a)); }
inline constexpr int kStreamAlign = 16;
inline void store_stream(bf16* p, VecF a) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), pack_bf16(a)); }
inline void store_stream(fp16* p, VecF a) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), pack_fp16(a)); }
inline void stream_fence() { _mm_sfence(); }
inline VecF add(VecF a, VecF b) { return {_mm256_add_ps(a.v, b.v)}; }
inline VecF sub(VecF a, VecF b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline VecF mul(VecF a, VecF b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline VecF div(VecF a, VecF b) { return {_mm256_div_ps(a.v, b.v)}; }
inline VecF fma(VecF a, VecF b, VecF c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline VecF sqrt(VecF a) { return {_mm256_sqrt_ps(a.v)}; }
inline VecF max(VecF a, VecF b) { return {_mm256_max_ps(a.v, b.v)}; }
inline VecF sign(VecF a) {
  const __m256 zero = _mm256_setzero_ps();
  const __m256 pos = _mm256_and_ps(_mm256_cmp_ps(a.v, zero, _CMP_GT_OQ), _mm256_set1_ps(1.0f));
  const __m256 neg = _mm256_and_ps(_mm256_cmp_ps(a.v, zero, _CMP_LT_OQ), _mm256_set1_ps(1.0f));
  return {_mm256_sub_ps(pos, neg)};
}
inline float reduce_add(VecF a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline bool any_nonfinite(VecF a) {
  const __m256 d = _mm256_sub_ps(a.v, a.v);
  return _mm256_movemask_ps(_mm256_cmp_ps(d, d, _CMP_UNORD_Q)) != 0;
}

#elif defined(DS_SIMD_NEON)
inline constexpr const char* kIsaName = "neon";
inline constexpr int kWidth = 4;
struct VecF {
  float32x4_t v;
};
inline VecF set1(float x) { return {vdupq_n_f32(x)}; }
inline VecF load(const float* p) { return {vld1q_f32(p)}; }
inline VecF load(const bf16* p) {
  const uint16x4_t h = vld1_u16(reinterpret_cast<const uint16_t*>(p));
  return {vreinterpretq_f32_u32(vshll_n_u16(h, 16))};
}
inline VecF load(const fp16* p) {
  return {vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p))))};
}
inline void store(float* p, VecF a) { vst1q_f32(p, a.v); }
inline void store(bf16* p, VecF a) {
  float lanes[4];
  vst1q_f32(lanes, a.v);
  for (int i = 0; i < 4; ++i) p[i] = to_bf16(lanes[i]);
}
inline void store(fp16* p, VecF a) {
  vst1_u16(reinterpret_cast<uint16_t*>(p), vreinterpret_u16_f16(vcvt_f16_f32(a.v)));
}
inline constexpr int kStreamAlign = 1;  // no streaming stores here: plain stores
inline void store_stream(bf16* p, VecF a) { store(p, a); }
inline void store_stream(fp16* p, VecF a) { store(p, a); }
inline void stream_fence() {}
inline VecF add(VecF a, VecF b) { return {vaddq_f32(a.v, b.v)}; }
inline VecF sub(VecF a, VecF b) { return {vsubq_f32(a.v, b.v)}; }
inline VecF mul(VecF a, VecF b) { return {vmulq_f32(a.v, b.v)}; }
inline VecF div(VecF a, VecF b) { return {vdivq_f32(a.v, b.v)}; }
inline VecF fma(VecF a, VecF b, VecF c) { return {vfmaq_f32(c.v, a.v, b.v)}; }
inline VecF sqrt(VecF a) { return {vsqrtq_f32(a.v)}; }
inline VecF max(VecF a, VecF b) { return {vmaxq_f32(a.v, b.v)}; }
inline VecF sign(VecF a) {
  const float32x4_t zero = vdupq_n_f32(0.0f);
  const float32x4_t one = vdupq_n_f32(1.0f);
  const float32x4_t pos = vreinterpretq_f32_u32(vandq_u32(vcgtq_f32(a.v, zero), vreinterpretq_u32_f32(one)));
  const float32x4_t neg = vreinterpretq_f32_u32(vandq_u32(vcltq_f32(a.v, zero), vreinterpretq_u32_f32(one)));
  return {vsubq_f32(pos, neg)};
}
inline float reduce_add(VecF a) { return vaddvq_f32(a.v); }
inline bool any_nonfinite(VecF a) {
  const float32x4_t d = vsubq_f32(a.v, a.v);
  return vminvq_u32(vceqq_f32(d, d)) == 0;
}

#else  // DS_SIMD_SCALAR
inline constexpr const char* kIsaName = "scalar";
inline constexpr int kWidth = 1;
struct VecF {
  float v;
};
inline VecF set1(float x) { return {x}; }
inline VecF load(const float* p) { return {*p}; }
inline VecF load(const bf16* p) { return {to_float(*p)}; }
inline VecF load(const fp16* p) { return {to_float(*p)}; }
inline void store(float* p, VecF a) { *p = a.v; }
inline void store(bf16* p, VecF a) { *p = to_bf16(a.v); }
inline void store(fp16* p, VecF a) { *p = to_fp16(a.v); }
inline constexpr int kStreamAlign = 1;
inline void store_stream(bf16* p, VecF a) { store(p, a); }
inline void store_stream(fp16* p, VecF a) { store(p, a); }
inline void stream_fence() {}
inline VecF add(VecF a, VecF b) { return {a.v + b.v}; }
inline VecF sub(VecF a, VecF b) { return {a.v - b.v}; }
inline VecF mul(VecF a, VecF b) { return {a.v * b.v}; }
inline VecF div(VecF a, VecF b) { return {a.v / b.v}; }
inline VecF fma(VecF a, VecF b, VecF c) { return {std::fma(a.v, b.v, c.v)}; }
inline VecF sqrt(VecF a) { return {std::sqrt(a.v)}; }
inline VecF max(VecF a, VecF b) { return {a.v > b.v ? a.v : b.v}; }
inline VecF sign(VecF a) { return {a.v > 0.0f ? 1.0f : (a.v < 0.0f ? -1.0f : 0.0f)}; }
inline float reduce_add(VecF a) { return a.v; }
inline bool any_nonfinite(VecF a) { return !std::isfinite(a.v); }
#endif

}  // namespace ds::simd
