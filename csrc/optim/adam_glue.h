// Entry point of optim/adam_glue.cpp (bound in glue/module.cpp; documented in engine/ops/native.py).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace engine_native {
namespace adam_glue {

using at::Tensor;

// One fused Adam / AdamW step of a tensor over compressed states, in place (optim/adam.h).
void adam_step(const Tensor& w, const Tensor& grad, const std::optional<Tensor>& w_bf16, const Tensor& m,
               const std::optional<Tensor>& m_scale, int64_t m_kind, const Tensor& v,
               const std::optional<Tensor>& v_scale, int64_t v_kind, bool v_sqrt, const Tensor& signed_codes,
               const Tensor& signed_mids, const Tensor& unsigned_codes, const Tensor& unsigned_mids, double beta1,
               double one_minus_beta1, double beta2, double one_minus_beta2, double step_size, double inv_bc2_sqrt,
               double eps, double decay, double wd, bool maximize);

}  // namespace adam_glue
}  // namespace engine_native
