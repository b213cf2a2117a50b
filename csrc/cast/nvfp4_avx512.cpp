// The NVFP4 kernels compiled for AVX-512 (F, BW, DQ, VL, VBMI2) by the target pragma below, whatever flags the
// build uses; called only after a CPUID check (kernels_nvfp4.cpp). nvfp4_kernels.h (where the rules are written out)
// is compiled here too, for what the fast path below does not take: tiles holding an inf or NaN, and 16x16 tiles
// with stochastic rounding or with two tensor scales (given amaxes that differ). The fast path computes the same
// bits with intrinsics, a 16 x 128 tile at a time (16x16 tiles: one code per element for both usages):
//   keys:     |x| bits, read from x: the maxima of the 1x16 row blocks (a transposing max tree, 16 blocks per
//             vector) and of the columns; with the RHT, the columns' 16 tokens are transformed (the header's
//             butterflies, 16 lanes at a time) into an fp32 tile y;
//   scales:   E4M3 codes of 16 blocks at a time (the FP8 kernels' magic-number rounding, the rule of block_code),
//             their factors looked up (block_encode of each code, once per call); a tile whose scales are all
//             normal and unsaturated takes the element loop without the clamp at 6 (Scales::clamp_free_key);
//   elements: x re-read a 32-column group at a time, each 32-bit lane holding the bf16 pair (2j, 2j + 1) split
//             into an even and an odd fp32 vector (fp32 inputs: two permutes); each product is rounded by the
//             header's magic-number sum (e2m1_code3) for both usages (stochastic rounding: the counter's random
//             bytes hashed 16 lanes at a time, e2m1_sr_code reading the grid step off the fp32 bits), the
//             rowwise nibble pairs leave as bytes (vpmovdb) and the columnwise nibbles gather in two 32-bit words
//             per column (rows 0-7, 8-15),
//             stored per strip in the band buffer and transposed 8 x 8 into 64-byte column lines at its flush.
// Partial tiles are zero-padded (masked loads, code 0) and stored with masks or byte counts.
// 4over6 has no intrinsics path: nvfp4_4over6_kernels.h's vector code, compiled here for AVX-512.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "cast/nvfp4.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi2"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi2,prefer-vector-width=512")
#endif

#define ENGINE_AVX512_KERNELS 1
#include "cast/avx512_vec.h"

#define NVFP4_NAMESPACE nvfp4_avx512
#define NVFP4_OWN_ENTRY 1
#include "cast/nvfp4_kernels.h"

namespace engine_native {
namespace nvfp4_avx512 {
namespace {

using Vf = __m512;
using Vi = __m512i;

ENGINE_INLINE Vi bits(Vf v) { return _mm512_castps_si512(v); }
ENGINE_INLINE Vf flt(Vi v) { return _mm512_castsi512_ps(v); }
ENGINE_INLINE Vi u32(uint32_t v) { return _mm512_set1_epi32(static_cast<int>(v)); }
ENGINE_INLINE Vi or_and(Vi a, Vi b, Vi c) { return _mm512_ternarylogic_epi32(a, b, c, 0xF8); }  // a | (b & c)

// ------------------------------------------------------------------------------ tables
struct Tables {
  alignas(64) uint32_t magic[16];   // e2m1_code3: by the low 4 bits of the fp32 exponent field 125..129
  alignas(64) uint32_t even[16], odd[16];  // vpermt2ps: the even / odd elements of 32 fp32 lanes
  alignas(64) uint32_t block_order[16];    // the max tree's lane (4l + m: block 4m + l) of each block
  alignas(64) uint32_t interleave[2][16];  // vpermt2d: (e, o) -> natural order, elements 0-15 and 16-31
  alignas(64) uint32_t quad_rows[16];      // vpermd: 4 rows' packed bytes (see rows4) -> row m in dwords 4m..4m+3
  // SR, rowwise: element 2j + parity of a 32-element run whose first counter index j0 has j0 & 3 = a takes byte
  // 2j + parity + a of the run's mixes (word q: indices 4 (j0 >> 2) + 4q ..): its word and bit shift, [2a + parity]
  alignas(64) uint32_t sr_word[8][16], sr_shift[8][16];
  int8_t col_slot[32];  // column 2j + parity of a group: its qword in the group's column words (see band_cols)
  int8_t slot_col[32];  // the inverse
  constexpr Tables()
      : magic{}, even{}, odd{}, block_order{}, interleave{}, quad_rows{}, sr_word{}, sr_shift{}, col_slot{}, slot_col{} {
    for (uint32_t f = 125; f <= 129; ++f) {
      const uint32_t e = f < 127 ? 127 : f;  // nvfp4_kernels.h e2m1_magnitude: field max(f, 127)
      magic[f & 15] = ((e + 22u) << 23) + ((e - 127u) << 1);
    }
    for (uint32_t j = 0; j < 16; ++j) {
      even[j] = 2 * j;
      odd[j] = 2 * j + 1;
      block_order[j] = 4 * (j % 4) + j / 4;
      interleave[0][j] = (j % 2 ? 16 : 0) + j / 2;
      interleave[1][j] = (j % 2 ? 16 : 0) + 8 + j / 2;
      quad_rows[j] = 4 * (j % 4) + j / 4;
      for (uint32_t v = 0; v < 8; ++v) {
        const uint32_t byte = 2 * j + v % 2 + v / 2;
        sr_word[v][j] = byte / 4;
        sr_shift[v][j] = 8 * (byte % 4);
      }
    }
    for (int c = 0; c < 32; ++c) {  // unpacklo/hi_epi32(lo, hi) of lane j: qword 2 (j / 4) + j % 2 of lo / hi
      const int j = c / 2, parity = c % 2, hi = (j % 4) >= 2;
      col_slot[c] = static_cast<int8_t>(16 * parity + 8 * hi + 2 * (j / 4) + j % 2);
      slot_col[col_slot[c]] = static_cast<int8_t>(c);
    }
  }
};
constexpr Tables kTables{};

ENGINE_INLINE Vi table(const uint32_t* t) { return _mm512_load_si512(t); }

// ------------------------------------------------------------------------------ element rules
// e2m1_magnitude of min(|p|, 6) (p not NaN), in the low 3 bits of the result (bits 3-22 are zero, bits 23-30
// hold an exponent): c = max(|p|, 0.25) changes no code (0.25 is the tie that rounds to 0) and leaves five
// exponent fields 125..129, whose magic numbers one vpermd looks up. CLAMP false: the caller knows |p| < 7
// (tile_needs_clamp), where the field-129 sum already rounds to at most 6 (code 7), so the min is left out.
template <bool CLAMP = true>
ENGINE_INLINE Vi e2m1_code3(Vf p, Vi magic) {
  Vf c = _mm512_range_ps(p, _mm512_set1_ps(0.25f), 0x0B);  // max-abs, +
  if (CLAMP) c = _mm512_min_ps(c, _mm512_set1_ps(6.0f));
  const Vi m = _mm512_permutexvar_epi32(_mm512_srli_epi32(bits(c), 23), magic);
  return bits(_mm512_add_ps(c, flt(m)));
}

// low3 ? c : s bitwise (low3: bits 0-2 set): the code c's low 3 bits under the sign nibble s. c, which dies here,
// is the destination operand (0xE4 is 0xCA with the operands rotated), so no copy of low3 is made per call.
ENGINE_INLINE Vi low3_or(Vi c, Vi s, Vi low3) { return _mm512_ternarylogic_epi32(c, s, low3, 0xE4); }

// The top 4 bits of v (the sign at bit 3), shared by the usages' nibbles of the same element.
ENGINE_INLINE Vi sign_bits(Vf v) { return _mm512_srli_epi32(bits(v), 28); }

// 4 rows' nibbles (each lane below 16: low3_or of a code and its sign_bits), a (first), b, c, d, as bytes: two
// levels of unsigned saturating packs (nothing saturates) leave 128-bit lane L holding (a, b, c, d)'s lanes
// 4L..4L+3 as 4 dwords.
ENGINE_INLINE Vi pack4(const Vi* v) {
  return _mm512_packus_epi16(_mm512_packus_epi32(v[0], v[1]), _mm512_packus_epi32(v[2], v[3]));
}

// The rowwise bytes of 4 rows of a group (lo: the even elements' nibbles, hi: the odd ones', row m in [m]) as
// 4 x 16 bytes, row m in dwords 4m..4m+3: both packed (pack4), the odd nibbles shifted up within their bytes (a
// 16-bit shift: no byte exceeds 15), one vpermd gathering each row. Cheaper than a vpmovdb per row and a shift
// and an or per row's pairs.
ENGINE_INLINE Vi rows4(const Vi* lo, const Vi* hi) {
  const Vi bytes = _mm512_or_si512(pack4(lo), _mm512_slli_epi16(pack4(hi), 4));
  return _mm512_permutexvar_epi32(_mm512_load_si512(kTables.quad_rows), bytes);
}

// rows4's 4 rows of 16 bytes to row lines dst, dst + 64, dst + 128, dst + 192.
ENGINE_INLINE void store_quad(Vi q, uint8_t* dst) {
  _mm_store_si128(reinterpret_cast<__m128i*>(dst), _mm512_castsi512_si128(q));
  _mm_store_si128(reinterpret_cast<__m128i*>(dst + 64), _mm512_extracti32x4_epi32(q, 1));
  _mm_store_si128(reinterpret_cast<__m128i*>(dst + 128), _mm512_extracti32x4_epi32(q, 2));
  _mm_store_si128(reinterpret_cast<__m128i*>(dst + 192), _mm512_extracti32x4_epi32(q, 3));
}

// ------------------------------------------------------------------------------ stochastic rounding
// nvfp4_kernels.h e2m1_stochastic of p (finite) with rr = r + 1024 (r the random byte), in the low 3 bits of the
// result. The header's n = floor(a / step * 256) and code ((n + r) >> 8) + (0, 2, 4), read off fp32 bits: with
// a = min(|p|, 6) >= 1 (step 2^(e - 128) for exponent field e), bits(a) >> 14 = (e << 9) + floor(mantissa * 512)
// = n + 512 (e - 126), so ((bits(a) >> 14) + rr) >> 8 = code + 2 (e - 127) + 256 - 2 (e - 127) = code + 256. Below 1
// (step 0.5) the same on 8 + 8a rounded toward zero (one fma: exact but for the truncation, bits below 2^-9 * 8
// are dropped, exponent field 130): (130 << 9) + floor(a * 512) = n + 66560, giving code + 264. Both are the code
// mod 8. Exact: the scalings are by powers of 2, the fma rounds once.
ENGINE_INLINE Vi e2m1_sr_code(Vf p, Vi rr) {
  const Vf a = _mm512_range_ps(p, _mm512_set1_ps(6.0f), 0x0A);  // min-abs, sign cleared: min(|p|, 6)
  const __mmask16 below1 = _mm512_cmp_ps_mask(a, _mm512_set1_ps(1.0f), _CMP_LT_OQ);
  const Vf f = _mm512_mask_fmadd_round_ps(a, below1, _mm512_set1_ps(8.0f), _mm512_set1_ps(8.0f),
                                          _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  return _mm512_srli_epi32(_mm512_add_epi32(_mm512_srli_epi32(bits(f), 14), rr), 8);
}

// hash32 (nvfp4_kernels.h) of 16 lanes.
ENGINE_INLINE Vi hash16(Vi v) {
  v = _mm512_xor_si512(v, _mm512_srli_epi32(v, 16));
  v = _mm512_mullo_epi32(v, u32(0x7FEB352Du));
  v = _mm512_xor_si512(v, _mm512_srli_epi32(v, 15));
  v = _mm512_mullo_epi32(v, u32(0x846CA68Bu));
  return _mm512_xor_si512(v, _mm512_srli_epi32(v, 16));
}

// word_mix (nvfp4_kernels.h) of 16 lanes: the 4 random bytes of the words lo (hi keys hk).
ENGINE_INLINE Vi mix16(Vi lo, Vi hk) { return hash16(_mm512_xor_si512(hash16(lo), hk)); }

// rr of e2m1_sr_code: the byte of `mix` at bit `shift` + 1024 (the byte's bits below bit 8, bit 10 set).
ENGINE_INLINE Vi sr_rr(Vi mix, Vi shift) {
  return _mm512_ternarylogic_epi32(_mm512_srlv_epi32(mix, shift), u32(0xFF), u32(0x400), 0xEA);  // a & b | c
}

// The hi keys of lanes whose low index is lo, of a run whose first low index is lo0 (hk0: of its high half, hk1:
// of one more, for the lanes past a carry).
ENGINE_INLINE Vi carried(Vi lo, Vi lo0, Vi hk0, Vi hk1) {
  return _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(lo, lo0), hk0, hk1);
}

// w shifted down a nibble, the code c with the sign (sv: sign_bits, bit 3) in the top one (VBMI2's funnel shift:
// one instruction for the shift and the or; the bits of the nibble above bit 3 drop out): rows fed 0..7 leave
// row k in nibble k.
ENGINE_INLINE Vi push_nibble(Vi w, Vi c, Vi sv, Vi low3) { return _mm512_shrdi_epi32(w, low3_or(c, sv, low3), 4); }

template <int... I, typename F>
ENGINE_INLINE void unroll(std::integer_sequence<int, I...>, F&& f) {
  (f(std::integral_constant<int, I>{}), ...);
}

// ------------------------------------------------------------------------------ loads
// Elements [32g, 32g + 32) of tile row i, valid ones n (<= 0: none; the rest read as +0), split into the even
// and odd fp32 vectors (lane j: elements 2j and 2j + 1).
template <bool BF16>
ENGINE_INLINE void load_pair(const void* row, int64_t g, int64_t n, Vf& e, Vf& o) {
  if (BF16) {
    const uint16_t* p = static_cast<const uint16_t*>(row) + 32 * g;
    const Vi raw = n >= 32 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(first32(n), p);
    e = flt(_mm512_slli_epi32(raw, 16));
    o = flt(_mm512_and_si512(raw, u32(0xFFFF0000u)));
  } else {
    const float* p = static_cast<const float*>(row) + 32 * g;
    const Vf a = n >= 32 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(first16(n), p);
    const Vf b = n >= 32 ? _mm512_loadu_ps(p + 16) : _mm512_maskz_loadu_ps(first16(n - 16), p + 16);
    e = _mm512_permutex2var_ps(a, table(kTables.even), b);
    o = _mm512_permutex2var_ps(a, table(kTables.odd), b);
  }
}

// ------------------------------------------------------------------------------ one tile
struct FastTile {
  alignas(64) uint32_t row_code[8][16];  // row pair p: lanes 0-7 row 2p's blocks, 8-15 row 2p + 1's
  alignas(64) float row_enc[8][16];
  alignas(64) uint32_t col_code[4][2][16];  // group g, even / odd columns (lane j: column 32g + 2j + parity)
  alignas(64) float col_enc[4][2][16];
  Vf y[16][4][2];  // the RHT output: token k, group, even / odd
  alignas(64) uint8_t row_lines[16][64];  // the tile's packed rows (64 bytes: 128 columns)
};

// 8 x 8 qwords: o[p] = (r[0][p], ..., r[7][p]).
ENGINE_INLINE void transpose8x8_epi64(const Vi r[8], Vi o[8]) {
  Vi x[2][4], c[2][4];
  for (int k = 0; k < 4; ++k) {
    x[0][k] = _mm512_unpacklo_epi64(r[2 * k], r[2 * k + 1]);  // 128-bit lane l: (r[2k][2l], r[2k + 1][2l])
    x[1][k] = _mm512_unpackhi_epi64(r[2 * k], r[2 * k + 1]);  // ... [2l + 1]
  }
  for (int t = 0; t < 2; ++t) {
    c[t][0] = _mm512_shuffle_i64x2(x[t][0], x[t][1], 0x88);  // lanes 0, 2 of each
    c[t][1] = _mm512_shuffle_i64x2(x[t][0], x[t][1], 0xDD);  // lanes 1, 3
    c[t][2] = _mm512_shuffle_i64x2(x[t][2], x[t][3], 0x88);
    c[t][3] = _mm512_shuffle_i64x2(x[t][2], x[t][3], 0xDD);
    o[t + 0] = _mm512_shuffle_i64x2(c[t][0], c[t][2], 0x88);  // lane l of x[t][0..3]: qword 2l + t
    o[t + 4] = _mm512_shuffle_i64x2(c[t][0], c[t][2], 0xDD);
    o[t + 2] = _mm512_shuffle_i64x2(c[t][1], c[t][3], 0x88);
    o[t + 6] = _mm512_shuffle_i64x2(c[t][1], c[t][3], 0xDD);
  }
}

// The 8 strips x 64 columns of bytes at src (strip k at src + k * ld, 64-byte aligned) transposed: column c's 8
// bytes to dst + c * dst_ld, for the first n columns. Three levels of byte / word / dword unpacks: output
// vector (h, q, p) holds in qword 2L + m (128-bit lane L) column 16L + 8h + 4q + 2p + m.
ENGINE_INLINE void scales_8x64(const uint8_t* src, int64_t ld, uint8_t* dst, int64_t dst_ld, int64_t n) {
  Vi r[8], a[2][4], b[2][2][4];
  for (int k = 0; k < 8; ++k) r[k] = _mm512_load_si512(src + k * ld);
  for (int k = 0; k < 4; ++k) {
    a[0][k] = _mm512_unpacklo_epi8(r[2 * k], r[2 * k + 1]);
    a[1][k] = _mm512_unpackhi_epi8(r[2 * k], r[2 * k + 1]);
  }
  for (int h = 0; h < 2; ++h) {
    for (int k = 0; k < 2; ++k) {
      b[h][0][2 * k] = _mm512_unpacklo_epi16(a[h][2 * k], a[h][2 * k + 1]);
      b[h][1][2 * k] = _mm512_unpackhi_epi16(a[h][2 * k], a[h][2 * k + 1]);
    }
  }
  for (int h = 0; h < 2; ++h) {
    for (int q = 0; q < 2; ++q) {
      for (int p = 0; p < 2; ++p) {
        const Vi v = p ? _mm512_unpackhi_epi32(b[h][q][0], b[h][q][2]) : _mm512_unpacklo_epi32(b[h][q][0], b[h][q][2]);
        alignas(64) uint64_t w[8];
        _mm512_store_si512(w, v);
        for (int l = 0; l < 4; ++l) {
          for (int m = 0; m < 2; ++m) {
            const int64_t c = 16 * l + 8 * h + 4 * q + 2 * p + m;
            if (c < n) std::memcpy(dst + c * dst_ld, w + 2 * l + m, 8);
          }
        }
      }
    }
  }
}

// The columnwise outputs of the band of kNvfp4BandStrips strips in progress, for every column tile: 8 bytes of
// packed data and one scale per column and strip, `filled[col_tile]` the strips held. Flushed when the tiles
// move to the next band (or the thread's range ends): a column tile with all the band's strips leaves as one
// 64-byte line per column written around the caches (no read for ownership of lines written once, instead of
// 8 bytes per line per strip), 8 columns at a time by an 8 x 8 transpose of their words, and each column's 8
// scales as one 8-byte store (scales_8x64 transposes them 64 columns at a time); tiles the fallback wrote
// itself are holes in `filled`.
struct Band {
  int64_t first = -1;  // the band's first strip (-1: none)
  int64_t cols = 0;    // the columns, rounded up to whole tiles
  // Strip strides of `lines` (words) and `scales` (bytes): one cache line more than a strip's columns, so that the
  // 8 strips' entries of a column, read together by the flush, fall in different L1 sets (cols * 8 bytes is often
  // a multiple of 4 KiB, which would put all 8 in one set).
  int64_t line_ld = 0, scale_ld = 0;
  std::unique_ptr<uint64_t[]> line_store;
  uint64_t* lines = nullptr;  // [strip][column slot]: a group of 32 columns in band_cols' order (col_slot; read only
                              // where `filled`: left uninitialised); 64-byte aligned
  std::unique_ptr<uint8_t[]> scale_store;
  uint8_t* scales = nullptr;  // [strip][column] (read only where `filled`); 64-byte aligned
  std::vector<uint32_t> filled;       // [column tile]

  explicit Band(const Nvfp4Job& job) {
    const int64_t col_tiles = (job.K + kT - 1) / kT;
    cols = col_tiles * kT;
    line_ld = cols + 8;
    scale_ld = cols + 64;
    line_store.reset(new uint64_t[static_cast<size_t>(line_ld * kNvfp4BandStrips) + 8]);
    lines = line_store.get() + ((64 - (reinterpret_cast<uintptr_t>(line_store.get()) & 63)) & 63) / 8;
    scale_store.reset(new uint8_t[static_cast<size_t>(scale_ld * kNvfp4BandStrips) + 64]);
    scales = scale_store.get() + ((64 - (reinterpret_cast<uintptr_t>(scale_store.get()) & 63)) & 63);
    filled.assign(static_cast<size_t>(col_tiles), 0u);
  }

  // The word of column c (of the whole matrix) in strip k of the band.
  const uint64_t* word(int64_t k, int64_t c) const { return lines + k * line_ld + (c & ~int64_t{31}) + kTables.col_slot[c & 31]; }

  void flush(const Nvfp4Job& job) {
    if (first < 0) return;
    const int64_t M = job.M, mp = (M + 1) / 2, nbm = (M + kB - 1) / kB;
    const int64_t h = nbm - first < kNvfp4BandStrips ? nbm - first : kNvfp4BandStrips;
    for (size_t ct = 0; ct < filled.size(); ++ct) {
      const uint32_t f = filled[ct];
      if (f == 0) continue;
      filled[ct] = 0;
      const TileBox b = box_of(job, first, static_cast<int64_t>(ct));
      const bool all = f == (1u << h) - 1;
      uint8_t* data = job.col_data + b.c0 * mp + first * (kB / 2);
      uint8_t* sc = job.col_scales + b.c0 * nbm + first;
      const bool whole_lines = all && h == kNvfp4BandStrips && (first + h) * kB <= M &&
                               (reinterpret_cast<uintptr_t>(data) & 63) == 0 && mp % 64 == 0;
      if (whole_lines) {
        for (int64_t q = 0; q < ((b.w + 31) & ~int64_t{31}); q += 8) {  // 8 slots of a written group at a time
          Vi r[8], o[8];
          for (int k = 0; k < 8; ++k) r[k] = _mm512_load_si512(lines + k * line_ld + b.c0 + q);
          transpose8x8_epi64(r, o);
          for (int j = 0; j < 8; ++j) {
            const int64_t c = (q & ~int64_t{31}) + kTables.slot_col[(q & 31) + j];
            if (c < b.w) _mm512_stream_si512(reinterpret_cast<__m512i*>(data + c * mp), o[j]);
          }
        }
      }
      for (int64_t c = 0; c < b.w && !whole_lines; ++c) {
        for (int64_t k = 0; k < h; ++k) {
          if (!(f >> k & 1)) continue;
          const int64_t r0 = (first + k) * kB, rows = r0 + kB < M ? kB : M - r0;
          std::memcpy(data + c * mp + k * (kB / 2), word(k, b.c0 + c), static_cast<size_t>((rows + 1) / 2));
        }
      }
      if (all && h == kNvfp4BandStrips) {
        for (int64_t c = 0; c < b.w; c += 64) scales_8x64(scales + b.c0 + c, scale_ld, sc + c * nbm, nbm, b.w - c);
      } else {
        for (int64_t c = 0; c < b.w; ++c) {
          for (int64_t k = 0; k < h; ++k) {
            if (f >> k & 1) sc[c * nbm + k] = scales[k * scale_ld + b.c0 + c];
          }
        }
      }
    }
    first = -1;
  }
};

// Rowwise block maxima and column maxima of the tile's x (fp32 keys); false if it holds an inf or NaN.
template <bool BF16>
bool x_keys(const Nvfp4Job& job, const TileBox& b, FastTile& s, Vi col_key[4][2]) {
  const Vi abs16 = _mm512_set1_epi16(0x7FFF);
  Vi colmax[4][2];
  for (int g = 0; g < 4; ++g) colmax[g][0] = colmax[g][1] = _mm512_setzero_si512();
  for (int p = 0; p < 8; ++p) {
    Vi a[16];  // bf16: a[4h + g] = row 2p + h, group g (2 blocks); fp32: a[8h + 2g + q], one block each
    for (int h = 0; h < 2; ++h) {
      const int64_t i = 2 * p + h;
      const bool valid = i < b.rows;
      const char* row = static_cast<const char*>(job.x) +
                        ((b.r0 + (valid ? i : 0)) * job.ld + b.c0) * (BF16 ? 2 : 4);
      for (int g = 0; g < 4; ++g) {
        const int64_t n = valid ? b.w - 32 * g : 0;
        if (BF16) {
          const uint16_t* q = reinterpret_cast<const uint16_t*>(row) + 32 * g;
          const Vi raw = n >= 32 ? _mm512_loadu_si512(q) : _mm512_maskz_loadu_epi16(first32(n), q);
          a[4 * h + g] = _mm512_and_si512(raw, abs16);
          colmax[g][0] = _mm512_max_epu16(colmax[g][0], a[4 * h + g]);
        } else {
          const float* q = reinterpret_cast<const float*>(row) + 32 * g;
          for (int k = 0; k < 2; ++k) {
            const int64_t m = n - 16 * k;
            const Vi v = m >= 16 ? _mm512_loadu_si512(q + 16 * k) : _mm512_maskz_loadu_epi32(first16(m), q + 16 * k);
            a[8 * h + 2 * g + k] = _mm512_and_si512(v, u32(0x7FFFFFFFu));
            colmax[g][k] = _mm512_max_epu32(colmax[g][k], a[8 * h + 2 * g + k]);
          }
        }
      }
    }
    Vi keys;
    if (BF16) {  // a tree of 16-bit maxima: 8 vectors of 2 blocks -> 4 of 4 (128-bit lanes) -> 2 -> 1
      Vi v[4], x[2];
      for (int k = 0; k < 4; ++k)
        v[k] = _mm512_max_epu16(_mm512_shuffle_i32x4(a[2 * k], a[2 * k + 1], 0x88),
                                _mm512_shuffle_i32x4(a[2 * k], a[2 * k + 1], 0xDD));
      for (int k = 0; k < 2; ++k)  // 128-bit lane l: blocks 8k + l, 8k + 4 + l (4 keys each)
        x[k] = _mm512_max_epu16(_mm512_unpacklo_epi64(v[2 * k], v[2 * k + 1]),
                                _mm512_unpackhi_epi64(v[2 * k], v[2 * k + 1]));
      const Vf x0 = flt(x[0]), x1 = flt(x[1]);  // lane l, dword m: block 4m + l (2 keys)
      const Vi z = _mm512_max_epu16(bits(_mm512_shuffle_ps(x0, x1, 0x88)), bits(_mm512_shuffle_ps(x0, x1, 0xDD)));
      keys = _mm512_max_epu32(_mm512_slli_epi32(z, 16), _mm512_and_si512(z, u32(0xFFFF0000u)));
      keys = _mm512_permutexvar_epi32(table(kTables.block_order), keys);
    } else {
      keys = reduce16<InType::F32>(a);
    }
    _mm512_store_si512(s.row_code[p], keys);
  }
  Vi any = _mm512_setzero_si512();
  for (int g = 0; g < 4; ++g) {
    if (BF16) {
      any = _mm512_max_epu16(any, colmax[g][0]);
      col_key[g][0] = _mm512_slli_epi32(colmax[g][0], 16);
      col_key[g][1] = _mm512_and_si512(colmax[g][0], u32(0xFFFF0000u));
    } else {
      any = _mm512_max_epu32(any, _mm512_max_epu32(colmax[g][0], colmax[g][1]));
      col_key[g][0] = _mm512_permutex2var_epi32(colmax[g][0], table(kTables.even), colmax[g][1]);
      col_key[g][1] = _mm512_permutex2var_epi32(colmax[g][0], table(kTables.odd), colmax[g][1]);
    }
  }
  if (BF16) return _mm512_cmpge_epu16_mask(any, _mm512_set1_epi16(0x7F80)) == 0;
  return _mm512_cmpge_epu32_mask(any, u32(0x7F800000u)) == 0;
}

// acc[k] = sum_i x_i H[i][k] (before the bf16 rounding) for the 16 tokens x_i of 16 columns, as rht_tile: the
// quarters q_of(i) = x_i * 0.25 signed by s_i (a sign flip: x * -0.25 exactly), then fwht16 (64 adds / subs).
template <typename Load>
ENGINE_INLINE void rht16(const Load& q_of, Vf acc[16]) {
  unroll(std::make_integer_sequence<int, 16>{}, [&](auto ic) __attribute__((always_inline)) {
    constexpr int i = decltype(ic)::value;
    acc[i] = kRhtSigns[i] > 0 ? q_of(i) : _mm512_xor_ps(q_of(i), _mm512_set1_ps(-0.0f));
  });
  fwht16(acc, [](Vf a, Vf b) __attribute__((always_inline)) { return _mm512_add_ps(a, b); },
         [](Vf a, Vf b) __attribute__((always_inline)) { return _mm512_sub_ps(a, b); });
}

// bf16_round of finite or infinite values.
ENGINE_INLINE Vi bf16_rne(Vf v) {
  const Vi u = bits(v);
  const Vi lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), u32(1));
  return _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(u, u32(0x7FFF)), lsb), u32(0xFFFF0000u));
}

// The RHT of the tile's columns into s.y (zero rows past b.rows), and their maxima as fp32 keys.
template <bool BF16>
void rht_keys(const Nvfp4Job& job, const TileBox& b, FastTile& s, Vi col_key[4][2]) {
  const char* base = static_cast<const char*>(job.x) + (b.r0 * job.ld + b.c0) * (BF16 ? 2 : 4);
  const int64_t row_bytes = job.ld * (BF16 ? 2 : 4);
  for (int g = 0; g < 4; ++g) {
    if (32 * g >= b.w) {
      for (int k = 0; k < 16; ++k) s.y[k][g][0] = s.y[k][g][1] = _mm512_setzero_ps();
      col_key[g][0] = col_key[g][1] = _mm512_setzero_si512();
      continue;
    }
    for (int half = 0; half < 2; ++half) {
      Vf acc[16];
      rht16([&](int i) __attribute__((always_inline)) {
        Vf e, o;
        load_pair<BF16>(base + (i < b.rows ? i : 0) * row_bytes, g, i < b.rows ? b.w - 32 * g : 0, e, o);
        return _mm512_mul_ps(half ? o : e, _mm512_set1_ps(0.25f));
      }, acc);
      Vi m = _mm512_setzero_si512();
      for (int k = 0; k < 16; ++k) {
        const Vi r = bf16_rne(acc[k]);
        s.y[k][g][half] = flt(r);
        m = _mm512_max_epu32(m, _mm512_and_si512(r, u32(0x7FFFFFFFu)));
      }
      col_key[g][half] = m;
    }
  }
}

// A usage's per-tensor factors and the element factor of each E4M3 code below 0x80 (block keys are |x| bits,
// so their codes have no sign): a lookup instead of a decode and a division per 16 blocks.
//
// `clamp_free_key`: blocks whose key is at most this and whose scale code is normal (>= 8) have |x * enc| < 7,
// so their elements need no clamp at 6 (0 when no key qualifies). Why: with amax in [2^-90, 2^90], S_enc,
// S_dec, float(s_b) * S_dec and enc are normal fp32 and enc is not capped; v = key * mult <= 464 means s_b is
// v rounded to E4M3 (448 covers v up to 464), a normal s_b is within a factor 1 + 2^-4 of v (3 mantissa
// bits), so |x| * enc <= key * enc ~ 6 * v / s_b <= 6.375, times (1 + 8 * 2^-24) for the fp32 roundings.
struct Scales {
  TensorScale ts;
  uint32_t clamp_free_key = 0;
  alignas(64) float enc[128];
  explicit Scales(float amax) : ts(tensor_scale(amax)) {
    for (uint32_t c = 0; c < 128; c += 16) {
      const U16 codes = U16{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} + c;
      vstore(enc + c, block_encode<F16, U16>(codes, ts));
    }
    if (amax >= 0x1p-90f && amax <= 0x1p90f) {  // false for NaN
      float f = 464.0f / ts.mult;
      while (f > 0.0f && f * ts.mult > 464.0f) f = std::nextafter(f, 0.0f);
      std::memcpy(&clamp_free_key, &f, 4);
    }
  }
};

// True unless every block of the tile (keys and their scale codes, 16 per vector) has a normal scale and a key
// at most sc.clamp_free_key (see Scales); zero-padded blocks (code 0) and partial tiles take the clamp.
ENGINE_INLINE bool blocks_need_clamp(const Vi* keys, const Vi* codes, int n, const Scales& sc) {
  Vi kmax = _mm512_setzero_si512(), cmin = _mm512_set1_epi32(0x7F);
  for (int v = 0; v < n; ++v) {
    kmax = _mm512_max_epu32(kmax, keys[v]);
    cmin = _mm512_min_epu32(cmin, codes[v]);
  }
  return _mm512_cmpgt_epu32_mask(kmax, u32(sc.clamp_free_key)) != 0 || _mm512_cmplt_epu32_mask(cmin, u32(8)) != 0;
}

// The E4M3 codes and factors of 16 block keys: the code of key * mult (>= 0, not NaN) by the FP8 kernels'
// magic-number rounding (avx512_vec.h, the rule of block_code), the factor looked up by two-table permutes of the
// code's low 5 bits, the quarter picked by bits 5 and 6 (cheaper than a gather).
ENGINE_INLINE void scales16(Vi key, const Scales& sc, uint32_t* code, float* enc) {
  const Vi c = magnitude_codes<Fp8Kind::E4M3>(_mm512_mul_ps(flt(key), _mm512_set1_ps(sc.ts.mult)));
  _mm512_store_si512(code, c);
  Vf q[4];
  for (int k = 0; k < 4; ++k)
    q[k] = _mm512_permutex2var_ps(_mm512_load_ps(sc.enc + 32 * k), c, _mm512_load_ps(sc.enc + 32 * k + 16));
  const __mmask16 bit5 = _mm512_test_epi32_mask(c, u32(32)), bit6 = _mm512_test_epi32_mask(c, u32(64));
  const Vf lo = _mm512_mask_blend_ps(bit5, q[0], q[1]), hi = _mm512_mask_blend_ps(bit5, q[2], q[3]);
  _mm512_store_ps(enc, _mm512_mask_blend_ps(bit6, lo, hi));
}

// Group g's column words (lo: rows 0-7, hi: rows 8-15; even / odd columns) -> the band buffer (lines: its strip's
// 32 slots of the group, column c of the group in slot col_slot[c]).
ENGINE_INLINE void band_cols(Vi lo_e, Vi hi_e, Vi lo_o, Vi hi_o, uint64_t* lines) {
  _mm512_store_si512(lines + 0, _mm512_unpacklo_epi32(lo_e, hi_e));
  _mm512_store_si512(lines + 8, _mm512_unpackhi_epi32(lo_e, hi_e));
  _mm512_store_si512(lines + 16, _mm512_unpacklo_epi32(lo_o, hi_o));
  _mm512_store_si512(lines + 24, _mm512_unpackhi_epi32(lo_o, hi_o));
}

// The elements of group g (32 columns) of a tile, all 16 rows (zeros past b.rows: code 0, written nowhere): the
// rowwise bytes into s.row_lines, the columnwise words into the band buffer at `lines` (column-major, strip k).
// TWO_D (16x16 tiles, round to nearest, one tensor scale): every row and column of group g has the factors of
// its two tiles (s.row_enc[0] lane t: tile t % 8), so both usages have the same codes, computed once.
template <bool BF16, bool ROWS, bool COLS, bool RHT, bool CLAMP, bool SR, bool TWO_D = false>
ENGINE_INLINE void quantize_group(const Nvfp4Job& job, const TileBox& b, FastTile& s, int g, uint64_t* lines,
                                  uint32_t rkey) {
  static_assert(!TWO_D || (!RHT && !SR), "16x16 tiles: no RHT, round to nearest");
  const char* base = static_cast<const char*>(job.x) + (b.r0 * job.ld + b.c0) * (BF16 ? 2 : 4);
  const int64_t row_bytes = job.ld * (BF16 ? 2 : 4), n = b.w - 32 * g;
  const Vi magic = table(kTables.magic), low3 = u32(7);
  const Vi pick0 = _mm512_set_epi32(2 * g + 1, 2 * g + 1, 2 * g + 1, 2 * g + 1, 2 * g + 1, 2 * g + 1, 2 * g + 1,
                                    2 * g + 1, 2 * g, 2 * g, 2 * g, 2 * g, 2 * g, 2 * g, 2 * g, 2 * g);
  const Vi pick1 = _mm512_add_epi32(pick0, u32(8));
  const Vf tile_enc = TWO_D ? _mm512_permutexvar_ps(pick0, _mm512_load_ps(s.row_enc[0])) : _mm512_setzero_ps();
  const Vf enc_e = TWO_D ? tile_enc : _mm512_load_ps(s.col_enc[g][0]);
  const Vf enc_o = TWO_D ? tile_enc : _mm512_load_ps(s.col_enc[g][1]);
  Vi w[2][2] = {{_mm512_setzero_si512(), _mm512_setzero_si512()}, {_mm512_setzero_si512(), _mm512_setzero_si512()}};
  // SR, columnwise: column c's 16 counter indices (nvfp4_sr.random_bits) run from j0 = col_offset + c * M + r0
  // (per parity: columns 32g + 2j + parity), so rows i take byte a + i (a = j0 & 3) of the 5 mixes of the words
  // j0 >> 2 .. (j0 >> 2) + 4: cmix[parity][v], row i's word v = i / 4 or the next (cnext[parity][i % 4]) at bit
  // cshift[parity][i % 4], 5 mixes per 16 elements instead of 16.
  alignas(64) uint32_t cmix[2][5][16], cshift[2][4][16];
  __mmask16 cnext[2][4] = {};
  if (SR && COLS) {
    alignas(64) uint32_t lo[2][16], k0[2][16], k1[2][16], at[2][16];
    bool carry = false;
    for (int q = 0; q < 2; ++q) {
      for (int j = 0; j < 16; ++j) {
        const uint64_t first = job.col_offset + static_cast<uint64_t>(b.c0 + 32 * g + 2 * j + q) *
                               static_cast<uint64_t>(job.M) + static_cast<uint64_t>(b.r0);
        const uint32_t hi = static_cast<uint32_t>(first >> 34);
        lo[q][j] = static_cast<uint32_t>(first >> 2);
        at[q][j] = static_cast<uint32_t>(first & 3u);
        k0[q][j] = hi_key(hi, rkey);
        k1[q][j] = hi_key(hi + 1u, rkey);
        carry = carry || lo[q][j] > 0xFFFFFFFFu - 4u;
      }
      const Vi lo0 = _mm512_load_si512(lo[q]), hk0 = _mm512_load_si512(k0[q]), a = _mm512_load_si512(at[q]);
      for (int v = 0; v < 5; ++v) {
        const Vi lv = _mm512_add_epi32(lo0, u32(static_cast<uint32_t>(v)));
        _mm512_store_si512(cmix[q][v], mix16(lv, carry ? carried(lv, lo0, hk0, _mm512_load_si512(k1[q])) : hk0));
      }
      for (int r = 0; r < 4; ++r) {
        const Vi rel = _mm512_add_epi32(a, u32(static_cast<uint32_t>(r)));
        cnext[q][r] = _mm512_cmpge_epu32_mask(rel, u32(4));
        _mm512_store_si512(cshift[q][r], _mm512_slli_epi32(_mm512_and_si512(rel, u32(3)), 3));
      }
    }
  }
  const Vi iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  Vi lo4[4], hi4[4];  // ROWS: the even / odd nibbles of the rows of the 4-row quad in progress (row 4q + m in [m])
  unroll(std::make_integer_sequence<int, 16>{}, [&](auto ic) __attribute__((always_inline)) {
    constexpr int i = decltype(ic)::value;  // rows 0..15: the nibbles of the columnwise words (push_nibble)
    Vf e, o;
    const bool valid = i < b.rows;
    load_pair<BF16>(base + (valid ? i : 0) * row_bytes, g, valid ? n : 0, e, o);
    const Vi se = sign_bits(e), so = sign_bits(o);
    if (TWO_D && ROWS && COLS) {  // one code per element for both usages
      const Vi ne = low3_or(e2m1_code3<CLAMP>(_mm512_mul_ps(e, tile_enc), magic), se, low3);
      const Vi no = low3_or(e2m1_code3<CLAMP>(_mm512_mul_ps(o, tile_enc), magic), so, low3);
      lo4[i % 4] = ne;
      hi4[i % 4] = no;
      if (i % 4 == 3) store_quad(rows4(lo4, hi4), s.row_lines[i - 3] + 16 * g);
      w[i / 8][0] = _mm512_shrdi_epi32(w[i / 8][0], ne, 4);
      w[i / 8][1] = _mm512_shrdi_epi32(w[i / 8][1], no, 4);
      return;
    }
    if (ROWS) {
      const Vf enc = TWO_D ? tile_enc : _mm512_permutexvar_ps(i % 2 ? pick1 : pick0, _mm512_load_ps(s.row_enc[i / 2]));
      Vi ce, co;
      if (SR) {  // element (r, c): counter index row_offset + r * K + c; lanes: columns 32g + 2j (+ 1)
        // the run's 32 indices from j0 = first: the mixes of its words (j0 >> 2) + 0..8, byte a + t for element t
        const uint64_t first = job.row_offset + static_cast<uint64_t>(b.r0 + i) * static_cast<uint64_t>(job.K) +
                               static_cast<uint64_t>(b.c0 + 32 * g);
        const uint32_t lo_first = static_cast<uint32_t>(first >> 2), hi = static_cast<uint32_t>(first >> 34);
        const uint32_t a = static_cast<uint32_t>(first & 3u);
        const Vi lo0 = u32(lo_first), lo = _mm512_add_epi32(lo0, iota);
        Vi hk = u32(hi_key(hi, rkey));
        if (lo_first > 0xFFFFFFFFu - 8u) hk = carried(lo, lo0, hk, u32(hi_key(hi + 1u, rkey)));  // into hi + 1
        const Vi mix = mix16(lo, hk);
        const uint32_t* word_e = kTables.sr_word[2 * a];  // [2a + 1]: the odd elements'
        const uint32_t* shift_e = kTables.sr_shift[2 * a];
        const Vi rr_e = sr_rr(_mm512_permutexvar_epi32(table(word_e), mix), table(shift_e));
        const Vi rr_o = sr_rr(_mm512_permutexvar_epi32(table(word_e + 16), mix), table(shift_e + 16));
        ce = e2m1_sr_code(_mm512_mul_ps(e, enc), rr_e);
        co = e2m1_sr_code(_mm512_mul_ps(o, enc), rr_o);
      } else {
        ce = e2m1_code3<CLAMP>(_mm512_mul_ps(e, enc), magic);
        co = e2m1_code3<CLAMP>(_mm512_mul_ps(o, enc), magic);
      }
      lo4[i % 4] = low3_or(ce, se, low3);
      hi4[i % 4] = low3_or(co, so, low3);
      if (i % 4 == 3) store_quad(rows4(lo4, hi4), s.row_lines[i - 3] + 16 * g);  // the quad's 4 rows together
    }
    if (COLS) {
      const Vf ye = RHT ? s.y[i][g][0] : e, yo = RHT ? s.y[i][g][1] : o;
      Vi ce, co;
      if (SR) {
        Vi rr[2];
        for (int q = 0; q < 2; ++q) {
          const Vi word = _mm512_mask_blend_epi32(cnext[q][i % 4], _mm512_load_si512(cmix[q][i / 4]),
                                                  _mm512_load_si512(cmix[q][i / 4 + 1]));
          rr[q] = sr_rr(word, _mm512_load_si512(cshift[q][i % 4]));
        }
        ce = e2m1_sr_code(_mm512_mul_ps(ye, enc_e), rr[0]);
        co = e2m1_sr_code(_mm512_mul_ps(yo, enc_o), rr[1]);
      } else {
        ce = e2m1_code3<CLAMP>(_mm512_mul_ps(ye, enc_e), magic);
        co = e2m1_code3<CLAMP>(_mm512_mul_ps(yo, enc_o), magic);
      }
      w[i / 8][0] = push_nibble(w[i / 8][0], ce, RHT ? sign_bits(ye) : se, low3);
      w[i / 8][1] = push_nibble(w[i / 8][1], co, RHT ? sign_bits(yo) : so, low3);
    }
  });
  if (COLS) band_cols(w[0][0], w[1][0], w[0][1], w[1][1], lines);
}

// The tile's packed rows (s.row_lines) to the rowwise data: whole aligned lines written around the caches.
ENGINE_INLINE void store_row_lines(const Nvfp4Job& job, const TileBox& b, const FastTile& s) {
  const int64_t kp = (job.K + 1) / 2;
  for (int64_t i = 0; i < b.rows; ++i) {
    uint8_t* dst = job.row_data + (b.r0 + i) * kp + b.c0 / 2;
    const Vi line = _mm512_load_si512(s.row_lines[i]);
    if (b.w == kT && (reinterpret_cast<uintptr_t>(dst) & 63) == 0) {
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), line);
    } else {
      _mm512_mask_storeu_epi8(dst, first64((b.w + 1) / 2), line);
    }
  }
}

// Both usages of one tile, 1x16 blocks, round to nearest even or stochastic (SR, with the seed's key rkey);
// false (nothing written) if it holds an inf or NaN (those take quantize_tile).
template <bool BF16, bool ROWS, bool COLS, bool RHT, bool SR>
bool fast_tile(const Nvfp4Job& job, const TileBox& b, FastTile& s, Band& band, const Scales& row_sc,
               const Scales& col_sc, uint32_t rkey) {
  Vi col_key[4][2];
  if (!x_keys<BF16>(job, b, s, col_key)) return false;
  const int64_t k = b.r0 / kB - band.first;  // the strip within the band
  if (RHT) rht_keys<BF16>(job, b, s, col_key);
  const int64_t blocks = (b.w + kB - 1) / kB;
  bool clamp = false;
  if (ROWS) {
    const int64_t nbk = (job.K + kB - 1) / kB;
    Vi keys[8];
    for (int p = 0; p < 8; ++p) keys[p] = _mm512_load_si512(s.row_code[p]);
    for (int p = 0; p < 8; ++p) {
      scales16(keys[p], row_sc, s.row_code[p], s.row_enc[p]);
      const __m128i c = _mm512_cvtepi32_epi8(_mm512_load_si512(s.row_code[p]));
      for (int h = 0; h < 2 && 2 * p + h < b.rows; ++h) {
        uint8_t* dst = job.row_scales + (b.r0 + 2 * p + h) * nbk + b.c0 / kB;
        const __m128i v = h ? _mm_srli_si128(c, 8) : c;
        if (blocks == 8) {
          _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), v);
        } else {
          _mm_mask_storeu_epi8(dst, static_cast<__mmask16>(first16(blocks)), v);
        }
      }
    }
    Vi codes[8];
    for (int p = 0; p < 8; ++p) codes[p] = _mm512_load_si512(s.row_code[p]);
    clamp = blocks_need_clamp(keys, codes, 8, row_sc);
  }
  if (COLS) {
    alignas(64) uint8_t codes[kT];
    Vi keys[8], col_codes[8];
    for (int g = 0; g < 4; ++g) {
      for (int q = 0; q < 2; ++q) {
        scales16(col_key[g][q], col_sc, s.col_code[g][q], s.col_enc[g][q]);
        keys[2 * g + q] = col_key[g][q];
        col_codes[2 * g + q] = _mm512_load_si512(s.col_code[g][q]);
      }
      const Vi ce = _mm512_load_si512(s.col_code[g][0]), co = _mm512_load_si512(s.col_code[g][1]);
      for (int h = 0; h < 2; ++h)
        _mm_store_si128(reinterpret_cast<__m128i*>(codes + 32 * g + 16 * h),
                        _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(ce, table(kTables.interleave[h]), co)));
    }
    std::memcpy(band.scales + k * band.scale_ld + b.c0, codes, kT);
    clamp = clamp || blocks_need_clamp(keys, col_codes, 8, col_sc);
  }
  for (int g = 0; g < 4 && 32 * g < b.w; ++g) {
    uint64_t* lines = band.lines + k * band.line_ld + b.c0 + 32 * g;
    if (SR) {
      quantize_group<BF16, ROWS, COLS, RHT, true, true>(job, b, s, g, lines, rkey);
    } else if (clamp) {
      quantize_group<BF16, ROWS, COLS, RHT, true, false>(job, b, s, g, lines, rkey);
    } else {
      quantize_group<BF16, ROWS, COLS, RHT, false, false>(job, b, s, g, lines, rkey);
    }
  }
  if (ROWS) store_row_lines(job, b, s);
  return true;
}

// fast_tile for 16x16 tiles, round to nearest, both usages (if asked) from one tensor scale `sc`: a tile's key is
// the max of its 16 rows' block keys; every row of the tile gets its 8 codes, every column its tile's code.
template <bool BF16, bool ROWS, bool COLS>
bool fast_tile_2d(const Nvfp4Job& job, const TileBox& b, FastTile& s, Band& band, const Scales& sc) {
  Vi col_key[4][2];
  if (!x_keys<BF16>(job, b, s, col_key)) return false;
  Vi key = _mm512_load_si512(s.row_code[0]);
  for (int p = 1; p < 8; ++p) key = _mm512_max_epu32(key, _mm512_load_si512(s.row_code[p]));
  key = _mm512_max_epu32(key, _mm512_shuffle_i64x2(key, key, 0x4E));  // lanes t and t + 8: tile t's key
  scales16(key, sc, s.row_code[0], s.row_enc[0]);
  const Vi codes = _mm512_load_si512(s.row_code[0]);
  const int64_t blocks = (b.w + kB - 1) / kB;
  if (ROWS) {
    const int64_t nbk = (job.K + kB - 1) / kB;
    const __m128i c = _mm512_cvtepi32_epi8(codes);
    for (int64_t i = 0; i < b.rows; ++i) {
      _mm_mask_storeu_epi8(job.row_scales + (b.r0 + i) * nbk + b.c0 / kB, static_cast<__mmask16>(first16(blocks)), c);
    }
  }
  if (COLS) {
    uint8_t* dst = band.scales + (b.r0 / kB - band.first) * band.scale_ld + b.c0;
    for (int t = 0; t < kT / kB; ++t) std::memset(dst + kB * t, static_cast<int>(s.row_code[0][t]), kB);
  }
  const bool clamp = blocks_need_clamp(&key, &codes, 1, sc);
  for (int g = 0; g < 4 && 32 * g < b.w; ++g) {
    uint64_t* lines = band.lines + (b.r0 / kB - band.first) * band.line_ld + b.c0 + 32 * g;
    if (clamp) {
      quantize_group<BF16, ROWS, COLS, false, true, false, true>(job, b, s, g, lines, 0);
    } else {
      quantize_group<BF16, ROWS, COLS, false, false, false, true>(job, b, s, g, lines, 0);
    }
  }
  if (ROWS) store_row_lines(job, b, s);
  return true;
}

// ------------------------------------------------------------------------------ the amax pass
// Max |x| bits over rows [r0, r1) x columns [c0, c1), row by row (a whole strip of a range: one contiguous read).
template <bool BF16>
uint32_t x_key_rows(const Nvfp4Job& job, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  const int64_t n = c1 - c0;
  Vi m[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
  for (int64_t r = r0; r < r1; ++r) {
    if (BF16) {
      const uint16_t* p = static_cast<const uint16_t*>(job.x) + r * job.ld + c0;
      const Vi abs = _mm512_set1_epi16(0x7FFF);
      int64_t i = 0;
      for (; i + 128 <= n; i += 128) {
        for (int k = 0; k < 4; ++k) m[k] = _mm512_max_epu16(m[k], _mm512_and_si512(_mm512_loadu_si512(p + i + 32 * k), abs));
      }
      for (; i < n; i += 32) m[0] = _mm512_max_epu16(m[0], _mm512_and_si512(_mm512_maskz_loadu_epi16(first32(n - i), p + i), abs));
    } else {
      const float* p = static_cast<const float*>(job.x) + r * job.ld + c0;
      const Vi abs = u32(0x7FFFFFFFu);
      int64_t i = 0;
      for (; i + 64 <= n; i += 64) {
        for (int k = 0; k < 4; ++k) m[k] = _mm512_max_epu32(m[k], _mm512_and_si512(_mm512_loadu_si512(p + i + 16 * k), abs));
      }
      for (; i < n; i += 16) m[0] = _mm512_max_epu32(m[0], _mm512_and_si512(_mm512_maskz_loadu_epi32(first16(n - i), p + i), abs));
    }
  }
  if (BF16) {
    const Vi f = _mm512_max_epu16(_mm512_max_epu16(m[0], m[1]), _mm512_max_epu16(m[2], m[3]));
    const Vi wide = _mm512_max_epu32(_mm512_slli_epi32(f, 16), _mm512_and_si512(f, u32(0xFFFF0000u)));
    return static_cast<uint32_t>(_mm512_reduce_max_epu32(wide));
  }
  return static_cast<uint32_t>(
      _mm512_reduce_max_epu32(_mm512_max_epu32(_mm512_max_epu32(m[0], m[1]), _mm512_max_epu32(m[2], m[3]))));
}

// Raises m (lane-wise |RHT output| bits before the bf16 rounding, which is monotonic: the caller rounds the max)
// to tile b's. A 16-column group whose bound 0.25 * 1.01 * sum_i |x_i| + 2^-140 (every |y| is below it: the 4
// butterfly stages and the bf16 rounding add a relative error below 2^-19 + 2^-8, the fp32 sum of the |x_i| is
// low by at most 2^-19, and q_i = x_i * 0.25 rounds up by at most 2^-150) is below the max of m cannot raise the
// tensor's max: the sums are skipped. Inf and NaN give no bound (inf, NaN), so no skip. `xm` (when x's amax is asked too):
// raised lane-wise to the |x| bits (as fp32) of the same loads, so that x is read once.
template <bool BF16>
ENGINE_INLINE Vi rht_tile_max(const Nvfp4Job& job, const TileBox& b, Vi m, Vi* xm) {
  const char* base = static_cast<const char*>(job.x) + (b.r0 * job.ld + b.c0) * (BF16 ? 2 : 4);
  const int64_t row_bytes = job.ld * (BF16 ? 2 : 4);
  for (int g = 0; g < 4 && 32 * g < b.w; ++g) {
    Vf e[16], o[16];
    Vf sum_e = _mm512_setzero_ps(), sum_o = _mm512_setzero_ps();
    for (int i = 0; i < 16; ++i) {
      load_pair<BF16>(base + (i < b.rows ? i : 0) * row_bytes, g, i < b.rows ? b.w - 32 * g : 0, e[i], o[i]);
      const Vf ae = _mm512_abs_ps(e[i]), ao = _mm512_abs_ps(o[i]);
      sum_e = _mm512_add_ps(sum_e, ae);
      sum_o = _mm512_add_ps(sum_o, ao);
      if (xm) *xm = _mm512_max_epu32(*xm, _mm512_max_epu32(bits(ae), bits(ao)));  // (zeros past b.rows, b.w)
    }
    const Vi top = _mm512_set1_epi32(static_cast<int>(_mm512_reduce_max_epu32(m)));
    for (int half = 0; half < 2; ++half) {
      const Vf* v = half ? o : e;
      const Vf bound = _mm512_add_ps(_mm512_mul_ps(half ? sum_o : sum_e, _mm512_set1_ps(0.25f * 1.01f)),
                                     _mm512_set1_ps(0x1p-140f));
      if (_mm512_cmp_epu32_mask(bits(bound), top, _MM_CMPINT_NLT) == 0) continue;
      Vf acc[16];
      rht16([&](int i) __attribute__((always_inline)) { return _mm512_mul_ps(v[i], _mm512_set1_ps(0.25f)); }, acc);
      for (int k = 0; k < 16; ++k) m = _mm512_max_epu32(m, _mm512_and_si512(bits(acc[k]), u32(0x7FFFFFFFu)));
    }
  }
  return m;
}

template <bool BF16>
void amax_fast(const Nvfp4Job& job, int64_t u0, int64_t u1, uint32_t* x_key, uint32_t* rht_key) {
  const int64_t col_tiles = (job.K + kT - 1) / kT;
  uint32_t xk = 0;
  Vi ym = _mm512_setzero_si512(), xm = _mm512_setzero_si512();
  // One strip's run of tiles at a time, the last strip first: the quantize pass then starts on the lines read
  // last, which the caches still hold.
  for (int64_t end = u1; end > u0;) {
    const int64_t strip = (end - 1) / col_tiles, u = strip * col_tiles > u0 ? strip * col_tiles : u0;
    const TileBox first = tile_box(job, u), last = tile_box(job, end - 1);
    if (x_key && !rht_key) {
      const uint32_t k = x_key_rows<BF16>(job, first.r0, first.r0 + first.rows, first.c0, last.c0 + last.w);
      xk = xk > k ? xk : k;
    }
    if (rht_key) {  // x's amax too (when asked) from the same loads: x read once
      for (int64_t v = u; v < end; ++v) ym = rht_tile_max<BF16>(job, tile_box(job, v), ym, x_key ? &xm : nullptr);
    }
    end = u;
  }
  if (x_key) {
    const uint32_t k = static_cast<uint32_t>(_mm512_reduce_max_epu32(xm));  // 0 unless the RHT loop ran
    *x_key = xk > k ? xk : k;
  }
  if (rht_key) {
    const uint32_t k = static_cast<uint32_t>(_mm512_reduce_max_epu32(ym));
    *rht_key = k > 0x7F800000u ? 0x7FC00000u : (k + 0x7FFFu + ((k >> 16) & 1u)) & 0xFFFF0000u;  // bf16_round
  }
}

// Asks for tile b's lines of x (into L2), kPrefetchTiles tiles before the quantize pass reaches it: its first reads
// (x_keys) otherwise wait on memory with little to overlap. 1 thread, 4096x4096 bf16: 2-4% faster than none, and
// than 2 tiles ahead into L1 or 16 into L2.
constexpr int64_t kPrefetchTiles = 4;

template <bool BF16>
ENGINE_INLINE void prefetch_tile(const Nvfp4Job& job, const TileBox& b) {
  const int64_t bytes = b.w * (BF16 ? 2 : 4), row_bytes = job.ld * (BF16 ? 2 : 4);
  const char* base = static_cast<const char*>(job.x) + (b.r0 * job.ld + b.c0) * (BF16 ? 2 : 4);
  for (int64_t i = 0; i < b.rows; ++i) {
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(base + i * row_bytes + o, _MM_HINT_T1);
  }
}

template <bool BF16, bool ROWS, bool COLS, bool RHT, bool SR, bool TWO_D = false>
void quantize_fast(const Nvfp4Job& job, int64_t u0, int64_t u1) {
  alignas(64) FastTile s;
  alignas(64) float t[kB][kT];
  alignas(64) float y[kB][kT];
  const bool cols = COLS;
  Band band(job);
  const Scales row_sc(job.row_amax), col_sc(job.col_amax);
  const uint32_t rkey = seed_key(job.seed);
  for (int64_t u = u0; u < u1; ++u) {
    const TileBox b = tile_box(job, u);
    if (u + kPrefetchTiles < u1) prefetch_tile<BF16>(job, tile_box(job, u + kPrefetchTiles));
    const int64_t strip = b.r0 / kB, first = strip - strip % kNvfp4BandStrips;
    if (cols && first != band.first) {
      band.flush(job);
      band.first = first;
    }
    const bool fast = TWO_D ? fast_tile_2d<BF16, ROWS, COLS>(job, b, s, band, ROWS ? row_sc : col_sc)
                            : fast_tile<BF16, ROWS, COLS, RHT, SR>(job, b, s, band, row_sc, col_sc, rkey);
    if (fast) {
      if (cols) band.filled[static_cast<size_t>(b.c0 / kT)] |= 1u << (strip - first);
    } else {
      quantize_tile<BF16, SR>(job, b, t, y, rkey);
    }
  }
  if (cols) band.flush(job);
  _mm_sfence();  // the streamed lines are visible before the threads join
}

template <bool BF16, bool SR>
void quantize_fast_usages(const Nvfp4Job& job, int64_t u0, int64_t u1) {
  if (!job.col_data) return quantize_fast<BF16, true, false, false, SR>(job, u0, u1);
  if (!job.row_data) {
    return job.rht ? quantize_fast<BF16, false, true, true, SR>(job, u0, u1)
                   : quantize_fast<BF16, false, true, false, SR>(job, u0, u1);
  }
  return job.rht ? quantize_fast<BF16, true, true, true, SR>(job, u0, u1)
                 : quantize_fast<BF16, true, true, false, SR>(job, u0, u1);
}

}  // namespace

void nvfp4_amax_tiles(const Nvfp4Job& job, int64_t u0, int64_t u1, uint32_t* x_key, uint32_t* rht_key) {
  if (job.bf16) return amax_fast<true>(job, u0, u1, x_key, rht_key);
  return amax_fast<false>(job, u0, u1, x_key, rht_key);
}

// 16x16 tiles take the fast path when both usages' codes are the same: round to nearest, one tensor scale.
template <bool BF16>
void quantize_fast_2d(const Nvfp4Job& job, int64_t u0, int64_t u1) {
  if (!job.col_data) return quantize_fast<BF16, true, false, false, false, true>(job, u0, u1);
  if (!job.row_data) return quantize_fast<BF16, false, true, false, false, true>(job, u0, u1);
  return quantize_fast<BF16, true, true, false, false, true>(job, u0, u1);
}

void nvfp4_quantize_tiles(const Nvfp4Job& job, int64_t u0, int64_t u1) {
  if (job.four_over_six) {  // nvfp4_4over6_kernels.h, vectorised for AVX-512 by this file's target pragma
    return job.bf16 ? quantize_tiles_46<true>(job, u0, u1) : quantize_tiles_46<false>(job, u0, u1);
  }
  const bool one_scale = !job.row_data || !job.col_data || std::memcmp(&job.row_amax, &job.col_amax, 4) == 0;
  if (job.two_d && !job.sr && one_scale) {
    return job.bf16 ? quantize_fast_2d<true>(job, u0, u1) : quantize_fast_2d<false>(job, u0, u1);
  }
  if (!job.two_d) {
    if (job.bf16) {
      return job.sr ? quantize_fast_usages<true, true>(job, u0, u1) : quantize_fast_usages<true, false>(job, u0, u1);
    }
    return job.sr ? quantize_fast_usages<false, true>(job, u0, u1) : quantize_fast_usages<false, false>(job, u0, u1);
  }
  if (job.bf16) return job.sr ? quantize_tiles<true, true>(job, u0, u1) : quantize_tiles<true, false>(job, u0, u1);
  return job.sr ? quantize_tiles<false, true>(job, u0, u1) : quantize_tiles<false, false>(job, u0, u1);
}

}  // namespace nvfp4_avx512
}  // namespace engine_native

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace engine_native {
namespace nvfp4_avx512 {
bool compiled() { return true; }  // outside the target pragma: callable on any CPU
}  // namespace nvfp4_avx512
}  // namespace engine_native

#else  // no AVX-512 build on this compiler / architecture

namespace engine_native {
namespace nvfp4_avx512 {
bool compiled() { return false; }
void nvfp4_amax_tiles(const Nvfp4Job&, int64_t, int64_t, uint32_t*, uint32_t*) {}
void nvfp4_quantize_tiles(const Nvfp4Job&, int64_t, int64_t) {}
}  // namespace nvfp4_avx512
}  // namespace engine_native

#endif
