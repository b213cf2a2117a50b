// The small exact GEMM of exact_gemm_glue.cpp: out = alpha * (A @ B^T) (+ bias) on the exact bf16 decodes of two
// FP8 operands, for problems where addmm's per-call cost (oneDNN primitive setup, allocations) outweighs the
// arithmetic. No torch here; the kernels are gemm/small_gemm_kernels.cpp, one source compiled per instruction set.
//
// Numerics (the contract of engine/ops/exact_gemm.py), at every level: every product of two bf16 values is exact in
// fp32 (unless it underflows fp32), and each output is
//     acc = +0;  for k = 0, 1, ..., K-1:  acc = fma(a[m, k], b[n, k], acc)        (fp32, round to nearest)
//     y   = fp32(alpha * acc);  if bias: y = fp32(y + bias[n]);  out = round_to_nearest_even(y, out dtype)
// with subnormals kept (the caller sets the default MXCSR). The order depends on K only: not on M, N, the output's
// position, the register blocking, the thread count or the instruction set, so a GEMM on a slice of A's or B's rows
// gives the same bits as the matching slice of the whole GEMM, and every level gives the same bits. NaN comes out as
// a NaN (bf16: 0x7FC0, fp16: 0x7E00 with the sign kept), +-inf as IEEE says.
#pragma once

#include <cstdint>

#include "common/isa.h"

namespace engine_native {

// A bf16 operand: element (r, k) at x[r * rs + k * ks]; one of rs, ks is 1 (row- or column-major storage).
struct SgOperand {
  const uint16_t* x;
  int64_t rows, rs, ks;
};

enum class SgOut : int { F32 = 0, BF16 = 1, F16 = 2 };

// One GEMM. The kernels broadcast elements of one operand (the "s" side, rows i) against 16-wide vectors of the other
// (the "v" side, rows j, packed k-major): out[i, j] when s = A (out_transposed false), out[j, i] when s = B.
struct SmallGemmJob {
  SgOperand s, v;
  int64_t K;
  bool out_transposed;
  float alpha;
  const float* bias;  // [N] fp32 (the caller's bias rounded to the GEMM dtype, then widened), or null
  SgOut out_type;
  void* out;          // [M, N] row-major, contiguous
  float* s_pack;      // s widened to fp32 in its storage order: rows * K floats
  float* v_pack;      // v as fp32 panels of 16 rows, k-major: [ceil(v.rows / 16)][K][16] floats
};

// What each instruction-set variant exports. Packing: s is widened by the caller (`widen`, storage row by storage
// row: s_pack's layout); v panels [p0, p1) of `v_units(job)` by pack_v. Then output tiles [u0, u1) of `tiles(job)`
// by run_tiles, after both packs are done (the tiling is the variant's own: only the bits are common).
struct SmallGemmKernels {
  void (*widen)(const uint16_t* src, int64_t n, float* dst);  // dst[i] = fp32 of the bf16 src[i], i < n
  int64_t (*v_units)(const SmallGemmJob& job);
  void (*pack_v)(const SmallGemmJob& job, int64_t p0, int64_t p1);
  int64_t (*tiles)(const SmallGemmJob& job);
  void (*run_tiles)(const SmallGemmJob& job, int64_t u0, int64_t u1);
};

// small_gemm_kernels(Isa): the variant of a level (common/isa.h).
ENGINE_ISA_VARIANTS(SmallGemmKernels, small_gemm_kernels)

}  // namespace engine_native
