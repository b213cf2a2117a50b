// MXFP4 / MXFP6 quantize with AVX-512 intrinsics (F, BW, DQ, VL, VBMI) and BMI2 by the target pragma below,
// whatever flags the build uses; called only after a CPUID check (kernels_mx_small.cpp). The rules are those of
// mx_small_kernels.h (and engine/ops/mx_elements.py): this file computes the same bits 16 lanes at a time.
//
// Work goes in segments: 32 rows (one columnwise block) x up to 4096 columns (a run of the glue's tiles in one
// strip; a whole strip of a 4096-wide x is one contiguous read), each read twice:
//   pass 1, from memory, in order: |x| keys -> the column amaxes (a running max per column) and the amax of
//            each 1x32 block (a transposing max-reduction, 16 blocks at a time) -> both usages' E8M0 codes,
//            multipliers 2^(127 - code) and field offsets kneg;
//   pass 2, from L2 (cast_rows): each row cast twice, with its blocks' and with the columns' multipliers, while
//            the next segment is prefetched; codes leave as whole 64-byte lines written around the caches.
// The cast (chunk_sums) is the magic-number rounding of mx_small_kernels.h `encode`, with the magic number
// looked up by the product's exponent field above emin's (x's field - kneg, one saturating 16-bit subtract for
// 32 bf16 lanes) and the scaling and rounding fused in one fma; each code is then the low byte of its fp32 lane,
// gathered into bytes (fp6_codes) or, for E2M1, even and odd elements gathered apart and merged into nibbles
// with one rotate (e2m1_codes). A segment with a block the fast path does not take (`unusual`: NaN and inf
// scale codes, E3M2 blocks of amax below 2^-120) runs the scalar `tile` instead.
#include <cstdint>

#include "cast/mx_small.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi,bmi2"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi,bmi2")
#endif

#define MX_SMALL_NAMESPACE mx_small_avx512
#define MX_SMALL_OWN_ENTRY 1
#include "cast/mx_small_kernels.h"

namespace engine_native {
namespace mx_small_avx512 {
namespace {

#define MX_INLINE inline __attribute__((always_inline))

MX_INLINE __mmask64 first64(int64_t n) { return n >= 64 ? ~0ull : n <= 0 ? 0 : ((1ull << n) - 1ull); }
MX_INLINE __mmask32 first32(int64_t n) { return static_cast<__mmask32>(first64(n < 32 ? n : 32)); }
MX_INLINE __mmask16 first16(int64_t n) { return static_cast<__mmask16>(first64(n < 16 ? n : 16)); }

// ------------------------------------------------------------------------------------ constants
// A chunk's 64 elements sit in four fp32 vectors in "pair order": x[2h] holds the even elements of the
// h-th 32 (lane j: element 32h + 2j), x[2h + 1] the odd ones. That is the order in which bf16 pairs split
// (a shift and a mask), and the one in which E2M1 nibble pairs meet.
struct Tables {
  alignas(64) uint8_t gather[64];   // vpermt2b: byte q <- low byte of element q (q mod 32) of (x[2h], x[2h+1])
  alignas(64) uint8_t top_bf16[64]; // vpermt2b: byte q <- top byte of bf16 element q (byte 2q + 1)
  alignas(64) uint8_t top_f32[64];  // vpermt2b: byte q <- top byte of fp32 element q of 32 (byte 4q + 3)
  alignas(64) uint8_t pack[64];     // vpermt2b: byte p <- low byte of lane p mod 16 of (a, b), a for p mod 32 < 16
  alignas(64) uint32_t even[16], odd[16];  // vpermt2ps: even / odd elements of 32 fp32 lanes
  alignas(64) uint32_t reduce_order[16];
  constexpr Tables() : gather{}, top_bf16{}, top_f32{}, pack{}, even{}, odd{}, reduce_order{} {
    for (int q = 0; q < 64; ++q) {
      const int e = q & 31;
      gather[q] = static_cast<uint8_t>((e & 1 ? 64 : 0) + 4 * (e >> 1));
      top_bf16[q] = static_cast<uint8_t>(2 * q + 1);
      top_f32[q] = static_cast<uint8_t>((4 * q + 3) & 127);
      pack[q] = static_cast<uint8_t>((q & 16 ? 64 : 0) + 4 * (q & 15));
    }
    for (int j = 0; j < 16; ++j) {
      even[j] = static_cast<uint32_t>(2 * j);
      odd[j] = static_cast<uint32_t>(2 * j + 1);
      reduce_order[j] = static_cast<uint32_t>(4 * (j % 4) + j / 4);
    }
  }
};
constexpr Tables kTables{};

MX_INLINE __m512i load_table(const void* p) { return _mm512_load_si512(p); }

// The cast's magic numbers by g = max(the product's exponent field - emin's field, 0): those of
// mx_small_kernels.h `encode` (g = 0 for products below the smallest normal).
template <typename F>
struct Magic {
  alignas(64) uint32_t m[16];
  constexpr Magic() : m{} {
    static_assert(F::kMaxField - F::kMinField < 16, "binades must fit a 16-entry table");
    for (uint32_t g = 0; g <= F::kMaxField - F::kMinField; ++g)
      m[g] = ((g + F::kMinField + 23u - F::kMant) << 23) + (g << F::kMant);
  }
};

// The loop-invariant vectors of a cast.
template <typename F>
struct CastConsts {
  __m512i magic, gather, max_code, sign_bit;
  MX_INLINE CastConsts() {
    static constexpr Magic<F> magic_table{};
    magic = load_table(magic_table.m);
    gather = load_table(F::kBits == 4 ? kTables.pack : kTables.gather);
    max_code = _mm512_set1_epi8(static_cast<char>((1u << (F::kBits - 1)) - 1u));
    sign_bit = _mm512_set1_epi8(static_cast<char>(1u << (F::kBits - 1)));
  }
};

// ------------------------------------------------------------------------------------ the cast
// One chunk of 64 elements of x: |x| in fp32 in "pair order" (mag[2h] lane j: element 32h + 2j, mag[2h + 1]:
// element 32h + 2j + 1; the order in which bf16 pairs split, with a shift and a mask), the fp32 exponent field
// of each |x| in 16-bit lanes in element order (0 for zeros and subnormals), x's top bytes (the sign in
// bit 7) in element order (FP6) and the sign bits (bit q: element q; E2M1).
struct Chunk {
  __m512 mag[4];
  __m512i field[2];
  __m512i top;
  uint64_t signs;
};

// The fma sums of the 64 elements of `ch` scaled by s (pair order; powers of two): the code of each element
// in the low byte of its lane (the bits above, up to the exponent, are zero). kneg (16-bit lanes, element
// order) is emin's field - min(127 - scale code, emin's field) >= 0, so g = max(field - kneg, 0) (one
// saturating subtract) is max(the exponent field of |x| * s - emin's field, 0), which picks the magic number
// M. One fma gives |x| * s + M rounded once: |x| * s is exact (a power of two), or, below fp32's normals, far
// below half an element step, where it rounds to M either way. Never above the top binade (the scale rules
// bound |x| * s below 2^(emax + 1)), the code is at most one above the largest (FLOOR scales only: RCEIL's
// bound |x| * s below max (1 + 2^-23), which never rounds up past max).
template <typename F>
MX_INLINE void chunk_sums(const Chunk& ch, const __m512 s[4], const __m512i kneg[2], const CastConsts<F>& c,
                          __m512i sums[4]) {
  for (int h = 0; h < 2; ++h) {
    const __m512i g = _mm512_subs_epu16(ch.field[h], kneg[h]);
    const __m512i m_even = _mm512_permutexvar_epi32(g, c.magic);  // vpermd reads the low 4 bits of each lane
    const __m512i m_odd = _mm512_permutexvar_epi32(_mm512_srli_epi32(g, 16), c.magic);
    sums[2 * h] = _mm512_castps_si512(_mm512_fmadd_ps(ch.mag[2 * h], s[2 * h], _mm512_castsi512_ps(m_even)));
    sums[2 * h + 1] = _mm512_castps_si512(_mm512_fmadd_ps(ch.mag[2 * h + 1], s[2 * h + 1], _mm512_castsi512_ps(m_odd)));
  }
}

// FP6: the 64 codes of `sums` as bytes in element order, signs from `signs` (x's sign bits at bit bits - 1).
template <typename F, bool RCEIL>
MX_INLINE __m512i fp6_codes(const __m512i sums[4], __m512i signs, const CastConsts<F>& c) {
  const __m512i lo = _mm512_maskz_permutex2var_epi8(0x00000000FFFFFFFFull, sums[0], c.gather, sums[1]);
  const __m512i hi = _mm512_maskz_permutex2var_epi8(0xFFFFFFFF00000000ull, sums[2], c.gather, sums[3]);
  if constexpr (RCEIL) return _mm512_ternarylogic_epi32(lo, hi, signs, 0xFE);  // lo | hi | signs
  return _mm512_or_si512(_mm512_min_epu8(_mm512_or_si512(lo, hi), c.max_code), signs);
}

// E2M1: the 128 codes of two chunks' sums (a, b) packed two per byte (element 2p in the low nibble of byte p).
// Even and odd elements are gathered apart (E, O: byte p <- element 2p, 2p + 1); `signs` holds, in byte p, the
// sign of element 2p + 1 at bit 3 and that of element 2p' at bit 7, p' the next byte of p's 32-bit lane
// (cyclically). Rotating each 32-bit lane of O | signs left by 4 moves O's code and sign to the high nibble and
// each bit 7 to bit 3 of the next byte, where it is the sign of that byte's even element.
template <typename F, bool RCEIL>
MX_INLINE __m512i e2m1_codes(const __m512i a[4], const __m512i b[4], __m512i signs, const CastConsts<F>& c) {
  const __m512i even_a = _mm512_maskz_permutex2var_epi8(0x00000000FFFFFFFFull, a[0], c.gather, a[2]);
  const __m512i even_b = _mm512_maskz_permutex2var_epi8(0xFFFFFFFF00000000ull, b[0], c.gather, b[2]);
  const __m512i odd_a = _mm512_maskz_permutex2var_epi8(0x00000000FFFFFFFFull, a[1], c.gather, a[3]);
  const __m512i odd_b = _mm512_maskz_permutex2var_epi8(0xFFFFFFFF00000000ull, b[1], c.gather, b[3]);
  if constexpr (RCEIL) {
    const __m512i odd = _mm512_rol_epi32(_mm512_ternarylogic_epi32(odd_a, odd_b, signs, 0xFE), 4);
    return _mm512_ternarylogic_epi32(even_a, even_b, odd, 0xFE);
  }
  const __m512i odd = _mm512_min_epu8(_mm512_or_si512(odd_a, odd_b), c.max_code);
  const __m512i even = _mm512_min_epu8(_mm512_or_si512(even_a, even_b), c.max_code);
  return _mm512_or_si512(even, _mm512_rol_epi32(_mm512_or_si512(odd, signs), 4));
}

// The `signs` of e2m1_codes from the sign bits of 128 elements (lo: elements 0-63, hi: 64-127).
MX_INLINE __m512i e2m1_signs(uint64_t lo, uint64_t hi) {
  constexpr uint64_t kEven = 0x5555555555555555ull;
  const uint64_t even = _pext_u64(lo, kEven) | (_pext_u64(hi, kEven) << 32);  // bit p: element 2p
  const uint64_t odd = _pext_u64(lo, ~kEven) | (_pext_u64(hi, ~kEven) << 32);  // bit p: element 2p + 1
  const uint64_t next = ((even >> 1) & 0x7777777777777777ull) | ((even << 3) & 0x8888888888888888ull);
  const __m512i v = _mm512_maskz_mov_epi8(odd, _mm512_set1_epi8(0x08));
  return _mm512_mask_add_epi8(v, next, v, _mm512_set1_epi8(static_cast<char>(0x80)));  // bit 7 is clear in v
}

// 64 bytes at dst, around the caches when the line is whole and aligned (no read for ownership of output
// lines; the kernel ends with an sfence), n < 64: the first n only.
MX_INLINE void store64(uint8_t* dst, __m512i v, int64_t n) {
  if (n >= 64) {
    if ((reinterpret_cast<uintptr_t>(dst) & 63) == 0) {
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), v);
    } else {
      _mm512_storeu_si512(dst, v);
    }
  } else if (n > 0) {
    _mm512_mask_storeu_epi8(dst, first64(n), v);
  }
}

// ------------------------------------------------------------------------------------ loading x
// Elements [i, i + n) of x (n <= 64; the rest read as +0) as a Chunk: with the sign bits (SIGNS, E2M1) or the
// top bytes (FP6).
template <bool BF16, bool SIGNS>
MX_INLINE Chunk load_chunk(const void* base, int64_t i, int64_t n) {
  Chunk ch;
  ch.signs = 0;
  if constexpr (BF16) {
    const uint16_t* p = static_cast<const uint16_t*>(base) + i;
    __m512i raw[2];
    for (int h = 0; h < 2; ++h)
      raw[h] = n >= 64 ? _mm512_loadu_si512(p + 32 * h) : _mm512_maskz_loadu_epi16(first32(n - 32 * h), p + 32 * h);
    for (int h = 0; h < 2; ++h) {
      const __m512i key = _mm512_and_si512(raw[h], _mm512_set1_epi16(0x7FFF));
      ch.mag[2 * h] = _mm512_castsi512_ps(_mm512_slli_epi32(key, 16));
      ch.mag[2 * h + 1] = _mm512_castsi512_ps(_mm512_and_si512(key, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
      ch.field[h] = _mm512_srli_epi16(key, 7);
    }
    if constexpr (SIGNS) {
      ch.signs = _cvtmask32_u32(_mm512_movepi16_mask(raw[0])) |
                 (static_cast<uint64_t>(_cvtmask32_u32(_mm512_movepi16_mask(raw[1]))) << 32);
    } else {
      ch.top = _mm512_permutex2var_epi8(raw[0], load_table(kTables.top_bf16), raw[1]);
    }
  } else {
    const float* p = static_cast<const float*>(base) + i;
    __m512 raw[4];
    for (int s = 0; s < 4; ++s)
      raw[s] = n >= 64 ? _mm512_loadu_ps(p + 16 * s) : _mm512_maskz_loadu_ps(first16(n - 16 * s), p + 16 * s);
    const __m512i even = load_table(kTables.even), odd = load_table(kTables.odd);
    for (int h = 0; h < 2; ++h) {
      const __m512i e = _mm512_and_si512(_mm512_castps_si512(_mm512_permutex2var_ps(raw[2 * h], even, raw[2 * h + 1])),
                                         _mm512_set1_epi32(0x7FFFFFFF));
      const __m512i o = _mm512_and_si512(_mm512_castps_si512(_mm512_permutex2var_ps(raw[2 * h], odd, raw[2 * h + 1])),
                                         _mm512_set1_epi32(0x7FFFFFFF));
      ch.mag[2 * h] = _mm512_castsi512_ps(e);
      ch.mag[2 * h + 1] = _mm512_castsi512_ps(o);
      // 16-bit lane 2j (the low half of 32-bit lane j): element 2j's field; lane 2j + 1: element 2j + 1's
      ch.field[h] = _mm512_or_si512(_mm512_srli_epi32(e, 23), _mm512_and_si512(_mm512_srli_epi32(o, 7),
                                                                               _mm512_set1_epi32(0x00FF0000)));
    }
    if constexpr (SIGNS) {
      for (int s = 0; s < 4; ++s)
        ch.signs |= static_cast<uint64_t>(_cvtmask16_u32(_mm512_movepi32_mask(_mm512_castps_si512(raw[s])))) << (16 * s);
    } else {
      const __m512i top = load_table(kTables.top_f32);
      const __m512i lo = _mm512_permutex2var_epi8(_mm512_castps_si512(raw[0]), top, _mm512_castps_si512(raw[1]));
      const __m512i hi = _mm512_permutex2var_epi8(_mm512_castps_si512(raw[2]), top, _mm512_castps_si512(raw[3]));
      ch.top = _mm512_mask_blend_epi8(0xFFFFFFFF00000000ull, lo, hi);
    }
  }
  return ch;
}

// |x| keys of one chunk in element order: bf16 two vectors of 32 16-bit keys (key[2], key[3] unused), fp32
// four of 16 32-bit keys. A NaN's key is above every number's.
template <bool BF16>
MX_INLINE void load_keys(const void* base, int64_t i, int64_t n, __m512i key[4]) {
  if constexpr (BF16) {
    const uint16_t* p = static_cast<const uint16_t*>(base) + i;
    for (int h = 0; h < 2; ++h) {
      const __m512i raw =
          n >= 64 ? _mm512_loadu_si512(p + 32 * h) : _mm512_maskz_loadu_epi16(first32(n - 32 * h), p + 32 * h);
      key[h] = _mm512_and_si512(raw, _mm512_set1_epi16(0x7FFF));
    }
  } else {
    const float* p = static_cast<const float*>(base) + i;
    for (int s = 0; s < 4; ++s) {
      const __m512i raw =
          n >= 64 ? _mm512_loadu_si512(p + 16 * s) : _mm512_maskz_loadu_epi32(first16(n - 16 * s), p + 16 * s);
      key[s] = _mm512_and_si512(raw, _mm512_set1_epi32(0x7FFFFFFF));
    }
  }
}

template <bool BF16>
MX_INLINE __m512i key_max(__m512i a, __m512i b) {
  if constexpr (BF16) return _mm512_max_epu16(a, b);
  return _mm512_max_epu32(a, b);
}

// v[i] (16-bit or 32-bit keys) -> lane i = the max over v[i], as an fp32 |x| bit pattern. Folds pairs of
// vectors into one: 256-bit halves, 128-bit quarters, 64-bit and 32-bit words, (bf16) 16-bit halves.
template <bool BF16>
MX_INLINE __m512i reduce16(const __m512i v[16]) {
  __m512i a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // quarters 0,1 <- v[2i] folded with its quarters 2,3; quarters 2,3 <- v[2i+1]
    a[i] = key_max<BF16>(_mm512_shuffle_i64x2(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_i64x2(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // quarter l <- v[4i + l]
    b[i] = key_max<BF16>(_mm512_shuffle_i64x2(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_i64x2(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // quarter l: qword 0 <- v[8i + l], qword 1 <- v[8i + 4 + l]
    c[i] = key_max<BF16>(_mm512_unpacklo_epi64(b[2 * i], b[2 * i + 1]), _mm512_unpackhi_epi64(b[2 * i], b[2 * i + 1]));
  const __m512 lo = _mm512_castsi512_ps(c[0]), hi = _mm512_castsi512_ps(c[1]);
  __m512i d = key_max<BF16>(_mm512_castps_si512(_mm512_shuffle_ps(lo, hi, 0x88)),  // quarter l, dword m <- v[4m + l]
                            _mm512_castps_si512(_mm512_shuffle_ps(lo, hi, 0xDD)));
  if constexpr (BF16) {
    d = _mm512_max_epu32(_mm512_and_si512(d, _mm512_set1_epi32(0xFFFF)), _mm512_srli_epi32(d, 16));
    d = _mm512_slli_epi32(d, 16);
  }
  return _mm512_permutexvar_epi32(load_table(kTables.reduce_order), d);
}

// ------------------------------------------------------------------------------------ scales
// E8M0 codes of 16 amax keys: mx_small_kernels.h `scale_code`, lane-wise, where the fast path needs it: a code
// of 254 or more (an inf or NaN amax, or an amax * fp32(1 / max) at or above 2^127) only has to be one (it makes
// the block `unusual`, and the scalar tiles then write every code of the segment again). RCEIL: with d the
// product's bits, the exponent rounded up, d rounded up to a whole binade, is (d + 2^23 - 1) >> 23 for a normal
// d; a subnormal d rounds up to 2^-126 (code 1) only above 2^-127, (d + 2^22 - 1) >> 23.
template <typename F, bool RCEIL>
MX_INLINE __m512i scale_codes(__m512i key) {
  if constexpr (RCEIL) {
    const float rcp_max = static_cast<float>(1.0 / static_cast<double>(float_of(F::kMaxBits)));
    const __m512i d = _mm512_castps_si512(_mm512_mul_ps(_mm512_castsi512_ps(key), _mm512_set1_ps(rcp_max)));
    const __m512i half = _mm512_add_epi32(d, _mm512_set1_epi32(0x3FFFFF));
    const __mmask16 normal = _mm512_cmpge_epu32_mask(d, _mm512_set1_epi32(0x800000));
    return _mm512_srli_epi32(_mm512_mask_add_epi32(half, normal, half, _mm512_set1_epi32(0x400000)), 23);
  } else {
    const __m512i all = _mm512_set1_epi32(0xFF);
    const __m512i biased = _mm512_srli_epi32(key, 23);
    const __m512i code = _mm512_max_epi32(_mm512_sub_epi32(biased, _mm512_set1_epi32(F::kEmax)), _mm512_setzero_si512());
    return _mm512_mask_mov_epi32(code, _mm512_cmpeq_epu32_mask(biased, all), all);
  }
}

// 2^(127 - code) per lane for codes below 254 (the only ones the fast path casts with).
MX_INLINE __m512 element_scales(__m512i code) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_sub_epi32(_mm512_set1_epi32(254), code), 23));
}

// ------------------------------------------------------------------------------------ a segment
// A segment: rows [r0, r1) (one columnwise block) x columns [c0, c1), a run of whole tiles of one strip at
// most kSegCols wide. Pass 1 reads its rows in order (a contiguous stretch of x when the segment spans the
// whole width, which keeps the hardware prefetchers streaming); pass 2 reads them again from L2.
constexpr int64_t kSegCols = 16 * kTileCols;  // bf16: 256 KiB of x per segment (fp32 takes half as many columns)

template <bool BF16>
constexpr int64_t seg_cols() { return BF16 ? kSegCols : kSegCols / 2; }

// Scratch of one segment, on the stack of the thread that runs it.
struct Segment {
  alignas(64) __m512i col_key[kSegCols / 32];       // running column maxima: 16-bit keys (bf16) or 32-bit (fp32)
  alignas(64) __m512 col_scale[kSegCols / 16];      // column multipliers, pair order per 64 columns
  alignas(64) __m512i col_k[kSegCols / 32];         // field_offsets (kneg), 16-bit lanes, column order
  alignas(64) float row_scale[kBlock][kSegCols / kBlock];   // [row][block] multipliers
  alignas(64) int32_t row_k[kBlock][kSegCols / kBlock];     // [row][block] the same kneg, in both 16-bit halves
};

// kneg = emin's field - min(127 - code, emin's field) = max(code - (127 - emin's field), 0) (see chunk_sums) of 16
// scale codes: 0..253, one byte.
template <typename F>
MX_INLINE __m512i field_offsets(__m512i code) {
  return _mm512_max_epi32(_mm512_sub_epi32(code, _mm512_set1_epi32(127 - static_cast<int>(F::kMinField))),
                          _mm512_setzero_si512());
}

// Lanes whose block the fast path cannot take: scale code 254 (RCEIL's code of an inf: inf * 2^-127 is inf)
// or 255 (NaN: whole blocks of code 0), and blocks with nonzero elements where 127 - code is above the emin
// field (only E3M2, codes 0 and 1, amax below 2^-120: a subnormal x may then land above emin).
template <typename F>
MX_INLINE __mmask16 unusual(__m512i code, __m512i key) {
  const __mmask16 special = _mm512_cmpge_epu32_mask(code, _mm512_set1_epi32(254));
  if constexpr (127 - F::kMinField > 0) {
    return special | (_mm512_cmplt_epi32_mask(code, _mm512_set1_epi32(127 - static_cast<int>(F::kMinField))) &
                      _mm512_test_epi32_mask(key, key));
  }
  return special;
}

// Pass 2 of a segment (see fast_segment): rows [r0, r1), w columns from c0, cast with the scales of `seg` for
// the usages asked for (ROW, COL), two chunks (one 64-byte line of E2M1 codes) at a time.
template <typename F, bool BF16, bool RCEIL, bool ROW, bool COL>
void cast_rows(const MxSmallJob& job, const Segment& seg, int64_t r0, int64_t r1, int64_t c0, int64_t w, int64_t next) {
  constexpr bool kPacked = F::kBits == 4;
  const CastConsts<F> c;
  const int64_t K = job.K, ld = job.ld, kp = kPacked ? (K + 1) / 2 : K, chunks = (w + 63) / 64;
  const int64_t data_col = kPacked ? c0 / 2 : c0;
  const void* x = job.x;
  for (int64_t r = 0; r < r1 - r0; ++r) {
    const int64_t base = (r0 + r) * ld + c0, out = (r0 + r) * kp + data_col;
    const float* row_scale = seg.row_scale[r];
    const int32_t* row_k = seg.row_k[r];
    for (int64_t j = 0; j < chunks; j += 2) {
      __m512i row_sums[2][4], col_sums[2][4], row_codes[2], col_codes[2];
      uint64_t signs[2] = {0, 0};
      for (int q = 0; q < 2; ++q) {
        const int64_t i = j + q;
        if (i >= chunks) {  // past the end: zero sums (code 0)
          for (int l = 0; l < 4; ++l) row_sums[q][l] = col_sums[q][l] = _mm512_setzero_si512();
          row_codes[q] = col_codes[q] = _mm512_setzero_si512();
          break;
        }
        if (next) {
          const char* p = static_cast<const char*>(x) + (base + next + 64 * i) * (BF16 ? 2 : 4);
          for (int l = 0; l < (BF16 ? 128 : 256); l += 64) __builtin_prefetch(p + l, 0, 2);
        }
        const Chunk ch = load_chunk<BF16, kPacked>(x, base + 64 * i, w - 64 * i);
        signs[q] = ch.signs;
        __m512i tops = _mm512_setzero_si512();
        if constexpr (!kPacked) tops = _mm512_and_si512(_mm512_srli_epi16(ch.top, 8 - F::kBits), c.sign_bit);
        if constexpr (ROW) {
          const __m512 s0 = _mm512_set1_ps(row_scale[2 * i]), s1 = _mm512_set1_ps(row_scale[2 * i + 1]);
          const __m512 s[4] = {s0, s0, s1, s1};
          const __m512i k[2] = {_mm512_set1_epi32(row_k[2 * i]), _mm512_set1_epi32(row_k[2 * i + 1])};
          chunk_sums<F>(ch, s, k, c, row_sums[q]);
          if constexpr (!kPacked) row_codes[q] = fp6_codes<F, RCEIL>(row_sums[q], tops, c);
        }
        if constexpr (COL) {
          chunk_sums<F>(ch, &seg.col_scale[4 * i], &seg.col_k[2 * i], c, col_sums[q]);
          if constexpr (!kPacked) col_codes[q] = fp6_codes<F, RCEIL>(col_sums[q], tops, c);
        }
      }
      const int64_t at = out + (kPacked ? 32 : 64) * j, n = w - 64 * j;
      if constexpr (kPacked) {
        const __m512i sg = e2m1_signs(signs[0], signs[1]);
        if constexpr (ROW) store64(job.row_data + at, e2m1_codes<F, RCEIL>(row_sums[0], row_sums[1], sg, c), (n + 1) / 2);
        if constexpr (COL) store64(job.col_data + at, e2m1_codes<F, RCEIL>(col_sums[0], col_sums[1], sg, c), (n + 1) / 2);
      } else {
        if constexpr (ROW) {
          store64(job.row_data + at, row_codes[0], n);
          store64(job.row_data + at + 64, row_codes[1], n - 64);
        }
        if constexpr (COL) {
          store64(job.col_data + at, col_codes[0], n);
          store64(job.col_data + at + 64, col_codes[1], n - 64);
        }
      }
    }
  }
}

// Returns false, having written nothing but scale codes, when a block is `unusual` (the caller then runs the
// scalar tiles).
template <typename F, bool BF16, bool RCEIL>
bool fast_segment(const MxSmallJob& job, Segment& seg, int64_t r0, int64_t r1, int64_t c0, int64_t c1, int64_t next) {
  constexpr int kKeyVectors = BF16 ? 2 : 4;  // key vectors per 64 columns
  const int64_t K = job.K, ld = job.ld, rows = r1 - r0, w = c1 - c0;
  const int64_t nb = (K + kBlock - 1) / kBlock;
  const int64_t blocks = (w + kBlock - 1) / kBlock, chunks = (w + 63) / 64, groups = (w + 511) / 512;
  const void* x = job.x;
  __mmask16 slow = 0;  // lanes of `unusual` blocks (padding blocks, all zeros, never are)

  // ---- pass 1: keys -> both usages' codes and multipliers
  if (job.col_data) {
    for (int64_t j = 0; j < chunks * kKeyVectors; ++j) seg.col_key[j] = _mm512_setzero_si512();
  }
  // Row by row, 512 columns (16 blocks of the row, 8 chunks) per reduction.
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t base = (r0 + r) * ld + c0;
    for (int64_t g = 0; g < groups; ++g) {
      __m512i block_key[16];
#pragma GCC unroll 8
      for (int q = 0; q < 8; ++q) {
        const int64_t j = 8 * g + q;
        __m512i key[4];
        if (j < chunks) {
          load_keys<BF16>(x, base + 64 * j, w - 64 * j, key);
          if (job.col_data) {
            for (int s = 0; s < kKeyVectors; ++s) {
              __m512i& ck = seg.col_key[kKeyVectors * j + s];
              ck = key_max<BF16>(ck, key[s]);
            }
          }
        } else {
          for (auto& k : key) k = _mm512_setzero_si512();
        }
        if constexpr (BF16) {
          block_key[2 * q] = key[0];
          block_key[2 * q + 1] = key[1];
        } else {
          block_key[2 * q] = _mm512_max_epu32(key[0], key[1]);
          block_key[2 * q + 1] = _mm512_max_epu32(key[2], key[3]);
        }
      }
      if (job.row_data) {
        const __m512i key = reduce16<BF16>(block_key), code = scale_codes<F, RCEIL>(key);
        slow |= unusual<F>(code, key);
        _mm512_store_ps(&seg.row_scale[r][16 * g], element_scales(code));
        const __m512i k = field_offsets<F>(code);
        _mm512_store_si512(&seg.row_k[r][16 * g], _mm512_or_si512(k, _mm512_slli_epi32(k, 16)));
        _mm512_mask_cvtepi32_storeu_epi8(job.row_codes + (r0 + r) * nb + c0 / kBlock + 16 * g, first16(blocks - 16 * g),
                                         code);
      }
    }
  }
  if (job.col_data) {
    uint8_t* codes = job.col_codes + (r0 / kBlock) * K + c0;
    const __m512i even = load_table(kTables.even), odd = load_table(kTables.odd);
    for (int64_t j = 0; j < chunks; ++j) {
      __m512 natural[4];  // columns 64j + 16g + lane
      __m256i k16[4];
      for (int g = 0; g < 4; ++g) {
        __m512i key;
        if constexpr (BF16) {
          const __m512i k16 = seg.col_key[2 * j + g / 2];
          key = _mm512_slli_epi32(
              _mm512_cvtepu16_epi32(g % 2 ? _mm512_extracti64x4_epi64(k16, 1) : _mm512_castsi512_si256(k16)), 16);
        } else {
          key = seg.col_key[4 * j + g];
        }
        const __m512i code = scale_codes<F, RCEIL>(key);
        slow |= unusual<F>(code, key);
        _mm512_mask_cvtepi32_storeu_epi8(codes + 64 * j + 16 * g, first16(w - 64 * j - 16 * g), code);
        natural[g] = element_scales(code);
        k16[g] = _mm512_cvtepi32_epi16(field_offsets<F>(code));
      }
      seg.col_k[2 * j] = _mm512_inserti64x4(_mm512_castsi256_si512(k16[0]), k16[1], 1);
      seg.col_k[2 * j + 1] = _mm512_inserti64x4(_mm512_castsi256_si512(k16[2]), k16[3], 1);
      for (int h = 0; h < 2; ++h) {
        seg.col_scale[4 * j + 2 * h] = _mm512_permutex2var_ps(natural[2 * h], even, natural[2 * h + 1]);
        seg.col_scale[4 * j + 2 * h + 1] = _mm512_permutex2var_ps(natural[2 * h], odd, natural[2 * h + 1]);
      }
    }
  }
  if (slow) return false;

  // ---- pass 2: the casts
  if (job.row_data && job.col_data) {
    cast_rows<F, BF16, RCEIL, true, true>(job, seg, r0, r1, c0, w, next);
  } else if (job.row_data) {
    cast_rows<F, BF16, RCEIL, true, false>(job, seg, r0, r1, c0, w, next);
  } else {
    cast_rows<F, BF16, RCEIL, false, true>(job, seg, r0, r1, c0, w, next);
  }
  return true;
}

// Tiles [u0, u1) as segments: runs of tiles of one strip, at most seg_cols wide.
template <typename F, bool BF16, bool RCEIL>
void tiles(const MxSmallJob& job, int64_t u0, int64_t u1) {
  constexpr int64_t kTilesPerSeg = seg_cols<BF16>() / kTileCols;
  Segment seg;
  for (int64_t u = u0; u < u1;) {
    const TileBounds first = tile_bounds(job, u);
    int64_t v = u + 1;
    TileBounds last = first;
    while (v < u1 && v - u < kTilesPerSeg) {
      const TileBounds t = tile_bounds(job, v);
      if (t.r0 != first.r0) break;
      last = t;
      ++v;
    }
    // element offset of the next segment's start when this thread has one of as many rows (its lines are
    // prefetched at this segment's offsets: past a narrower one's end, harmlessly)
    int64_t next = 0;
    if (v < u1) {
      const TileBounds t = tile_bounds(job, v);
      if (t.r1 - t.r0 == first.r1 - first.r0) next = (t.r0 - first.r0) * job.ld + (t.c0 - first.c0);
    }
    if (!fast_segment<F, BF16, RCEIL>(job, seg, first.r0, first.r1, first.c0, last.c1, next)) {
      for (int64_t t = u; t < v; ++t) {
        const TileBounds b = tile_bounds(job, t);
        tile<F, BF16, RCEIL>(job, b.r0, b.r1, b.c0, b.c1);
      }
    }
    u = v;
  }
  _mm_sfence();  // the streaming stores are ordered before the caller reads the outputs
}

template <typename F>
void tiles_for(const MxSmallJob& job, int64_t u0, int64_t u1) {
  if (job.bf16) {
    return job.rceil ? tiles<F, true, true>(job, u0, u1) : tiles<F, true, false>(job, u0, u1);
  }
  return job.rceil ? tiles<F, false, true>(job, u0, u1) : tiles<F, false, false>(job, u0, u1);
}

}  // namespace

void mx_small_tiles(const MxSmallJob& job, int64_t u0, int64_t u1) {
  switch (job.kind) {
    case 0: return tiles_for<E2M1>(job, u0, u1);
    case 1: return tiles_for<E2M3>(job, u0, u1);
    default: return tiles_for<E3M2>(job, u0, u1);
  }
}

}  // namespace mx_small_avx512
}  // namespace engine_native

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace engine_native {
namespace mx_small_avx512 {
bool compiled() { return true; }  // outside the target pragma: callable on any CPU
}  // namespace mx_small_avx512
}  // namespace engine_native

#else  // no AVX-512 build on this compiler / architecture

namespace engine_native {
namespace mx_small_avx512 {
bool compiled() { return false; }
void mx_small_tiles(const MxSmallJob&, int64_t, int64_t) {}
}  // namespace mx_small_avx512
}  // namespace engine_native

#endif
