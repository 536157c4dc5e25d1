// optim_math.h: per-element math of the Adam / AdamW, Adagrad and Lion steps, shared by the CPU kernel
// (csrc/optim/cpu_optim.cpp, where V is a SIMD vector or a float for the tails) and the CUDA kernel
// (csrc/optim/fused_adam.cu, where V is a float).
//
// Every operation is spelled out (add, mul, div, sqrt, fma) exactly as torch's CPU kernels evaluate
// torch.optim's single-tensor/foreach formulas (measured on torch 2.13: `add(alpha=)`, `addcmul_` and
// `lerp_` are one fused multiply-add, `addcdiv_` is `self + (value * t1) / t2`), and the translation
// units that include this header switch off floating-point contraction. So a SIMD lane, a scalar tail
// and a CUDA thread compute bit-identical results, equal to torch.optim's on CPU.
//
// Scalars (learning rate, bias corrections, ...) are computed once per step in double on the host, as
// torch.optim does in Python, and rounded to float: see AdamScalars::make.
#pragma once

#include <cmath>
#include <cstdint>

#include "host_device.h"

namespace ds::optim {

// Scalar versions of the vector operations in simd.h. On CUDA the _rn intrinsics are never contracted
// into an FMA by nvcc, which is what keeps the device results equal to the host's.
DS_HOST_DEVICE float add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
DS_HOST_DEVICE float sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
DS_HOST_DEVICE float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
DS_HOST_DEVICE float div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
DS_HOST_DEVICE float sqrt(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}
DS_HOST_DEVICE float fma(float a, float b, float c) { return fmaf(a, b, c); }
DS_HOST_DEVICE float sign(float a) { return a > 0.0f ? 1.0f : (a < 0.0f ? -1.0f : 0.0f); }
// inf and NaN are exactly the values for which x - x is not 0.
DS_HOST_DEVICE bool is_nonfinite(float x) { return (x - x) != 0.0f; }

// ---------------------------------------------------------------------------------------------------
// Gradient preprocessing of the fused offload pass: g * (1 / loss_scale), then * clip_coef: two
// multiplies, exactly what unscaling followed by clipping does as separate ops.
struct GradScalars {
  float inv_scale;  // 1 / loss_scale
  float clip_coef;  // min(1, max_norm / (norm + 1e-6)), or 1
  bool identity;    // both are 1: skip the multiplies
};

template <typename V>
DS_HOST_DEVICE V prepare_grad(V g, V inv_scale, V clip_coef) {
  return mul(mul(g, inv_scale), clip_coef);
}

// ---------------------------------------------------------------------------------------------------
// Adam / AdamW (torch.optim.Adam with weight_decay = L2, torch.optim.AdamW = decoupled).
struct AdamScalars {
  float beta1, beta2;
  float one_minus_beta1, one_minus_beta2;
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^step)
  float bc2_sqrt;       // sqrt(1 - beta2^step)
  float weight_decay;   // L2 mode: added to the gradient as wd * p
  float decay;          // AdamW mode: p *= 1 - lr * wd
  bool adamw_mode;
  bool has_weight_decay;

  static AdamScalars make(double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step,
                          bool adamw_mode, bool bias_correction) {
    const double bc1 = bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(step)) : 1.0;
    const double bc2 = bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(step)) : 1.0;
    AdamScalars s{};
    s.beta1 = static_cast<float>(beta1);
    s.beta2 = static_cast<float>(beta2);
    s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
    s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
    s.eps = static_cast<float>(eps);
    s.neg_step_size = static_cast<float>(-(lr / bc1));
    s.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
    s.weight_decay = static_cast<float>(weight_decay);
    s.decay = static_cast<float>(1.0 - lr * weight_decay);
    s.adamw_mode = adamw_mode;
    s.has_weight_decay = weight_decay != 0.0;
    return s;
  }
};

// The same scalars broadcast into V once per chunk.
template <typename V>
struct AdamConsts {
  V beta2, one_minus_beta1, one_minus_beta2, eps, neg_step_size, bc2_sqrt, weight_decay, decay;
};

// One element (or one vector of elements) of the step; p, m and v are updated in place.
//   L2:     g += wd * p                         AdamW: p *= 1 - lr * wd
//   m = lerp(m, g, 1 - beta1)                   v = v * beta2 + (1 - beta2) * g * g
//   p += (-step_size * m) / (sqrt(v) / sqrt(bc2) + eps)
template <typename V>
DS_HOST_DEVICE void adam_update(V& p, V g, V& m, V& v, const AdamConsts<V>& c, bool l2, bool decoupled) {
  if (l2) g = fma(p, c.weight_decay, g);       // grad.add(param, alpha=wd)
  if (decoupled) p = mul(p, c.decay);          // param.mul_(1 - lr * wd)
  m = fma(c.one_minus_beta1, sub(g, m), m);    // exp_avg.lerp_(grad, 1 - beta1)
  v = fma(mul(c.one_minus_beta2, g), g, mul(v, c.beta2));  // exp_avg_sq.mul_(beta2).addcmul_(g, g, 1 - beta2)
  const V denom = add(div(sqrt(v), c.bc2_sqrt), c.eps);
  p = add(p, div(mul(c.neg_step_size, m), denom));  // param.addcdiv_(exp_avg, denom, value=-step_size)
}

// ---------------------------------------------------------------------------------------------------
// Adagrad (torch.optim.Adagrad, L2 weight decay):
//   g += wd * p;  sum += g * g;  p += -clr * g / (sqrt(sum) + eps),  clr = lr / (1 + (step - 1) * lr_decay)
struct AdagradScalars {
  float neg_clr, eps, weight_decay;
  bool has_weight_decay;

  static AdagradScalars make(double lr, double lr_decay, double eps, double weight_decay, int64_t step) {
    AdagradScalars s{};
    s.neg_clr = static_cast<float>(-(lr / (1.0 + static_cast<double>(step - 1) * lr_decay)));
    s.eps = static_cast<float>(eps);
    s.weight_decay = static_cast<float>(weight_decay);
    s.has_weight_decay = weight_decay != 0.0;
    return s;
  }
};

template <typename V>
struct AdagradConsts {
  V neg_clr, eps, weight_decay;
};

template <typename V>
DS_HOST_DEVICE void adagrad_update(V& p, V g, V& sum, const AdagradConsts<V>& c, bool l2) {
  if (l2) g = fma(p, c.weight_decay, g);  // grad.add(param, alpha=wd)
  sum = fma(g, g, sum);                    // state_sum.addcmul_(grad, grad, value=1)
  const V denom = add(sqrt(sum), c.eps);
  p = add(p, div(mul(c.neg_clr, g), denom));  // param.addcdiv_(grad, std, value=-clr)
}

// ---------------------------------------------------------------------------------------------------
// Lion (Chen et al. 2023), decoupled weight decay:
//   p *= 1 - lr * wd;  p += -lr * sign(beta1 * m + (1 - beta1) * g);  m = beta2 * m + (1 - beta2) * g
struct LionScalars {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, neg_lr, decay;
  bool has_weight_decay;

  static LionScalars make(double lr, double beta1, double beta2, double weight_decay) {
    LionScalars s{};
    s.beta1 = static_cast<float>(beta1);
    s.beta2 = static_cast<float>(beta2);
    s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
    s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
    s.neg_lr = static_cast<float>(-lr);
    s.decay = static_cast<float>(1.0 - lr * weight_decay);
    s.has_weight_decay = weight_decay != 0.0;
    return s;
  }
};

template <typename V>
struct LionConsts {
  V beta1, beta2, one_minus_beta1, one_minus_beta2, neg_lr, decay;
};

template <typename V>
DS_HOST_DEVICE void lion_update(V& p, V g, V& m, const LionConsts<V>& c, bool decay) {
  if (decay) p = mul(p, c.decay);
  const V u = sign(fma(g, c.one_minus_beta1, mul(m, c.beta1)));
  p = fma(u, c.neg_lr, p);  // u is -1, 0 or 1: exact product, one rounding
  m = fma(g, c.one_minus_beta2, mul(m, c.beta2));
}

}  // namespace ds::optim
