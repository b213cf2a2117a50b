// Entry points of gemm/exact_gemm_glue.cpp (bound in glue/module.cpp; documented in engine/ops/native.py).
#pragma once

#include <ATen/core/Tensor.h>

namespace engine_native {
namespace exact_gemm_glue {

using at::Tensor;
using c10::optional;

Tensor fp8_to_bf16(const Tensor& data_in, const optional<Tensor>& out);
optional<Tensor> exact_gemm(const Tensor& a_data, const Tensor& a_scale_inv, int64_t a_tile_rows, int64_t a_tile_cols,
                            const Tensor& b_data, const Tensor& b_scale_inv, int64_t b_tile_rows, int64_t b_tile_cols,
                            const optional<Tensor>& bias, at::ScalarType out_dtype, bool bf16_gemm);

}  // namespace exact_gemm_glue
}  // namespace engine_native
