// Entry points of inference/int8_dynamic_glue.cpp (bound in glue/module.cpp; documented in engine/ops/native.py).
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace engine_native {
namespace int8_dynamic_glue {

using at::Tensor;

// (q int8 [M, K] (uint8 q + 128 when biased), scale fp32 [M]): per-row symmetric int8 of x [M, K].
std::tuple<Tensor, Tensor> quantize_rows(const Tensor& x, bool biased);
// (acc.float() * sx[:, None] * sw[None, :]) in fp32, rounded once to `dtype`.
Tensor rescale(const Tensor& acc, const Tensor& sx, const Tensor& sw, at::ScalarType dtype);

}  // namespace int8_dynamic_glue
}  // namespace engine_native
