// Weight-only GEMMs at small M (int4 groupwise, int8 and FP8 E4M3 per channel): the jobs the torch glue
// (kernels_wo_gemm.cpp) hands the kernels, and their two builds, portable (kernels_wo_gemm.cpp) and AVX-512
// (kernels_wo_gemm_avx512.cpp, chosen at run time). No torch here.
//
// Both compute y[m, n] = sum_k x[m, k] * w[n, k] in fp32, w dequantized in registers exactly as the reference
// does (int4: (q - 8) * scale + zero, the product exact, one rounding; int8: q, the scale applied to the
// sum), so the results differ from the plain-PyTorch fp32 reference only by the order of the fp32 additions.
// int4 with bf16 x has a faster form (int4_rows_bf16): per group, scale * sum x * (q - 8) + zero * sum x.
#pragma once

#include <cstdint>

namespace engine_native {

// int4 weight layout (Int4WeightOnly's "data"): uint8 [rows, K/2], byte [n, i] = q[n, 2i] | q[n, 2i+1] << 4
// (element 2i in the low nibble), q in [0, 15]. K is a multiple of the group size, itself a multiple of 32.
constexpr int64_t kWoChunk = 32;  // the k values one step of the int4 kernels reads from one row: 16 bytes

struct WoInt4Job {
  const float* x;      // [M, K] fp32, each run of 32 k's stored even k's first, then odd k's
  int64_t M, K;
  // The bf16 path (x in bf16 without subnormals, group a multiple of 64 or 32 with K a multiple of 64,
  // AVX512-BF16), else null:
  const uint16_t* xb;  // [M, K] bf16 bits, each run of 64 k's stored even k's first, then odd k's
  const float* xsum;   // [M, K / group]: the fp32 sum of x over each group
  const uint8_t* w;    // the layout above, row n at w + n * K / 2
  const uint32_t* sz;  // group j of row n: sz[j * sz_ld + n] = bf16 scale bits | bf16 zero bits << 16
  int64_t sz_ld, group;
  float* y;            // [M, ldy] fp32
  int64_t ldy;
};

// A byte per weight, one scale per row: int8 (Int8WeightOnly) or E4M3 codes (Float8WeightOnly, power-of-2 scales).
struct WoInt8Job {
  const float* x;      // [M, K] fp32, row-major
  int64_t M, K;
  const int8_t* w;     // [N, K] int8 (or E4M3 bytes), row-major
  const float* scale;  // [N]: y = sum * scale
  float* y;            // [M, ldy] fp32
  int64_t ldy;
  bool e4m3;           // w holds E4M3 codes: each decodes to its exact value (NaN codes to a quiet NaN)
};

// Rows [n0, n1) of y, every m.
namespace wo_portable {
void int4_rows(const WoInt4Job& job, int64_t n0, int64_t n1);
void int8_rows(const WoInt8Job& job, int64_t n0, int64_t n1);
}  // namespace wo_portable
namespace wo_avx512 {
bool compiled();  // false where the compiler or architecture has no AVX-512 build
bool compiled_bf16();  // int4_rows_bf16 is built (AVX512-BF16)
void int4_rows(const WoInt4Job& job, int64_t n0, int64_t n1);
// The bf16 path: sum_k x * (q - 8) per group from exact bf16 products (vdpbf16ps), then * scale, plus zero * the
// group's x sum: the same value up to the order (and grouping) of fp32 additions.
void int4_rows_bf16(const WoInt4Job& job, int64_t n0, int64_t n1);
void int8_rows(const WoInt8Job& job, int64_t n0, int64_t n1);
}  // namespace wo_avx512

}  // namespace engine_native
