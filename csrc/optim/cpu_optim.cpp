// cpu_optim.cpp: CPU kernels of the Adam / AdamW, Adagrad and Lion steps (OpenMP across fixed-size
// chunks, SIMD through simd.h inside a chunk, the per-element math from optim_math.h).
//
// One pass over memory does everything the ZeRO-offload optimizer phase needs after the gradient norm:
// unscale and clip the gradient, step, and write the new parameter as bf16/fp16 for the next forward.
//
// Floating-point contraction is switched off for this file (before any header, so the inline SIMD and
// math functions get it too): a multiply followed by an add stays two roundings, as in torch.optim, and a
// SIMD body and its scalar tail give bit-identical results.
#pragma GCC optimize("fp-contract=off")

#include "cpu_optim.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "../includes/simd.h"

namespace ds::optim {
namespace {

using simd::kWidth;
using simd::VecF;

// 64K elements (~1.8 MB of Adam traffic): big enough to amortise scheduling, small enough that threads
// stay balanced over a list of mixed-size tensors.
constexpr int64_t kChunk = 1 << 16;

struct Chunk {
  int32_t buffer;
  int64_t begin;
  int64_t end;
};

std::vector<Chunk> make_chunks(const ParamBuffers* buffers, int64_t count) {
  std::vector<Chunk> chunks;
  for (int64_t t = 0; t < count; ++t) {
    for (int64_t begin = 0; begin < buffers[t].numel; begin += kChunk) {
      chunks.push_back({static_cast<int32_t>(t), begin, std::min(begin + kChunk, buffers[t].numel)});
    }
  }
  return chunks;
}

// Below ~256K elements per thread, waking a second thread costs more than it saves (and on a loaded
// machine a parallel region can wait milliseconds for a descheduled worker): small steps run serially.
constexpr int64_t kMinPerThread = 1 << 18;

int thread_count(int requested, const ParamBuffers* buffers, int64_t count) {
  int64_t total = 0;
  for (int64_t t = 0; t < count; ++t) total += buffers[t].numel;
  const int64_t useful = std::max<int64_t>(1, total / kMinPerThread);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(requested, useful)));
}

// Marker type: no 16-bit copy-out.
struct NoOut {};

// The 16-bit copy is write-only: streaming (non-temporal) stores skip reading its lines first, 2 of the
// ~32 bytes per element the fused pass moves. Used when the chunk's output is aligned for them.
template <typename O>
inline bool can_stream(O* out, int64_t begin) {
  return reinterpret_cast<uintptr_t>(out + begin) % simd::kStreamAlign == 0;
}
inline bool can_stream(NoOut*, int64_t) { return false; }
template <typename O>
inline void store_out(O* out, int64_t i, VecF p, bool stream) {
  if (stream) {
    simd::store_stream(out + i, p);
  } else {
    simd::store(out + i, p);
  }
}
inline void store_out(NoOut*, int64_t, VecF, bool) {}
inline void store_out_scalar(bf16* out, int64_t i, float p) { out[i] = to_bf16(p); }
inline void store_out_scalar(fp16* out, int64_t i, float p) { out[i] = to_fp16(p); }
inline void store_out_scalar(NoOut*, int64_t, float) {}

// Calls f(G*, O*) with the buffer's gradient and copy-out pointers cast to their element types.
template <typename F>
inline bool dispatch(const ParamBuffers& b, F&& f) {
  auto with_grad = [&](auto* out) {
    switch (b.grad_dtype) {
      case DType::kFloat32:
        return f(static_cast<const float*>(b.grad), out);
      case DType::kBFloat16:
        return f(static_cast<const bf16*>(b.grad), out);
      case DType::kFloat16:
        return f(static_cast<const fp16*>(b.grad), out);
    }
    return false;
  };
  if (b.out16 == nullptr) return with_grad(static_cast<NoOut*>(nullptr));
  if (b.out_dtype == DType::kBFloat16) return with_grad(static_cast<bf16*>(b.out16));
  return with_grad(static_cast<fp16*>(b.out16));
}

// Sum of (g - g) is 0 for finite gradients and NaN as soon as one element is inf or NaN: one subtract
// and one add per vector, tested once per chunk.
template <typename G>
bool chunk_has_nonfinite(const G* g, int64_t begin, int64_t end) {
  VecF acc = simd::set1(0.0f);
  int64_t i = begin;
  for (; i + kWidth <= end; i += kWidth) {
    const VecF x = simd::load(g + i);
    acc = simd::add(acc, simd::sub(x, x));
  }
  bool bad = simd::any_nonfinite(acc);
  for (; i < end; ++i) bad |= is_nonfinite(to_float(g[i]));
  return bad;
}

bool any_nonfinite_grad(const ParamBuffers* buffers, const std::vector<Chunk>& chunks, int threads) {
  const int64_t n = static_cast<int64_t>(chunks.size());
  std::atomic<bool> found{false};
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t c = 0; c < n; ++c) {
    if (found.load(std::memory_order_relaxed)) continue;  // one is enough: stop reading
    const Chunk& ch = chunks[c];
    const bool bad = dispatch(buffers[ch.buffer], [&](const auto* g, auto*) {
      return chunk_has_nonfinite(g, ch.begin, ch.end);
    });
    if (bad) found.store(true, std::memory_order_relaxed);
  }
  return found.load();
}

// Runs `chunk_fn(buffer, chunk)` -> found_inf over all chunks, after the optional pre-scan.
template <typename ChunkFn>
bool run_step(const ParamBuffers* buffers, int64_t count, const StepOptions& o, ChunkFn&& chunk_fn) {
  const std::vector<Chunk> chunks = make_chunks(buffers, count);
  const int threads = thread_count(o.num_threads, buffers, count);
  if (o.skip_if_nonfinite && any_nonfinite_grad(buffers, chunks, threads)) return true;
  const int64_t n = static_cast<int64_t>(chunks.size());
  int found = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(| : found) if (threads > 1)
  for (int64_t c = 0; c < n; ++c) {
    found |= chunk_fn(buffers[chunks[c].buffer], chunks[c]) ? 1 : 0;
  }
  return found != 0;
}

// ---------------------------------------------------------------------------------------------------
template <typename G, typename O>
bool adam_chunk(const ParamBuffers& b, const G* grad, O* out, int64_t begin, int64_t end, const AdamScalars& s,
                const GradScalars& gs) {
  float* __restrict p = b.param;
  float* __restrict m = b.state1;
  float* __restrict v = b.state2;
  const bool l2 = s.has_weight_decay && !s.adamw_mode;
  const bool decoupled = s.has_weight_decay && s.adamw_mode;
  const AdamConsts<VecF> c{simd::set1(s.beta2),        simd::set1(s.one_minus_beta1), simd::set1(s.one_minus_beta2),
                           simd::set1(s.eps),          simd::set1(s.neg_step_size),   simd::set1(s.bc2_sqrt),
                           simd::set1(s.weight_decay), simd::set1(s.decay)};
  const VecF inv_scale = simd::set1(gs.inv_scale), clip = simd::set1(gs.clip_coef);
  const bool stream = can_stream(out, begin);
  VecF bad = simd::set1(0.0f);
  int64_t i = begin;
  for (; i + kWidth <= end; i += kWidth) {
    VecF g = simd::load(grad + i);
    bad = simd::add(bad, simd::sub(g, g));
    if (!gs.identity) g = prepare_grad(g, inv_scale, clip);
    VecF pv = simd::load(p + i), mv = simd::load(m + i), vv = simd::load(v + i);
    adam_update(pv, g, mv, vv, c, l2, decoupled);
    simd::store(p + i, pv);
    simd::store(m + i, mv);
    simd::store(v + i, vv);
    store_out(out, i, pv, stream);
  }
  if (stream) simd::stream_fence();  // order the streamed lines before the kernel returns
  bool found = simd::any_nonfinite(bad);
  const AdamConsts<float> cs{s.beta2, s.one_minus_beta1, s.one_minus_beta2, s.eps,
                             s.neg_step_size, s.bc2_sqrt, s.weight_decay, s.decay};
  for (; i < end; ++i) {
    float g = to_float(grad[i]);
    found |= is_nonfinite(g);
    if (!gs.identity) g = prepare_grad(g, gs.inv_scale, gs.clip_coef);
    adam_update(p[i], g, m[i], v[i], cs, l2, decoupled);
    store_out_scalar(out, i, p[i]);
  }
  return found;
}

template <typename G, typename O>
bool adagrad_chunk(const ParamBuffers& b, const G* grad, O* out, int64_t begin, int64_t end,
                   const AdagradScalars& s, const GradScalars& gs) {
  float* __restrict p = b.param;
  float* __restrict sum = b.state1;
  const bool l2 = s.has_weight_decay;
  const AdagradConsts<VecF> c{simd::set1(s.neg_clr), simd::set1(s.eps), simd::set1(s.weight_decay)};
  const VecF inv_scale = simd::set1(gs.inv_scale), clip = simd::set1(gs.clip_coef);
  const bool stream = can_stream(out, begin);
  VecF bad = simd::set1(0.0f);
  int64_t i = begin;
  for (; i + kWidth <= end; i += kWidth) {
    VecF g = simd::load(grad + i);
    bad = simd::add(bad, simd::sub(g, g));
    if (!gs.identity) g = prepare_grad(g, inv_scale, clip);
    VecF pv = simd::load(p + i), sv = simd::load(sum + i);
    adagrad_update(pv, g, sv, c, l2);
    simd::store(p + i, pv);
    simd::store(sum + i, sv);
    store_out(out, i, pv, stream);
  }
  if (stream) simd::stream_fence();  // order the streamed lines before the kernel returns
  bool found = simd::any_nonfinite(bad);
  const AdagradConsts<float> cs{s.neg_clr, s.eps, s.weight_decay};
  for (; i < end; ++i) {
    float g = to_float(grad[i]);
    found |= is_nonfinite(g);
    if (!gs.identity) g = prepare_grad(g, gs.inv_scale, gs.clip_coef);
    adagrad_update(p[i], g, sum[i], cs, l2);
    store_out_scalar(out, i, p[i]);
  }
  return found;
}

template <typename G, typename O>
bool lion_chunk(const ParamBuffers& b, const G* grad, O* out, int64_t begin, int64_t end, const LionScalars& s,
                const GradScalars& gs) {
  float* __restrict p = b.param;
  float* __restrict m = b.state1;
  const bool decay = s.has_weight_decay;
  const LionConsts<VecF> c{simd::set1(s.beta1),           simd::set1(s.beta2),  simd::set1(s.one_minus_beta1),
                           simd::set1(s.one_minus_beta2), simd::set1(s.neg_lr), simd::set1(s.decay)};
  const VecF inv_scale = simd::set1(gs.inv_scale), clip = simd::set1(gs.clip_coef);
  const bool stream = can_stream(out, begin);
  VecF bad = simd::set1(0.0f);
  int64_t i = begin;
  for (; i + kWidth <= end; i += kWidth) {
    VecF g = simd::load(grad + i);
    bad = simd::add(bad, simd::sub(g, g));
    if (!gs.identity) g = prepare_grad(g, inv_scale, clip);
    VecF pv = simd::load(p + i), mv = simd::load(m + i);
    lion_update(pv, g, mv, c, decay);
    simd::store(p + i, pv);
    simd::store(m + i, mv);
    store_out(out, i, pv, stream);
  }
  if (stream) simd::stream_fence();  // order the streamed lines before the kernel returns
  bool found = simd::any_nonfinite(bad);
  const LionConsts<float> cs{s.beta1, s.beta2, s.one_minus_beta1, s.one_minus_beta2, s.neg_lr, s.decay};
  for (; i < end; ++i) {
    float g = to_float(grad[i]);
    found |= is_nonfinite(g);
    if (!gs.identity) g = prepare_grad(g, gs.inv_scale, gs.clip_coef);
    lion_update(p[i], g, m[i], cs, decay);
    store_out_scalar(out, i, p[i]);
  }
  return found;
}

}  // namespace

bool adam_step(const ParamBuffers* buffers, int64_t count, const AdamScalars& s, const StepOptions& o) {
  return run_step(buffers, count, o, [&](const ParamBuffers& b, const Chunk& ch) {
    return dispatch(b, [&](const auto* g, auto* out) { return adam_chunk(b, g, out, ch.begin, ch.end, s, o.grad); });
  });
}

bool adagrad_step(const ParamBuffers* buffers, int64_t count, const AdagradScalars& s, const StepOptions& o) {
  return run_step(buffers, count, o, [&](const ParamBuffers& b, const Chunk& ch) {
    return dispatch(b,
                    [&](const auto* g, auto* out) { return adagrad_chunk(b, g, out, ch.begin, ch.end, s, o.grad); });
  });
}

bool lion_step(const ParamBuffers* buffers, int64_t count, const LionScalars& s, const StepOptions& o) {
  return run_step(buffers, count, o, [&](const ParamBuffers& b, const Chunk& ch) {
    return dispatch(b, [&](const auto* g, auto* out) { return lion_chunk(b, g, out, ch.begin, ch.end, s, o.grad); });
  });
}

void traffic_ceiling(const ParamBuffers* buffers, int64_t count, int num_threads) {
  const std::vector<Chunk> chunks = make_chunks(buffers, count);
  const int threads = thread_count(num_threads, buffers, count);
  const int64_t n = static_cast<int64_t>(chunks.size());
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t c = 0; c < n; ++c) {
    const ParamBuffers& b = buffers[chunks[c].buffer];
    const float* __restrict g = static_cast<const float*>(b.grad);
    float* __restrict p = b.param;
    float* __restrict m = b.state1;
    float* __restrict v = b.state2;
    int64_t i = chunks[c].begin;
    for (; i + kWidth <= chunks[c].end; i += kWidth) {
      const VecF gv = simd::load(g + i);
      simd::store(p + i, simd::add(simd::load(p + i), gv));
      simd::store(m + i, simd::add(simd::load(m + i), gv));
      simd::store(v + i, simd::add(simd::load(v + i), gv));
    }
    for (; i < chunks[c].end; ++i) {
      p[i] += g[i];
      m[i] += g[i];
      v[i] += g[i];
    }
  }
}

}  // namespace ds::optim
