// slot_reduce.h: the per-element math of the shared-memory collectives: out = sum of `count` inputs.
//
// Inputs are summed in the order given (rank 0 first) in fp32 whatever the storage type, optionally divided
// by the divisor (avg), and rounded to the storage type once. Every rank passes the same inputs in the same
// order, so every rank gets bitwise the same result; the tests' reference is exactly
// `sum(x_r.float() for r in ranks) [/ W] -> dtype`.
#pragma once

#include <cstdint>

#include "dtypes.h"
#include "simd.h"

namespace ds::reduce {

inline void put(float* p, float v) { *p = v; }
inline void put(bf16* p, float v) { *p = to_bf16(v); }
inline void put(fp16* p, float v) { *p = to_fp16(v); }

// out[i] (and out2[i] when out2 is not null) = (in[0][i] + ... + in[count-1][i]) [/ divisor], i in [0, n).
// An input may alias out or out2 at the same index (in-place all-reduce): each element is loaded before
// it is stored.
template <typename T>
inline void sum_inputs(const T* const* in, int count, T* out, T* out2, int64_t n, bool divide, float divisor) {
  using namespace ds::simd;
  const VecF vdiv = set1(divisor);
  int64_t i = 0;
  // Two vectors per step: enough independent adds to keep the loads in flight (the loop is memory bound).
  for (; i + 2 * kWidth <= n; i += 2 * kWidth) {
    VecF a = load(in[0] + i);
    VecF b = load(in[0] + i + kWidth);
    for (int k = 1; k < count; ++k) {
      a = add(a, load(in[k] + i));
      b = add(b, load(in[k] + i + kWidth));
    }
    if (divide) {
      a = ds::simd::div(a, vdiv);
      b = ds::simd::div(b, vdiv);
    }
    store(out + i, a);
    store(out + i + kWidth, b);
    if (out2 != nullptr) {
      store(out2 + i, a);
      store(out2 + i + kWidth, b);
    }
  }
  for (; i < n; ++i) {
    float a = to_float(in[0][i]);
    for (int k = 1; k < count; ++k) a += to_float(in[k][i]);
    if (divide) a /= divisor;
    put(out + i, a);
    if (out2 != nullptr) put(out2 + i, a);
  }
}

}  // namespace ds::reduce
