// Entry point of cast/nvfp4_glue.cpp (bound in glue/module.cpp; documented in engine/ops/native.py).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <tuple>

namespace engine_native {
namespace nvfp4_glue {

using at::Tensor;
using c10::optional;

// (row data, row E4M3 scales, row amax, col data, col scales, col amax) of a 2D x.
using Nvfp4Result = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

Nvfp4Result quantize(const Tensor& x_in, bool rowwise, bool columnwise, bool two_d, bool rht,
                     const optional<Tensor>& amax, const optional<Tensor>& amax_t, const optional<Tensor>& counter,
                     const optional<Tensor>& out_row_data, const optional<Tensor>& out_row_scales,
                     const optional<Tensor>& out_col_data, const optional<Tensor>& out_col_scales,
                     bool four_over_six, const std::string& four_over_six_err_mode, double four_over_six_e4m3_max);

}  // namespace nvfp4_glue
}  // namespace engine_native
