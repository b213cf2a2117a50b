// Weight-only GEMMs at small M (int4 groupwise, int8 and FP8 E4M3 per channel): the jobs the glue
// (wo_gemm_glue.cpp) hands the kernels (wo_gemm_kernels.cpp, one source compiled per instruction set) and the
// table each variant exports. No torch here.
//
// Every variant computes y[m, n] = sum_k x[m, k] * w[n, k] with fp32 sums:
//   int4: per group, scale * sum x * (q - 8) + zero * sum x (q - 8 exact in fp32, each product x * (q - 8)
//         exact for bf16 / fp16 x), i.e. the reference's sum x * ((q - 8) * scale + zero) up to the order and
//         grouping of fp32 additions (the tests' bound counts |q - 8| * scale + |zero| per term);
//   int8 / E4M3: x * q (exact values), the scale applied to the sum: the reference up to the order of the
//         fp32 additions.
// int4 with bf16 x has a faster form on CPUs with AVX512-BF16 (int4_rows_bf16): the same sums by vdpbf16ps.
#pragma once

#include <cstdint>

#include "common/isa.h"

namespace engine_native {

// int4 weight layout (Int4WeightOnly's "data"): uint8 [rows, K/2], byte [n, i] = q[n, 2i] | q[n, 2i+1] << 4
// (element 2i in the low nibble), q in [0, 15]. K is a multiple of the group size, itself a multiple of 32.
constexpr int64_t kWoChunk = 32;  // the k values one step of the int4 kernels reads from one row: 16 bytes

struct WoInt4Job {
  const float* x;      // [M, ldx] fp32 in the variant's order (WoKernels::int4_pack_x)
  int64_t M, K, ldx;
  // The bf16 path (WoKernels::int4_rows_bf16), else null:
  const uint16_t* xb;  // [M, K] bf16 bits, each run of 64 k's stored even k's first, then odd k's
  const float* xsum;   // [M, K / group]: the fp32 sum of x over each group (both paths)
  const uint8_t* w;    // the layout above, row n at w + n * K / 2
  const uint32_t* sz;  // group j of row n: sz[j * sz_ld + n] = bf16 scale bits | bf16 zero bits << 16
  int64_t sz_ld, group;
  float* y;            // [M, ldy] fp32
  int64_t ldy;
};

// A byte per weight, one scale per row: int8 (Int8WeightOnly) or E4M3 codes (Float8WeightOnly, power-of-2 scales).
struct WoInt8Job {
  const float* x;      // [M, ldx] fp32 in the variant's order (WoKernels::int8_pack_x), zeros past K
  int64_t M, K, ldx;
  const int8_t* w;     // [N, K] int8 (or E4M3 bytes), row-major
  const float* scale;  // [N]: y = sum * scale
  float* y;            // [M, ldy] fp32
  int64_t ldy;
  bool e4m3;           // w holds E4M3 codes: each decodes to its exact value (NaN codes to a quiet NaN)
};

// Block-scaled float weights (MXWeightOnly, NVFP4WeightOnly): element codes and one scale code per block of
// `block` elements along K; y[m, n] = sum_k x[m, k] * (element * block scale), each weight the reference's fp32
// value (one fp32 multiplication), fp32 sums in any order (wo_block_kernels.h).
constexpr int kWoE2M1 = 0, kWoE2M3 = 1, kWoE3M2 = 2, kWoE4M3 = 3;  // the element kinds

struct WoBlockJob {
  const float* x;        // [M, ldx]: the vector part of x (k < kv) in the variant's order (WoKernels::block_pack_x)
  const float* xraw;     // [M, K] fp32, for the k >= kv the kernel sums by scalar code
  int64_t M, K, ldx, kv;  // kv = WoKernels::block_vector_k(kind, K) = ldx
  const uint8_t* w;      // row n at w + n * w_ld: E2M1 two codes a byte along K (low nibble first), else a byte each
  int64_t w_ld;
  const uint8_t* scale;  // [N, scale_ld] codes, block j of row n at scale[n * scale_ld + j]: E8M0, or E4M3 (nvfp4)
  int64_t scale_ld;
  int kind, block;       // kWo*, 16 or 32
  bool nvfp4;            // block scale = (E4M3 value * amax) * factor (fp32, in that order), else E8M0's 2^(e - 127)
  float amax, factor;
  float* y;              // [M, ldy] fp32
  int64_t ldy;
};

// What each instruction-set variant exports. The x orders differ between variants (each reads a run of
// weight bytes as whole 32-bit words and wants x in the order of the codes they hold), so x goes through the
// same variant's pack function as the kernel that reads it.
struct WoKernels {
  // K padded to a multiple of this for int4_rows (ldx).
  int64_t int4_block;
  // x [M, K] fp32 (K a multiple of 32) -> out [M, ldx] in int4_rows's order (zeros past K), and xsum.
  void (*int4_pack_x)(const float* x, int64_t M, int64_t K, int64_t group, float* out, int64_t ldx, float* xsum);
  // Rows [n0, n1) of y, every m.
  void (*int4_rows)(const WoInt4Job& job, int64_t n0, int64_t n1);
  // K padded to a multiple of this for int8_rows (ldx).
  int64_t int8_block;
  // x [M, K] fp32 -> out [M, ldx] in int8_rows's order, zeros past K.
  void (*int8_pack_x)(const float* x, int64_t M, int64_t K, float* out, int64_t ldx);
  void (*int8_rows)(const WoInt8Job& job, int64_t n0, int64_t n1);
  // The bf16 path, null where this variant or the CPU has none (AVX512-BF16): x bf16 bits [M, K] and its fp32
  // values -> xb and xsum of WoInt4Job (group a multiple of 64, or 32 with K a multiple of 64).
  void (*int4_pack_x_bf16)(const uint16_t* xbits, const float* x, int64_t M, int64_t K, int64_t group, uint16_t* xb,
                           float* xsum);
  // sum_k x * (q - 8) per group from exact bf16 products, then * scale, plus zero * the group's x sum: the
  // same value up to the order (and grouping) of fp32 additions. x must hold no subnormal (read as 0).
  void (*int4_rows_bf16)(const WoInt4Job& job, int64_t n0, int64_t n1);
  // Block-scaled float weights: the vector part of K, x [M, K] -> out [M, ldx = that part] in block_rows's order,
  // and rows [n0, n1) of y.
  int64_t (*block_vector_k)(int kind, int64_t K);
  void (*block_pack_x)(int kind, const float* x, int64_t M, int64_t K, float* out, int64_t ldx);
  void (*block_rows)(const WoBlockJob& job, int64_t n0, int64_t n1);
  // Whether x [n] fp32 holds a subnormal.
  bool (*has_subnormal)(const float* x, int64_t n);
  // fp32 [n] -> bf16 bits, round to nearest even, NaN -> quiet NaN with the sign kept.
  void (*to_bf16)(const float* y, int64_t n, uint16_t* out);
};

ENGINE_ISA_VARIANTS(WoKernels, wo_kernels)

}  // namespace engine_native
