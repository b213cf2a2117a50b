// Entry points of gemm/grouped_gemm_glue.cpp (bound in glue/module.cpp; documented in engine/ops/native.py).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace engine_native {
namespace grouped_gemm_glue {

using at::Tensor;
using c10::optional;

std::vector<optional<Tensor>> grouped_exact_gemm(
    const std::vector<Tensor>& a, const std::vector<Tensor>& a_scale_inv, const std::vector<int64_t>& a_tiles,
    const std::vector<Tensor>& b, const std::vector<Tensor>& b_scale_inv, const std::vector<int64_t>& b_tiles,
    const std::string& numerics, const std::vector<Tensor>& a_amax, const std::vector<Tensor>& b_amax,
    double a_amax_divisor, double b_amax_divisor, const std::vector<optional<Tensor>>& biases,
    at::ScalarType out_dtype, bool bf16_gemm, const optional<Tensor>& out);

}  // namespace grouped_gemm_glue
}  // namespace engine_native
