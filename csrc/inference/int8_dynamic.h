// The loops of Int8DynamicActivationInt8Weight's glue around the int8 GEMM (int8_dynamic_kernels.cpp, one
// source compiled per instruction set): per-token int8 quantization of x and the rescale of the int sums. Bit
// for bit the torch ops of engine/inference/int_formats.py (`rowwise_int8` and
// `(acc.float() * sx[:, None] * sw[None, :]).to(dtype)`): the same fp32 operations in the same order, at every
// level. No torch here.
#pragma once

#include <cstdint>

#include "common/isa.h"

namespace engine_native {

struct Int8DynamicKernels {
  // One row x [K]: scale = max(amax / 127, fp32 tiny) (NaN if the row has one), out = round-half-even(x / scale)
  // clamped to [-127, 127] (NaN quotients give 0) as two's-complement bytes, xor `flip` (0x80: the uint8 code
  // q + 128 of oneDNN's u8 x with zero point 128).
  void (*quantize_row)(const float* x, int64_t K, uint8_t flip, uint8_t* out, float* scale);
  // One row: acc[n] (as fp32) * sx * sw[n] -> yf[n] (fp32), or, yf null, yb[n] (bf16 bits, nearest even).
  void (*rescale_row_i32)(const int32_t* acc, float sx, const float* sw, int64_t N, float* yf, uint16_t* yb);
  void (*rescale_row_f32)(const float* acc, float sx, const float* sw, int64_t N, float* yf, uint16_t* yb);
};

ENGINE_ISA_VARIANTS(Int8DynamicKernels, int8_dynamic_kernels)

}  // namespace engine_native
