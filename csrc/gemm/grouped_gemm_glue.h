// Entry points of gemm/grouped_gemm_glue.cpp (bound in glue/module.cpp; documented in engine/ops/native.py).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace engine_native {
namespace grouped_gemm_glue {

using at::Tensor;
using c10::optional;

std::vector<optional<Tensor>> grouped_exact_gemm(
    const std::vector<Tensor>& a, const std::vector<Tensor>& a_scale_inv, int64_t a_tile_rows, int64_t a_tile_cols,
    const std::vector<Tensor>& b, const std::vector<Tensor>& b_scale_inv, int64_t b_tile_rows, int64_t b_tile_cols,
    const std::vector<optional<Tensor>>& biases, at::ScalarType out_dtype, bool bf16_gemm, const optional<Tensor>& out);

}  // namespace grouped_gemm_glue
}  // namespace engine_native
