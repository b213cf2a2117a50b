// MXFP4 / MXFP6 quantize kernels (mx_small_kernels.h): the job the torch glue (kernels_mx_small.cpp) hands
// them, and their two builds, portable and AVX-512 (kernels_mx_small_avx512.cpp, chosen at run time).
// No torch here: the kernel files include only this.
#pragma once

#include <cstdint>

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

// Quantizes tiles [u0, u1) of the row-major grid ceil(M/32) x ceil(K/256) of tiles of 32 rows x 256 columns.
namespace mx_small_portable {
void mx_small_tiles(const MxSmallJob& job, int64_t u0, int64_t u1);
}
namespace mx_small_avx512 {
bool compiled();  // false where the compiler or architecture has no AVX-512 build
void mx_small_tiles(const MxSmallJob& job, int64_t u0, int64_t u1);
}  // namespace mx_small_avx512

}  // namespace engine_native
