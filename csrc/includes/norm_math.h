// norm_math.h: per-element math of the fused "global L2 norm + inf/nan check", shared by the CPU kernel
// (csrc/norm/multi_tensor_norm.cpp) and its CUDA twin (csrc/norm/multi_tensor_norm.cu).
#pragma once

#include <cmath>

#include "host_device.h"

namespace ds::norm {

// Sum of squares accumulates in fp32 lanes inside a chunk and in double across chunks.
DS_HOST_DEVICE float accumulate_square(float acc, float x) { return fmaf(x, x, acc); }

// The rare path: an fp32 sum that is not finite while every element is comes from squares beyond fp32's
// range (|x| > ~1.8e19); such a sum is redone in double, which holds any fp32 value squared.
DS_HOST_DEVICE double accumulate_square_exact(double acc, float x) {
  return acc + static_cast<double>(x) * static_cast<double>(x);
}

// inf and NaN are exactly the values for which x - x is not 0.
DS_HOST_DEVICE bool is_nonfinite(float x) { return (x - x) != 0.0f; }

}  // namespace ds::norm
