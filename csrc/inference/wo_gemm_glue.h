// Entry points of inference/wo_gemm_glue.cpp (bound in glue/module.cpp; documented in engine/ops/native.py).
#pragma once

#include <ATen/core/Tensor.h>

namespace engine_native {
namespace wo_gemm_glue {

using at::Tensor;

// x [M, K] @ W^T for the int4 weight of wo_gemm.h -> [M, n] in x's dtype.
Tensor int4_linear(const Tensor& x, const Tensor& data, const Tensor& scale_and_zero, int64_t group_size, int64_t n);
// x [M, K] @ (data * scale[:, None])^T for int8 (or, e4m3, E4M3) data [N, K] -> [M, N] in x's dtype.
Tensor byte_linear(const Tensor& x, const Tensor& data, const Tensor& scale, bool e4m3);

}  // namespace wo_gemm_glue
}  // namespace engine_native
