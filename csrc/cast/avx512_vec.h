// AVX-512 building blocks of the kernels in kernels_avx512.cpp: the fp32 -> FP8 rounding,
// loading 64 elements at a time, amax keys, packing codes to bytes, and a 64x64 byte
// transpose.
//
// Include only from kernels_avx512.cpp, after its target pragma (these functions use
// AVX-512 instructions) and before any other code: everything is in an anonymous
// namespace, so no other translation unit can end up with these instructions.
#pragma once

#ifndef ENGINE_AVX512_KERNELS
#error "avx512_vec.h is for the AVX-512 kernel files (kernels_avx512.cpp, kernels_nvfp4_avx512.cpp) only"
#endif

#include <immintrin.h>

#include <cstdint>

#include "common/fp8_scalar.h"

namespace engine_native {
namespace {

// Hot helpers must be inlined: a call would pass the vectors through memory.
#define ENGINE_INLINE inline __attribute__((always_inline))

ENGINE_INLINE int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
// Masks of the first n lanes (n may be <= 0 or past the width).
ENGINE_INLINE __mmask64 first64(int64_t n) { return n >= 64 ? ~0ull : n <= 0 ? 0 : ((1ull << n) - 1ull); }
ENGINE_INLINE __mmask32 first32(int64_t n) { return static_cast<__mmask32>(first64(n < 32 ? n : 32)); }
ENGINE_INLINE __mmask16 first16(int64_t n) { return static_cast<__mmask16>(first64(n < 16 ? n : 16)); }

constexpr bool is16(InType T) { return T != InType::F32; }
// Key vectors per 64 elements: two of 32 16-bit lanes, or four of 16 32-bit lanes.
constexpr int key_vectors(InType T) { return is16(T) ? 2 : 4; }

// ------------------------------------------------------------------- fp32 -> FP8 magnitude
// Rounds |p| to the FP8 format, saturating, ties to even, and returns the 7-bit code in
// each 32-bit lane (a NaN gives a value >= 0x400000, which the saturating packs turn
// into 0xFF). With E' = max(exponent of c, the smallest normal exponent):
//   c = min(max, |p|)                         (vminps keeps a NaN |p|)
//   M = 2^(E' + 23 - mbits) + j ulp(M),       j = (E' + bias - 1) << mbits
//   s = c + M                                 (the hardware rounds c to a multiple of
//                                              ulp(M) = the FP8 ulp at c, ties to even:
//                                              j is even, so the tie parity is c's own)
//   code = low 23 bits of s = j + round(c / ulp(M))
// The low bits count FP8 ulps from the binade's start and j adds the binade's exponent
// field, so FP8 subnormals (E' = 1 - bias, j = 0) come out right with no fp32 subnormal
// ever produced (those take a slow microcode path). M comes from a table indexed by the
// low bits of E''s fp32 exponent field: E4M3 has 15 binades (a 16-entry vpermd), E5M2
// 30 (a 32-entry vpermt2d). Needs round-to-nearest (MXCSR default; bindings.cpp sets it).
template <Fp8Kind K>
struct Fp8Consts {
  static constexpr int kMant = K == Fp8Kind::E4M3 ? 3 : 2;
  static constexpr float kMax = K == Fp8Kind::E4M3 ? 448.0f : 57344.0f;
  static constexpr int kMinExpField = K == Fp8Kind::E4M3 ? 121 : 113;  // fp32 exponent field of 2^(1 - bias)
  static constexpr int kMaxExpField = K == Fp8Kind::E4M3 ? 135 : 142;  // ... of the largest binade
  alignas(64) uint32_t m[32];
  constexpr Fp8Consts() : m{} {
    for (int f = kMinExpField; f <= kMaxExpField; ++f)
      m[f & 31] = (static_cast<uint32_t>(f + 23 - kMant) << 23) + (static_cast<uint32_t>(f - kMinExpField) << kMant);
    if (K == Fp8Kind::E4M3)  // the 16-entry table: fields 121..135 have distinct low 4 bits
      for (int f = kMinExpField; f <= kMaxExpField; ++f) m[f & 15] = m[f & 31];
  }
};

template <Fp8Kind K>
ENGINE_INLINE __m512i magnitude_codes(__m512 mag) {
  using C = Fp8Consts<K>;
  static constexpr C consts{};
  const __m512 c = _mm512_min_ps(_mm512_set1_ps(C::kMax), mag);
  const __m512i field =
      _mm512_max_epu32(_mm512_srli_epi32(_mm512_castps_si512(c), 23), _mm512_set1_epi32(C::kMinExpField));
  __m512i m;
  if constexpr (K == Fp8Kind::E4M3) {
    m = _mm512_permutexvar_epi32(field, _mm512_load_si512(consts.m));
  } else {
    m = _mm512_permutex2var_epi32(_mm512_load_si512(consts.m), field, _mm512_load_si512(consts.m + 16));
  }
  const __m512 sum = _mm512_add_ps(c, _mm512_castsi512_ps(m));
  return _mm512_and_si512(_mm512_castps_si512(sum), _mm512_set1_epi32(0x7FFFFF));
}

// ---------------------------------------------------------------------------- Block64
// 64 consecutive elements. mag[s] lane j holds element element_of<T>(s, j): bf16 splits
// each 32-bit pair into its even and odd element (one shift or mask each), fp32 and fp16
// keep the natural order. key[] holds |x| bits in element order: two vectors of 32 16-bit
// lanes (bf16, fp16) or four of 16 32-bit lanes (fp32). Byte q of `top` is the top byte
// of element q: its bit 7 is the sign.
template <InType T>
struct Block64 {
  __m512 mag[4];
  __m512i key[4];
  __m512i top;
};

template <InType T>
constexpr int element_of(int s, int j) {
  if constexpr (T == InType::BF16) return (s / 2) * 32 + 2 * j + (s % 2);
  return 16 * s + j;
}

// vpermt2b index of the top byte of each of 64 elements (fp32: of 32, twice, for the two
// halves of the block).
template <InType T>
struct TopIndex {
  alignas(64) uint8_t idx[64];
  constexpr TopIndex() : idx{} {
    for (int q = 0; q < 64; ++q) idx[q] = static_cast<uint8_t>(T == InType::F32 ? (4 * q + 3) & 127 : 2 * q + 1);
  }
};

template <InType T>
ENGINE_INLINE __m512i top_bytes_index() {
  static constexpr TopIndex<T> index{};
  return _mm512_load_si512(index.idx);
}

// Elements [i, i + n) of base (n <= 64; missing elements read as +0).
template <InType T>
ENGINE_INLINE Block64<T> load64(const void* base, int64_t i, int64_t n) {
  Block64<T> b;
  if constexpr (T == InType::F32) {
    const float* p = static_cast<const float*>(base) + i;
    __m512 x[4];
    for (int s = 0; s < 4; ++s)
      x[s] = n >= 64 ? _mm512_loadu_ps(p + 16 * s) : _mm512_maskz_loadu_ps(first16(n - 16 * s), p + 16 * s);
    for (int s = 0; s < 4; ++s) {
      b.key[s] = _mm512_and_si512(_mm512_castps_si512(x[s]), _mm512_set1_epi32(0x7FFFFFFF));
      b.mag[s] = _mm512_castsi512_ps(b.key[s]);
    }
    // the top byte of element q is byte 4q + 3 of the 256 input bytes: two lookups of 128
    const __m512i top_index = top_bytes_index<T>();
    const __m512i lo = _mm512_permutex2var_epi8(_mm512_castps_si512(x[0]), top_index, _mm512_castps_si512(x[1]));
    const __m512i hi = _mm512_permutex2var_epi8(_mm512_castps_si512(x[2]), top_index, _mm512_castps_si512(x[3]));
    b.top = _mm512_mask_blend_epi8(0xFFFFFFFF00000000ull, lo, hi);
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(base) + i;
    __m512i raw[2];
    for (int h = 0; h < 2; ++h)
      raw[h] = n >= 64 ? _mm512_loadu_si512(p + 32 * h) : _mm512_maskz_loadu_epi16(first32(n - 32 * h), p + 32 * h);
    for (int h = 0; h < 2; ++h) b.key[h] = _mm512_and_si512(raw[h], _mm512_set1_epi16(0x7FFF));
    b.key[2] = b.key[3] = _mm512_setzero_si512();
    // the top byte of element q is byte 2q + 1 of the 128 input bytes
    const __m512i top_index = top_bytes_index<T>();
    b.top = _mm512_permutex2var_epi8(raw[0], top_index, raw[1]);
    for (int h = 0; h < 2; ++h) {
      if constexpr (T == InType::BF16) {
        b.mag[2 * h] = _mm512_castsi512_ps(_mm512_slli_epi32(b.key[h], 16));
        const __m512i high_halves = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
        b.mag[2 * h + 1] = _mm512_castsi512_ps(_mm512_and_si512(b.key[h], high_halves));
      } else {
        b.mag[2 * h] = _mm512_cvtph_ps(_mm512_castsi512_si256(b.key[h]));
        b.mag[2 * h + 1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(b.key[h], 1));
      }
    }
  }
  return b;
}

// Only the |x| keys of elements [i, i + n), in the layout of Block64::key.
template <InType T>
ENGINE_INLINE void load_keys64(const void* base, int64_t i, int64_t n, __m512i key[4]) {
  if constexpr (T == InType::F32) {
    const float* p = static_cast<const float*>(base) + i;
    for (int s = 0; s < 4; ++s) {
      const __m512i x =
          n >= 64 ? _mm512_loadu_si512(p + 16 * s) : _mm512_maskz_loadu_epi32(first16(n - 16 * s), p + 16 * s);
      key[s] = _mm512_and_si512(x, _mm512_set1_epi32(0x7FFFFFFF));
    }
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(base) + i;
    for (int h = 0; h < 2; ++h) {
      const __m512i x =
          n >= 64 ? _mm512_loadu_si512(p + 32 * h) : _mm512_maskz_loadu_epi16(first32(n - 32 * h), p + 32 * h);
      key[h] = _mm512_and_si512(x, _mm512_set1_epi16(0x7FFF));
    }
    key[2] = key[3] = _mm512_setzero_si512();
  }
}

// Lane-wise max of keys (16-bit lanes for bf16/fp16, 32-bit for fp32).
template <InType T>
ENGINE_INLINE __m512i key_max(__m512i a, __m512i b) {
  if constexpr (is16(T)) return _mm512_max_epu16(a, b);
  return _mm512_max_epu32(a, b);
}

// All the keys of a Block64 folded into one vector.
template <InType T>
ENGINE_INLINE __m512i fold_keys(const __m512i key[4]) {
  if constexpr (is16(T)) return _mm512_max_epu16(key[0], key[1]);
  return _mm512_max_epu32(_mm512_max_epu32(key[0], key[1]), _mm512_max_epu32(key[2], key[3]));
}

// 16-bit keys (one per 32-bit lane, zero-extended) -> fp32 |x| bits.
template <InType T>
ENGINE_INLINE __m512i keys16_to_f32(__m512i k) {
  if constexpr (T == InType::BF16) return _mm512_slli_epi32(k, 16);
  return _mm512_castps_si512(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(k)));
}

// max over a folded key vector, as an fp32 key.
template <InType T>
ENGINE_INLINE uint32_t scalar_key(__m512i folded) {
  if constexpr (is16(T)) {
    const __m512i wide =
        _mm512_max_epu32(_mm512_and_si512(folded, _mm512_set1_epi32(0xFFFF)), _mm512_srli_epi32(folded, 16));
    const uint16_t k16 = static_cast<uint16_t>(_mm512_reduce_max_epu32(wide));
    return f32_bits(load_f32<T>(&k16, 0)) & 0x7FFFFFFFu;
  }
  return _mm512_reduce_max_epu32(folded);
}

// Per-element keys of 64 columns (the layout of Block64::key) -> four vectors of fp32
// keys for columns 16g..16g+15.
template <InType T>
ENGINE_INLINE void column_keys_f32(const __m512i key[4], __m512i out[4]) {
  if constexpr (is16(T)) {
    for (int h = 0; h < 2; ++h) {
      for (int q = 0; q < 2; ++q) {
        const __m256i half = q == 0 ? _mm512_castsi512_si256(key[h]) : _mm512_extracti64x4_epi64(key[h], 1);
        if constexpr (T == InType::BF16) {
          out[2 * h + q] = _mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16);
        } else {
          out[2 * h + q] = _mm512_castps_si512(_mm512_cvtph_ps(half));
        }
      }
    }
  } else {
    for (int g = 0; g < 4; ++g) out[g] = key[g];
  }
}

// Sixteen key vectors -> one vector whose lane i is the max over vector i (16-bit keys
// come out zero-extended in 32-bit lanes). Four rounds of "fold two vectors into one".
template <InType T>
ENGINE_INLINE __m512i reduce16(const __m512i v[16]) {
  __m512i w[8], x[4], y[2];
  for (int k = 0; k < 8; ++k)  // halves: 256-bit lane 0 <- v[2k], lane 1 <- v[2k+1]
    w[k] = key_max<T>(_mm512_shuffle_i32x4(v[2 * k], v[2 * k + 1], 0x44),
                      _mm512_shuffle_i32x4(v[2 * k], v[2 * k + 1], 0xEE));
  for (int k = 0; k < 4; ++k)  // 128-bit lane l <- vector 4k + l
    x[k] = key_max<T>(_mm512_shuffle_i32x4(w[2 * k], w[2 * k + 1], 0x88),
                      _mm512_shuffle_i32x4(w[2 * k], w[2 * k + 1], 0xDD));
  for (int k = 0; k < 2; ++k)  // lane l: qword 0 <- vector 8k + l, qword 1 <- vector 8k + 4 + l
    y[k] = key_max<T>(_mm512_unpacklo_epi64(x[2 * k], x[2 * k + 1]), _mm512_unpackhi_epi64(x[2 * k], x[2 * k + 1]));
  // lane l, dword m <- vector 4m + l
  const __m512 a = _mm512_castsi512_ps(y[0]), b = _mm512_castsi512_ps(y[1]);
  __m512i z = key_max<T>(_mm512_castps_si512(_mm512_shuffle_ps(a, b, 0x88)),
                         _mm512_castps_si512(_mm512_shuffle_ps(a, b, 0xDD)));
  if constexpr (is16(T)) z = _mm512_max_epu32(_mm512_and_si512(z, _mm512_set1_epi32(0xFFFF)), _mm512_srli_epi32(z, 16));
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), z);
}

// ---------------------------------------------------------------------- packing bytes
// packus16(packs32(c0, c1), packs32(c2, c3)) puts c_s[j] at byte 16 (j / 4) + 4 s + j % 4;
// this vpermb index puts every element back at its position.
template <InType T>
struct PackOrder {
  alignas(64) uint8_t idx[64];
  constexpr PackOrder() : idx{} {
    for (int s = 0; s < 4; ++s)
      for (int j = 0; j < 16; ++j) idx[element_of<T>(s, j)] = static_cast<uint8_t>(16 * (j / 4) + 4 * s + j % 4);
  }
};

template <InType T>
ENGINE_INLINE __m512i pack_order() {
  static constexpr PackOrder<T> order{};
  return _mm512_load_si512(order.idx);
}

// Codes of the four magnitude vectors -> 64 bytes in element order; the saturating packs
// turn NaN into 0xFF (0x7FFF after the signed one) and leave every other code below 0x80,
// and one bit select keeps 7 code bits (0x7F for NaN) and takes bit 7 from `top` (the
// input's sign) unless the code is NaN: NaN is the canonical 0x7F whatever its sign.
template <Fp8Kind K>
ENGINE_INLINE __m512i fp8_bytes(const __m512 mag[4], __m512i order, __m512i top) {
  const __m512i w01 = _mm512_packs_epi32(magnitude_codes<K>(mag[0]), magnitude_codes<K>(mag[1]));
  const __m512i w23 = _mm512_packs_epi32(magnitude_codes<K>(mag[2]), magnitude_codes<K>(mag[3]));
  const __m512i b = _mm512_permutexvar_epi8(order, _mm512_packus_epi16(w01, w23));
  return _mm512_ternarylogic_epi32(b, top, _mm512_set1_epi8(0x7F), 0xA4);  // (b & 0x7F) | (top & ~b & 0x80)
}

// Scales for 64 columns (col[0..63]) in the lane order of Block64::mag.
template <InType T>
ENGINE_INLINE void scales_in_block_order(const float* col, __m512 out[4]) {
  if constexpr (T == InType::BF16) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int h = 0; h < 2; ++h) {
      const __m512 lo = _mm512_loadu_ps(col + 32 * h), hi = _mm512_loadu_ps(col + 32 * h + 16);
      out[2 * h] = _mm512_permutex2var_ps(lo, even, hi);
      out[2 * h + 1] = _mm512_permutex2var_ps(lo, odd, hi);
    }
  } else {
    for (int s = 0; s < 4; ++s) out[s] = _mm512_loadu_ps(col + 16 * s);
  }
}

ENGINE_INLINE void store64(uint8_t* dst, __m512i v, int64_t n) {
  if (n >= 64) {
    _mm512_storeu_si512(dst, v);
  } else {
    _mm512_mask_storeu_epi8(dst, first64(n), v);
  }
}

// The same, bypassing the caches for a whole aligned line: the strided 64-byte pieces of
// a 64-row region would otherwise be read for ownership and evicted one by one. The
// kernel that uses it ends with _mm_sfence().
ENGINE_INLINE void store64_stream(uint8_t* dst, __m512i v, int64_t n) {
  if (n >= 64 && (reinterpret_cast<uintptr_t>(dst) & 63) == 0) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), v);
  } else {
    store64(dst, v, n);
  }
}

// -------------------------------------------------------------------- 64x64 byte transpose
// Two steps of in-lane unpacks and 128-bit lane shuffles (cheaper than two-source
// permutes): a 64-bit element transpose across row groups, then 8x8 byte transposes
// inside each 64-bit lane.

// 8x8 transpose of 64-bit elements: out[j] element k = in[k] element j.
ENGINE_INLINE void transpose8_qwords(const __m512i in[8], __m512i out[8]) {
  __m512i t[8], u[8];
  for (int k = 0; k < 4; ++k) {  // 128-bit lane l: (in[2k][2l], in[2k+1][2l]) and (.. [2l+1] ..)
    t[2 * k] = _mm512_unpacklo_epi64(in[2 * k], in[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi64(in[2 * k], in[2 * k + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // rows 4h..4h+3, columns {j, j + 4} per register
    u[4 * h + 0] = _mm512_shuffle_i64x2(t[4 * h], t[4 * h + 2], 0x88);
    u[4 * h + 1] = _mm512_shuffle_i64x2(t[4 * h], t[4 * h + 2], 0xDD);
    u[4 * h + 2] = _mm512_shuffle_i64x2(t[4 * h + 1], t[4 * h + 3], 0x88);
    u[4 * h + 3] = _mm512_shuffle_i64x2(t[4 * h + 1], t[4 * h + 3], 0xDD);
  }
  out[0] = _mm512_shuffle_i64x2(u[0], u[4], 0x88);
  out[4] = _mm512_shuffle_i64x2(u[0], u[4], 0xDD);
  out[2] = _mm512_shuffle_i64x2(u[1], u[5], 0x88);
  out[6] = _mm512_shuffle_i64x2(u[1], u[5], 0xDD);
  out[1] = _mm512_shuffle_i64x2(u[2], u[6], 0x88);
  out[5] = _mm512_shuffle_i64x2(u[2], u[6], 0xDD);
  out[3] = _mm512_shuffle_i64x2(u[3], u[7], 0x88);
  out[7] = _mm512_shuffle_i64x2(u[3], u[7], 0xDD);
}

// Eight 8x8 byte transposes, one per 64-bit lane i: out[c] byte 8i + r = in[r] byte 8i + c.
ENGINE_INLINE void transpose8_bytes_in_qwords(const __m512i in[8], __m512i out[8]) {
  __m512i a[8], b[8], c[8];
  for (int k = 0; k < 4; ++k) {  // bytes of rows 2k, 2k+1 interleaved; lo: even lanes, hi: odd lanes
    a[k] = _mm512_unpacklo_epi8(in[2 * k], in[2 * k + 1]);
    a[4 + k] = _mm512_unpackhi_epi8(in[2 * k], in[2 * k + 1]);
  }
  for (int h = 0; h < 2; ++h) {
    for (int k = 0; k < 2; ++k) {
      b[4 * h + k] = _mm512_unpacklo_epi16(a[4 * h + 2 * k], a[4 * h + 2 * k + 1]);
      b[4 * h + 2 + k] = _mm512_unpackhi_epi16(a[4 * h + 2 * k], a[4 * h + 2 * k + 1]);
    }
  }
  for (int h = 0; h < 4; ++h) {
    c[2 * h] = _mm512_unpacklo_epi32(b[2 * h], b[2 * h + 1]);
    c[2 * h + 1] = _mm512_unpackhi_epi32(b[2 * h], b[2 * h + 1]);
  }
  for (int k = 0; k < 4; ++k) {  // even and odd lanes back together
    out[2 * k] = _mm512_unpacklo_epi64(c[k], c[4 + k]);
    out[2 * k + 1] = _mm512_unpackhi_epi64(c[k], c[4 + k]);
  }
}

// Transposes the 64x64 byte tile `tile` (row r at tile + 64 r) and stores row c of the
// result (= column c of the tile) to dst + c * ld_dst, for c < cols, keeping the first
// `rows` bytes of each; whole aligned lines bypass the caches when `stream` (then _mm_sfence after).
inline void transpose64_store(const uint8_t* tile, int64_t rows, int64_t cols, uint8_t* dst, int64_t ld_dst,
                              bool stream = true) {
  // Step 1: S[ri][j] qword i = tile row 8i+ri, qword j (row ri of the 8x8 block (i, j)).
  __m512i S[8][8];
  for (int ri = 0; ri < 8; ++ri) {
    __m512i in[8];
    for (int i = 0; i < 8; ++i) in[i] = _mm512_load_si512(tile + 64 * (8 * i + ri));
    transpose8_qwords(in, S[ri]);
  }
  // Step 2: for block column j, result cj byte 8i+ri = tile[8i+ri][8j+cj].
  for (int j = 0; j < 8 && 8 * j < cols; ++j) {
    __m512i in[8], out[8];
    for (int ri = 0; ri < 8; ++ri) in[ri] = S[ri][j];
    transpose8_bytes_in_qwords(in, out);
    for (int cj = 0; cj < 8 && 8 * j + cj < cols; ++cj) {
      if (stream) {
        store64_stream(dst + (8 * j + cj) * ld_dst, out[cj], rows);
      } else {
        store64(dst + (8 * j + cj) * ld_dst, out[cj], rows);
      }
    }
  }
}

// Asks for the cache lines of elements [i, i + 64) (into L2): the kernels fetch the next
// work unit while they cast the current one. Strided walks over 64-row regions have too
// many streams for the hardware prefetchers, and two-pass units (amax, then cast) would
// otherwise wait for memory in every amax pass.
template <InType T>
ENGINE_INLINE void prefetch64(const void* base, int64_t i) {
  constexpr int kBytes = T == InType::F32 ? 256 : 128;
  const char* p = static_cast<const char*>(base) + i * (kBytes / 64);
  for (int l = 0; l < kBytes; l += 64) __builtin_prefetch(p + l, 0, 2);  // read, into L2 (prefetcht1)
}

// Element offset from the current work unit to the next one the same thread will take
// (see bindings.cpp): the next unit along the row, or the first one of the next strip.
ENGINE_INLINE int64_t next_unit_offset(int64_t c0, int64_t c1, int64_t c_end, int64_t rows, int64_t ld) {
  return c1 < c_end ? c1 - c0 : rows * ld - c0;
}

}  // namespace
}  // namespace engine_native
