// MXFP4 / MXFP6 kernels (mx_small_kernels.cpp, compiled once per instruction-set level): the job the torch
// glue (mx_small_glue.cpp) hands them and the table each level exports. No torch here.
#pragma once

#include <cstdint>

#include "common/isa.h"

namespace engine_native {

// A row-major 2D input and the four outputs (null: usage not asked for).
struct MxSmallJob {
  const void* x;
  bool bf16;  // else fp32 (the glue widens fp16 to fp32, exactly)
  int64_t ld, M, K;
  int kind;  // 0 E2M1, 1 E2M3, 2 E3M2
  bool rceil;
  uint8_t* row_data;   // [M, packed K]
  uint8_t* row_codes;  // [M, ceil(K/32)]
  uint8_t* col_data;   // [M, packed K]
  uint8_t* col_codes;  // [ceil(M/32), K]
};

constexpr int64_t kMxSmallBlock = 32;
constexpr int64_t kMxSmallTileCols = 256;  // a multiple of 32 (rowwise blocks) and 2 (E2M1 pairs)

struct MxSmallKernels {
  // Quantizes tiles [u0, u1) of the row-major grid ceil(M/32) x ceil(K/256) of tiles of 32 rows x 256 columns.
  void (*quantize_tiles)(const MxSmallJob& job, int64_t u0, int64_t u1);
  // Element codes -> bf16 bits (exact, unscaled) of rows [r0, r1): row r's codes at in + r * in_stride
  // (E2M1: packed, element 0 in the low nibble), its cols values at out + r * cols. Bits above a code's are
  // ignored.
  void (*decode_rows)(const uint8_t* in, int64_t in_stride, uint16_t* out, int64_t cols, int kind, int64_t r0,
                      int64_t r1);
};

ENGINE_ISA_VARIANTS(MxSmallKernels, mx_small_kernels)

}  // namespace engine_native
