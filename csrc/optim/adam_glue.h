// Entry point of optim/adam_glue.cpp (bound in glue/module.cpp; documented in engine/ops/native.py).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

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

// One step of every tensor of a parameter group (states of one format pair), in one call threaded over all their
// chunks: each `steps` counter (float32, torch.optim's) incremented, the step's scalars computed from it as
// engine.optim.Adam.scalars does (decoupled: AdamW's weight decay). Stochastic bf16 states (kind 5) take their
// random bits from `counters` (each advanced by its `global_numels` per such state), as the reference's store.
void adam_step_group(const std::vector<Tensor>& ws, const std::vector<Tensor>& grads, const std::vector<Tensor>& ms,
                     const std::vector<std::optional<Tensor>>& m_scales, int64_t m_kind, const std::vector<Tensor>& vs,
                     const std::vector<std::optional<Tensor>>& v_scales, int64_t v_kind, bool v_sqrt,
                     const std::vector<Tensor>& steps, const Tensor& signed_codes, const Tensor& signed_mids,
                     const Tensor& unsigned_codes, const Tensor& unsigned_mids, double lr, double beta1, double beta2,
                     double eps, double weight_decay, bool decoupled, bool maximize,
                     const std::vector<std::optional<Tensor>>& counters, const std::vector<int64_t>& global_numels,
                     const std::optional<Tensor>& signed_tables, const std::optional<Tensor>& unsigned_tables);

// The int8 code search's tables of a map (optim/adam.h: Int8Map) as uint8 bytes, built and proven once (a
// ValueError for a map the kernel's rule does not fit): adam_step_group's signed_tables / unsigned_tables, so that
// a step does not rebuild them.
Tensor adam_int8_tables(const Tensor& codes, const Tensor& mids);

}  // namespace adam_glue
}  // namespace engine_native
