// Entry point of scaling/delayed_update_glue.cpp (bound in glue/module.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace engine_native {
namespace delayed_update_glue {

void delayed_update_op(const at::Tensor& history, const at::Tensor& scale, double fp8_max, int64_t margin,
                       bool most_recent, const std::vector<int64_t>& held);

}  // namespace delayed_update_glue
}  // namespace engine_native
