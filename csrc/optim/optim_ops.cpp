// optim_ops.cpp: schemas of the optimizer-step ops and their CPU registration. The kernels only ever see
// the raw, checked, contiguous buffers from optim_checks.h; the torch dispatcher releases the GIL around
// the call (nothing here touches Python objects).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/full.h>
#include <torch/library.h>

#include "cpu_optim.h"
#include "optim_checks.h"

namespace ds::optim {
namespace {

at::Tensor flag(bool found) { return at::full({}, found ? 1.0f : 0.0f, at::TensorOptions().dtype(at::kFloat)); }

at::Tensor adam_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                         at::TensorList exp_avg_sqs, at::TensorList out_16bit, double lr, double beta1, double beta2,
                         double eps, double weight_decay, int64_t step, bool adamw_mode, bool bias_correction,
                         double grad_scale, double clip_coef, bool skip_if_nonfinite) {
  constexpr const char* op = "adam_step_";
  TORCH_CHECK(step >= 1, op, ": step must be >= 1 (the count after this update), got ", step);
  const auto buffers = checked_buffers(op, c10::DeviceType::CPU, params, grads,
                                       {{"exp_avgs", exp_avgs}, {"exp_avg_sqs", exp_avg_sqs}}, out_16bit);
  const StepOptions o{grad_scalars(op, grad_scale, clip_coef), skip_if_nonfinite, at::get_num_threads()};
  const auto s = AdamScalars::make(lr, beta1, beta2, eps, weight_decay, step, adamw_mode, bias_correction);
  return flag(adam_step(buffers.data(), static_cast<int64_t>(buffers.size()), s, o));
}

at::Tensor adagrad_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList state_sums,
                            at::TensorList out_16bit, double lr, double lr_decay, double eps, double weight_decay,
                            int64_t step, double grad_scale, double clip_coef, bool skip_if_nonfinite) {
  constexpr const char* op = "adagrad_step_";
  TORCH_CHECK(step >= 1, op, ": step must be >= 1 (the count after this update), got ", step);
  const auto buffers = checked_buffers(op, c10::DeviceType::CPU, params, grads, {{"state_sums", state_sums}}, out_16bit);
  const StepOptions o{grad_scalars(op, grad_scale, clip_coef), skip_if_nonfinite, at::get_num_threads()};
  const auto s = AdagradScalars::make(lr, lr_decay, eps, weight_decay, step);
  return flag(adagrad_step(buffers.data(), static_cast<int64_t>(buffers.size()), s, o));
}

at::Tensor lion_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                         at::TensorList out_16bit, double lr, double beta1, double beta2, double weight_decay,
                         double grad_scale, double clip_coef, bool skip_if_nonfinite) {
  constexpr const char* op = "lion_step_";
  const auto buffers = checked_buffers(op, c10::DeviceType::CPU, params, grads, {{"exp_avgs", exp_avgs}}, out_16bit);
  const StepOptions o{grad_scalars(op, grad_scale, clip_coef), skip_if_nonfinite, at::get_num_threads()};
  const auto s = LionScalars::make(lr, beta1, beta2, weight_decay);
  return flag(lion_step(buffers.data(), static_cast<int64_t>(buffers.size()), s, o));
}

void traffic_ceiling_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                         at::TensorList exp_avg_sqs) {
  constexpr const char* op = "optim_traffic_ceiling_";
  const auto buffers = checked_buffers(op, c10::DeviceType::CPU, params, grads,
                                       {{"exp_avgs", exp_avgs}, {"exp_avg_sqs", exp_avg_sqs}}, {});
  for (size_t i = 0; i < grads.size(); ++i) {
    TORCH_CHECK(grads[i].scalar_type() == at::kFloat, op, ": grads[", i, "] must be float32");
  }
  traffic_ceiling(buffers.data(), static_cast<int64_t>(buffers.size()), at::get_num_threads());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ds_strategy, m) {
  m.def(
      "adam_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] out_16bit, *, float lr, float beta1, float beta2, float eps, float weight_decay, int step, "
      "bool adamw_mode, bool bias_correction, float grad_scale=1.0, float clip_coef=1.0, "
      "bool skip_if_nonfinite=False) -> Tensor");
  m.def(
      "adagrad_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] state_sums, Tensor(d!)[] out_16bit, *, "
      "float lr, float lr_decay, float eps, float weight_decay, int step, float grad_scale=1.0, "
      "float clip_coef=1.0, bool skip_if_nonfinite=False) -> Tensor");
  m.def(
      "lion_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(d!)[] out_16bit, *, "
      "float lr, float beta1, float beta2, float weight_decay, float grad_scale=1.0, float clip_coef=1.0, "
      "bool skip_if_nonfinite=False) -> Tensor");
  // Benchmark only: Adam's memory traffic with no math (p += g, m += g, v += g).
  m.def("optim_traffic_ceiling_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
        "Tensor(c!)[] exp_avg_sqs) -> ()");
}

TORCH_LIBRARY_IMPL(ds_strategy, CPU, m) {
  m.impl("adam_step_", &adam_step_cpu);
  m.impl("adagrad_step_", &adagrad_step_cpu);
  m.impl("lion_step_", &lion_step_cpu);
  m.impl("optim_traffic_ceiling_", &traffic_ceiling_cpu);
}

}  // namespace ds::optim
