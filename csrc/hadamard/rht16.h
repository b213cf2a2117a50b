// The 16-point random Hadamard transform (RHT) of NVFP4's columnwise usage, bit for bit
// engine.ops.nvfp4.rht_transform (TE's order of fp32 operations):
//   y[k] = bf16(sum_{i=0..15} x_i * H[i][k]),  H = diag(s) * H16 / 4,
// computed as q_i = x_i * (s_i / 4) (exact: a power of 2 and a sign; -(x * 0.25) is x * -0.25, signed zeros
// included), then the fast Walsh-Hadamard butterflies in stages h = 1, 2, 4, 8, then the bf16 rounding (RNE,
// NaN -> the canonical quiet NaN). Each lane of a vector is one column (16 tokens of it); vectors are the
// level's native width (vec::f32n: nothing for the compiler to split).
// Include only from a `*_kernels.cpp` (after isa_begin.h): everything is in the variant's namespace.
#pragma once

#include "common/vec.h"

namespace engine_native {
namespace ENGINE_ISA_NS {
namespace hadamard {

// |v| and the NaN lanes of native-width vectors.
ENGINE_VEC_INLINE vec::f32n abs_n(vec::f32n v) { return vec::bits<vec::f32n>(vec::bits<vec::u32n>(v) & 0x7FFFFFFFu); }
ENGINE_VEC_INLINE vec::i32n is_nan_n(vec::f32n v) { return v != v; }

// TE's sign vector s.
constexpr int kRhtSigns[16] = {1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1};

// The fast Walsh-Hadamard transform of v[0..15] in place: each pair (v[i], v[i + h]) with i & h == 0 becomes
// (v[i] + v[i + h], v[i] - v[i + h]), stages h = 1, 2, 4, 8 (rht_transform's order).
template <typename V>
ENGINE_VEC_INLINE void fwht16(V* v) {
#pragma GCC unroll 4
  for (int h = 1; h < 16; h *= 2) {
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      if (i & h) continue;
      const V a = v[i], b = v[i + h];
      v[i] = a + b;
      v[i + h] = a - b;
    }
  }
}

// v[i] = x_i (16 tokens, lane-wise columns) -> sum_i x_i H[i][k] in v[k], before the bf16 rounding.
template <typename V>
ENGINE_VEC_INLINE void rht16(V* v) {
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) v[i] = v[i] * (0.25f * static_cast<float>(kRhtSigns[i]));
  fwht16(v);
}

// Lane-wise bounds above every |sum_i x_i H[i][k]| (rht16's output, before the bf16 rounding) of the tokens
// v[0..15]: 0.25 * 1.01 * sum_i |x_i| + 2^-140. The 4 butterfly stages add a relative error below 2^-19, the fp32
// sum of the |x_i| is low by at most 2^-19, and x_i * 0.25 rounds up by at most 2^-150; an inf or NaN token gives
// inf or NaN (no bound).
ENGINE_VEC_INLINE vec::f32n abs_bound(const vec::f32n* v) {
  vec::f32n sum = {};
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) sum = sum + abs_n(v[i]);
  return sum * (0.25f * 1.01f) + 0x1p-140f;
}

// fp32 -> the nearest bf16 (ties to even) as fp32; NaN -> 0x7FC00000.
ENGINE_VEC_INLINE vec::f32n bf16_round(vec::f32n v) {
  const vec::u32n u = vec::bits<vec::u32n>(v);
  const vec::u32n r = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  return vec::bits<vec::f32n>(vec::select(is_nan_n(v), vec::splat<vec::u32n>(0x7FC00000u), r));
}

// y[k][c] = the RHT output of the 16 tokens t[0..15][c] of each column c < cols (cols a multiple of
// vec::kNativeLanes), rows ld floats apart; keys[c] = the max |y[k][c]| bits over its 16 outputs (above 0x7F800000:
// a NaN), taken while they are in registers (no second pass over y for the columnwise blocks' maxima).
inline void rht_rows_keys(const float* __restrict t, float* __restrict y, int64_t ld, int64_t cols,
                          uint32_t* __restrict keys) {
  for (int64_t c = 0; c < cols; c += vec::kNativeLanes) {
    vec::f32n v[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) v[i] = vec::load<vec::f32n>(t + i * ld + c);
    rht16(v);
    vec::u32n m = {};
#pragma GCC unroll 16
    for (int k = 0; k < 16; ++k) {
      const vec::f32n r = bf16_round(v[k]);
      vec::store(y + k * ld + c, r);
      m = vec::max(m, vec::bits<vec::u32n>(r) & 0x7FFFFFFFu);
    }
    vec::store(keys + c, m);
  }
}

}  // namespace hadamard
}  // namespace ENGINE_ISA_NS
}  // namespace engine_native
