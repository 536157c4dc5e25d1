// cpu_optim.h: plain-C++ interface of the CPU optimizer kernels (no torch headers: optim_ops.cpp is the
// only place that knows about tensors and checks them).
//
// A step walks a list of parameter buffers, each with its gradient, its one or two state buffers and an
// optional 16-bit copy-out buffer, split into fixed-size chunks spread over OpenMP threads. Every buffer
// is owned by the caller (the Python optimizer owns the state tensors); nothing is kept between calls.
#pragma once

#include <cstdint>

#include "../includes/dtypes.h"
#include "../includes/optim_math.h"

namespace ds::optim {

struct ParamBuffers {
  float* param;        // fp32, updated in place
  const void* grad;    // grad_dtype, read only
  float* state1;       // Adam/Lion: exp_avg; Adagrad: sum
  float* state2;       // Adam: exp_avg_sq; others: nullptr
  void* out16;         // nullptr, or numel elements of out_dtype receiving the updated param
  int64_t numel;
  DType grad_dtype;    // kFloat32, kBFloat16 or kFloat16
  DType out_dtype;     // kBFloat16 or kFloat16 when out16 is set
};

// Gradient preprocessing and the non-finite contract shared by every step below.
struct StepOptions {
  GradScalars grad;
  // true: scan every gradient first; if any element is inf/NaN return true and write nothing.
  // false: one pass; the return value still says whether an inf/NaN gradient was seen, but the
  // elements have been updated with it (the caller has checked already, e.g. with the norm kernel).
  bool skip_if_nonfinite;
  int num_threads;
};

// Each returns found_inf: whether some gradient element is inf or NaN (before unscaling).
bool adam_step(const ParamBuffers* buffers, int64_t count, const AdamScalars& s, const StepOptions& o);
bool adagrad_step(const ParamBuffers* buffers, int64_t count, const AdagradScalars& s, const StepOptions& o);
bool lion_step(const ParamBuffers* buffers, int64_t count, const LionScalars& s, const StepOptions& o);

// Benchmark-only: p += g, m += g, v += g over fp32 buffers with the same chunking and threads as
// adam_step. Exactly Adam's memory traffic (4 reads + 3 writes of 4 bytes per element) with no math:
// the practical bandwidth ceiling an Adam step can reach on this machine.
void traffic_ceiling(const ParamBuffers* buffers, int64_t count, int num_threads);

}  // namespace ds::optim
