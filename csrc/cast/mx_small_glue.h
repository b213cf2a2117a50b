// Entry points of cast/mx_small_glue.cpp (bound in glue/module.cpp; documented in engine/ops/native.py).
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace engine_native {
namespace mx_small_glue {

using at::Tensor;
using c10::optional;

// (row data, row E8M0 codes, col data, col codes); an unrequested usage gives empty tensors.
std::tuple<Tensor, Tensor, Tensor, Tensor> quantize(const Tensor& x_in, int64_t kind, bool rceil, bool rowwise,
                                                    bool columnwise, const optional<Tensor>& out_row_data,
                                                    const optional<Tensor>& out_row_codes,
                                                    const optional<Tensor>& out_col_data,
                                                    const optional<Tensor>& out_col_codes);
// Element codes [..., packed(cols)] -> bf16 values [..., cols] (exact, unscaled).
Tensor elements_to_bf16(const Tensor& data_in, int64_t kind, int64_t cols);

}  // namespace mx_small_glue
}  // namespace engine_native
