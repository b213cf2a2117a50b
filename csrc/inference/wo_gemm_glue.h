// Entry points of inference/wo_gemm_glue.cpp (bound in glue/module.cpp; documented in engine/ops/native.py).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace engine_native {
namespace wo_gemm_glue {

using at::Tensor;

// x [M, K] @ W^T for the int4 weight of wo_gemm.h -> [M, n] in x's dtype.
Tensor int4_linear(const Tensor& x, const Tensor& data, const Tensor& scale_and_zero, int64_t group_size, int64_t n);
// x [M, K] @ (data * scale[:, None])^T for int8 (or, e4m3, E4M3) data [N, K] -> [M, N] in x's dtype.
Tensor byte_linear(const Tensor& x, const Tensor& data, const Tensor& scale, bool e4m3);
// x [M, K] @ W^T for block-scaled float codes (wo_gemm.h's WoBlockJob: `kind` kWo*, `block` 16 or 32; E8M0
// scales, or with `amax` NVFP4's E4M3 ones times amax * factor) -> [M, N] in x's dtype.
Tensor block_linear(const Tensor& x, const Tensor& data, const Tensor& scale, int64_t kind, int64_t block,
                    const std::optional<Tensor>& amax, double factor);

}  // namespace wo_gemm_glue
}  // namespace engine_native
