// Entry points of cast/fp8_glue.cpp (bound in glue/module.cpp; documented in engine/ops/native.py).
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace engine_native {
namespace fp8_glue {

using at::Tensor;
using c10::optional;

using CastTransposeResult = std::tuple<optional<Tensor>, optional<Tensor>, Tensor>;
using PerTensorResult = std::tuple<optional<Tensor>, optional<Tensor>, Tensor, Tensor>;
// (rowwise data, its scales, columnwise data, its scales), None for a usage not asked for.
using UsageBuffers = std::tuple<optional<Tensor>, optional<Tensor>, optional<Tensor>, optional<Tensor>>;

Tensor amax(const Tensor& x, const optional<Tensor>& out);
CastTransposeResult cast_transpose(const Tensor& x_in, const Tensor& scale_t, int64_t kind_i, bool rowwise,
                                   bool columnwise, const optional<Tensor>& out_data,
                                   const optional<Tensor>& out_data_t, const optional<Tensor>& out_amax);
PerTensorResult quantize_per_tensor(const Tensor& x, int64_t kind_i, bool rowwise, bool columnwise,
                                    const optional<Tensor>& scale_t, bool pow2, double amax_epsilon,
                                    const optional<Tensor>& record_amax, const optional<Tensor>& out_data,
                                    const optional<Tensor>& out_data_t, const optional<Tensor>& out_scale_inv,
                                    const optional<Tensor>& out_amax);
std::tuple<Tensor, Tensor> quantize_block(const Tensor& x_in, int64_t kind_i, int64_t tile_rows, int64_t tile_cols,
                                          bool pow2, double amax_epsilon, double value_for_inf,
                                          const optional<Tensor>& out_data, const optional<Tensor>& out_scale_inv);
std::tuple<Tensor, Tensor> quantize_mxfp8(const Tensor& x_in, int64_t kind_i, bool rceil, bool columnwise,
                                          const optional<Tensor>& out_data, const optional<Tensor>& out_codes);
UsageBuffers quantize_block_usages(const Tensor& x2d, int64_t kind, int64_t tile_rows, int64_t tile_cols, bool pow2,
                                   double amax_epsilon, double value_for_inf, bool rowwise, bool columnwise,
                                   const optional<Tensor>& out_row_data, const optional<Tensor>& out_col_data);
UsageBuffers quantize_mxfp8_usages(const Tensor& x2d, int64_t kind, bool rceil, bool rowwise, bool columnwise,
                                   const optional<Tensor>& out_row_data, const optional<Tensor>& out_col_data);

}  // namespace fp8_glue
}  // namespace engine_native
