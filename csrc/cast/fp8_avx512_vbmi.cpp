// Hand-written AVX-512 kernels (F, BW, DQ, VL, VBMI) of the FP8 table: at the avx512 level on CPUs with VBMI
// they replace the portable source's avx512 variant (cast/fp8_kernels.cpp), which they beat by 1.3-3x
// (measured on Zen 4, 1 thread, 4096^2: cast+transpose 45-64 vs 100-120 ms per 10 passes, MX rowwise 3-15 vs
// 31-40, block transposed 22-37 vs 58-68; the portable flat cast and block 1D rowwise are within noise).
// Compiled for that instruction set by the target pragma below, whatever flags the build uses, and only
// called after a CPUID check (fp8_table in cast/fp8.h), so the extension still loads and runs on any CPU.
//
// All helpers have internal linkage (anonymous namespace): none of this code can be
// picked by the linker for a function the portable file also defines.
//
// Data path (building blocks in avx512_vec.h): 64 input elements at a time (a "Block64")
// are loaded as magnitudes |x| in fp32, their top bytes (for the signs) and their |x|
// bits as amax keys. With a scale s > 0 and finite (always the case for block and MX
// scaling, checked for per-tensor scales), |x * s| = |x| * s and the sign of x * s is the
// sign of x, so the cast works on magnitudes and puts the signs back on the 64 packed
// bytes at once (except on NaN codes: every NaN is the canonical 0x7F).
#include <cstdint>
#include <cstring>

#include "cast/fp8.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ENGINE_HAVE_AVX512 1
#include <immintrin.h>
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi")
#endif
#endif

#ifdef ENGINE_HAVE_AVX512

#define ENGINE_AVX512_KERNELS 1
#include "cast/avx512_vec.h"

namespace engine_native {
namespace {

constexpr int64_t kMx = 32;

// Casts the region rows [0, rows) x cols [0, cols) (both <= 64) of a row-major matrix
// (element (r, c) at x[base + r * ld + c]) with per-column scales (scale[s] in the lane
// order of Block64::mag, all > 0 and finite). Writes the codes row-major to `out` (row
// stride ld_out) and/or transposed to `out_t` (row stride ld_t); returns the amax key.
// With prefetch != 0, asks for the same rows `prefetch` elements further into L2.
template <InType T, Fp8Kind K>
uint32_t cast_region64(const void* x, int64_t base, int64_t ld, int64_t rows, int64_t cols, const __m512 scale[4],
                       uint8_t* out, int64_t ld_out, uint8_t* out_t, int64_t ld_t, int64_t prefetch = 0) {
  alignas(64) uint8_t tile[64 * 64];
  const __m512i order = pack_order<T>();
  __m512i key = _mm512_setzero_si512();
  for (int64_t r = 0; r < rows; ++r) {
    if (prefetch) prefetch64<T>(x, base + r * ld + prefetch);
    Block64<T> b = load64<T>(x, base + r * ld, cols);
    key = key_max<T>(key, fold_keys<T>(b.key));
    for (int s = 0; s < 4; ++s) b.mag[s] = _mm512_mul_ps(b.mag[s], scale[s]);
    const __m512i codes = fp8_bytes<K>(b.mag, order, b.top);
    if (out) store64_stream(out + r * ld_out, codes, cols);
    if (out_t) _mm512_store_si512(tile + 64 * r, codes);
  }
  if (out_t) transpose64_store(tile, rows, cols, out_t, ld_t);
  return scalar_key<T>(key);
}

// --------------------------------------------------------------------------------- amax
template <InType T>
uint32_t amax_key_t(const void* x, int64_t begin, int64_t end) {
  __m512i k0 = _mm512_setzero_si512(), k1 = k0;
  int64_t i = begin;
  for (; i + 128 <= end; i += 128) {
    __m512i a[4], b[4];
    load_keys64<T>(x, i, 64, a);
    load_keys64<T>(x, i + 64, 64, b);
    k0 = key_max<T>(k0, fold_keys<T>(a));
    k1 = key_max<T>(k1, fold_keys<T>(b));
  }
  for (; i < end; i += 64) {
    __m512i a[4];
    load_keys64<T>(x, i, end - i, a);
    k0 = key_max<T>(k0, fold_keys<T>(a));
  }
  return scalar_key<T>(key_max<T>(k0, k1));
}

uint32_t amax_key(const void* x, InType type, int64_t begin, int64_t end) {
  switch (type) {
    case InType::F32: return amax_key_t<InType::F32>(x, begin, end);
    case InType::BF16: return amax_key_t<InType::BF16>(x, begin, end);
    default: return amax_key_t<InType::F16>(x, begin, end);
  }
}

// ----------------------------------------------------------- general per-tensor scales
// A scale that is <= 0, infinite or NaN breaks |x * s| = |x| * s (0 * inf is the default
// NaN, a negative scale flips signs but not NaN signs): these casts compute x * s per
// element, as torch does, and take the sign from the product.
template <InType T>
ENGINE_INLINE __m512 load16(const void* base, int64_t i, __mmask16 m) {
  if constexpr (T == InType::F32) {
    return _mm512_maskz_loadu_ps(m, static_cast<const float*>(base) + i);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(base) + i);
    if constexpr (T == InType::BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
  }
}

// FP8 codes of the products p in 32-bit lanes: the magnitude code (0xFF for NaN, below 0x80
// otherwise), bit 7 from p's sign unless NaN (the canonical NaN 0x7F has no sign).
template <Fp8Kind K>
ENGINE_INLINE __m512i product_codes(__m512 p) {
  const __m512i code = _mm512_min_epu32(magnitude_codes<K>(_mm512_abs_ps(p)), _mm512_set1_epi32(0xFF));
  // bit 7 (C = 0x80): sign & ~code; other bits: code
  return _mm512_ternarylogic_epi32(code, _mm512_srli_epi32(_mm512_castps_si512(p), 24), _mm512_set1_epi32(0x80), 0x58);
}

template <InType T, Fp8Kind K>
uint32_t cast_region_any_scale(const void* x, int64_t base, int64_t ld, int64_t rows, int64_t cols, float scale,
                               uint8_t* out, int64_t ld_out, uint8_t* out_t, int64_t ld_t) {
  const __m512 s = _mm512_set1_ps(scale);
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  uint32_t key = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; c += 64) {
      __m512i q[4];
      __m512i k = _mm512_setzero_si512();
      for (int g = 0; g < 4; ++g) {
        const __m512 v = load16<T>(x, base + r * ld + c + 16 * g, first16(cols - c - 16 * g));
        k = _mm512_max_epu32(k, _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7FFFFFFF)));
        q[g] = product_codes<K>(_mm512_mul_ps(v, s));
      }
      const __m512i codes = _mm512_permutexvar_epi32(
          order, _mm512_packus_epi16(_mm512_packus_epi32(q[0], q[1]), _mm512_packus_epi32(q[2], q[3])));
      const uint32_t kk = _mm512_reduce_max_epu32(k);
      key = key > kk ? key : kk;
      if (out) store64(out + r * ld_out + c, codes, cols - c);
      if (out_t) {
        alignas(64) uint8_t bytes[64];
        _mm512_store_si512(bytes, codes);
        for (int64_t j = 0; j < imin(64, cols - c); ++j) out_t[(c + j) * ld_t + r] = bytes[j];
      }
    }
  }
  return key;
}

ENGINE_INLINE bool positive_finite(float s) { return s > 0.0f && s <= 3.4028234663852886e38f; }

// --------------------------------------------------------------------------- flat cast
template <InType T, Fp8Kind K>
uint32_t cast_t(const void* x, int64_t begin, int64_t end, float scale, uint8_t* out) {
  if (!positive_finite(scale)) {
    return cast_region_any_scale<T, K>(x, begin, 0, 1, end - begin, scale, out + begin, 0, nullptr, 0);
  }
  const __m512 s = _mm512_set1_ps(scale);
  const __m512i order = pack_order<T>();
  // Past a few MiB the output will not stay in cache anyway: write it around the caches
  // (no read for ownership). Smaller outputs stay cached for whoever reads them next.
  const bool stream = end - begin >= (int64_t{1} << 22);
  __m512i key = _mm512_setzero_si512();
  for (int64_t i = begin; i < end; i += 64) {
    Block64<T> b = load64<T>(x, i, end - i);
    key = key_max<T>(key, fold_keys<T>(b.key));
    for (int q = 0; q < 4; ++q) b.mag[q] = _mm512_mul_ps(b.mag[q], s);
    const __m512i codes = fp8_bytes<K>(b.mag, order, b.top);
    if (stream) {
      store64_stream(out + i, codes, end - i);
    } else {
      store64(out + i, codes, end - i);
    }
  }
  if (stream) _mm_sfence();
  return scalar_key<T>(key);
}

template <InType T>
uint32_t cast_k(const void* x, int64_t begin, int64_t end, float scale, Fp8Kind kind, uint8_t* out) {
  return kind == Fp8Kind::E4M3 ? cast_t<T, Fp8Kind::E4M3>(x, begin, end, scale, out)
                               : cast_t<T, Fp8Kind::E5M2>(x, begin, end, scale, out);
}

uint32_t cast(const void* x, InType type, int64_t begin, int64_t end, float scale, Fp8Kind kind, uint8_t* out) {
  switch (type) {
    case InType::F32: return cast_k<InType::F32>(x, begin, end, scale, kind, out);
    case InType::BF16: return cast_k<InType::BF16>(x, begin, end, scale, kind, out);
    default: return cast_k<InType::F16>(x, begin, end, scale, kind, out);
  }
}

// ---------------------------------------------------------------------- cast transpose
template <InType T, Fp8Kind K>
uint32_t cast_transpose_t(Src x, int64_t M, int64_t Kc, int64_t r0, int64_t r1, int64_t c0, int64_t c1, float scale,
                          uint8_t* out, uint8_t* out_t) {
  const bool simple = positive_finite(scale);
  __m512 s[4];
  for (int q = 0; q < 4; ++q) s[q] = _mm512_set1_ps(scale);
  uint32_t key = 0;
  for (int64_t r = r0; r < r1; r += 64) {
    for (int64_t c = c0; c < c1; c += 64) {
      const int64_t rows = imin(64, r1 - r), cols = imin(64, c1 - c);
      uint8_t* o = out ? out + r * Kc + c : nullptr;
      uint8_t* ot = out_t ? out_t + c * M + r : nullptr;
      // prefetch the next region to the right (or the start of the next row block)
      const int64_t next = c + 64 < c1 ? 64 : 64 * x.ld + c0 - c;
      const int64_t base = r * x.ld + c;
      const uint32_t k = simple ? cast_region64<T, K>(x.data, base, x.ld, rows, cols, s, o, Kc, ot, M, next)
                                : cast_region_any_scale<T, K>(x.data, base, x.ld, rows, cols, scale, o, Kc, ot, M);
      key = key > k ? key : k;
    }
  }
  return key;
}

template <InType T>
uint32_t cast_transpose_k(Src x, int64_t M, int64_t K, int64_t r0, int64_t r1, int64_t c0, int64_t c1, float scale,
                          Fp8Kind kind, uint8_t* out, uint8_t* out_t) {
  return kind == Fp8Kind::E4M3 ? cast_transpose_t<T, Fp8Kind::E4M3>(x, M, K, r0, r1, c0, c1, scale, out, out_t)
                               : cast_transpose_t<T, Fp8Kind::E5M2>(x, M, K, r0, r1, c0, c1, scale, out, out_t);
}

uint32_t cast_transpose_region(Src x, int64_t M, int64_t K, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                               float scale, Fp8Kind kind, uint8_t* out, uint8_t* out_t) {
  uint32_t key;
  switch (x.type) {
    case InType::F32: key = cast_transpose_k<InType::F32>(x, M, K, r0, r1, c0, c1, scale, kind, out, out_t); break;
    case InType::BF16: key = cast_transpose_k<InType::BF16>(x, M, K, r0, r1, c0, c1, scale, kind, out, out_t); break;
    default: key = cast_transpose_k<InType::F16>(x, M, K, r0, r1, c0, c1, scale, kind, out, out_t); break;
  }
  _mm_sfence();  // order the streaming stores before the caller reads the data
  return key;
}

// -------------------------------------------------------------------- block scaling
// compute_scale on 16 amax keys at once (the vector form of fp8_scalar.h's compute_scale).
ENGINE_INLINE __m512 compute_scales(__m512i keys, const ScaleRule& rule) {
  __m512 a = _mm512_castsi512_ps(keys);  // a NaN key is a NaN float
  const __m512 eps = _mm512_set1_ps(rule.epsilon);
  a = _mm512_mask_mov_ps(a, _mm512_cmp_ps_mask(a, eps, _CMP_LT_OQ), eps);
  __m512 scale = _mm512_div_ps(_mm512_set1_ps(rule.fp8_max), a);
  const __m512 inf = _mm512_castsi512_ps(_mm512_set1_epi32(0x7F800000));
  scale = _mm512_mask_mov_ps(scale, _mm512_cmp_ps_mask(_mm512_abs_ps(scale), inf, _CMP_EQ_OQ),
                             _mm512_set1_ps(rule.value_for_inf));
  const __mmask16 degenerate = _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_EQ_OQ) |
                               _mm512_cmp_ps_mask(_mm512_abs_ps(a), inf, _CMP_EQ_OQ) |
                               _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
  scale = _mm512_mask_mov_ps(scale, degenerate, _mm512_set1_ps(1.0f));
  if (rule.pow2) {  // keep the sign and exponent bits
    scale = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(scale), _mm512_set1_epi32(0xFF800000u)));
  }
  return scale;
}

ENGINE_INLINE float compute_scale_key(uint32_t key, const ScaleRule& rule) {
  return _mm512_cvtss_f32(compute_scales(_mm512_set1_epi32(static_cast<int>(key)), rule));
}

// Up to 8 side-by-side tiles: rows [r0, r1), tile j = cols [c0 + j tile_cols, ...) cut
// at c_end. The amax pass walks whole row segments (sequential reads for the prefetcher),
// keeping one key per tile; the cast pass re-reads the strip from L1/L2.
template <InType T, Fp8Kind K>
void block_tiles(Src x, int64_t r0, int64_t r1, int64_t c0, int64_t c_end, int64_t tile_cols, int n,
                 const ScaleRule& rule, uint8_t* out, int64_t ld_out, float* scale_inv) {
  __m512i key[8];
  for (int j = 0; j < n; ++j) key[j] = _mm512_setzero_si512();
  for (int64_t r = r0; r < r1; ++r) {
    for (int j = 0; j < n; ++j) {
      const int64_t t0 = c0 + j * tile_cols, t1 = imin(c_end, t0 + tile_cols);
      for (int64_t c = t0; c < t1; c += 64) {
        __m512i k[4];
        load_keys64<T>(x.data, r * x.ld + c, t1 - c, k);
        key[j] = key_max<T>(key[j], fold_keys<T>(k));
      }
    }
  }
  float scale[8];
  for (int j = 0; j < n; ++j) {
    scale[j] = compute_scale_key(scalar_key<T>(key[j]), rule);
    scale_inv[j] = 1.0f / scale[j];
  }
  const __m512i order = pack_order<T>();
  // the cast pass reads the strip from L1/L2 and fetches the next group into L2 meanwhile
  const int64_t next = next_unit_offset(c0, imin(c_end, c0 + n * tile_cols), c_end, r1 - r0, x.ld);
  for (int64_t r = r0; r < r1; ++r) {
    for (int j = 0; j < n; ++j) {
      const __m512 s = _mm512_set1_ps(scale[j]);
      const int64_t t0 = c0 + j * tile_cols, t1 = imin(c_end, t0 + tile_cols);
      for (int64_t c = t0; c < t1; c += 64) {
        prefetch64<T>(x.data, r * x.ld + c + next);
        Block64<T> b = load64<T>(x.data, r * x.ld + c, t1 - c);
        for (int q = 0; q < 4; ++q) b.mag[q] = _mm512_mul_ps(b.mag[q], s);
        store64(out + r * ld_out + c, fp8_bytes<K>(b.mag, order, b.top), t1 - c);
      }
    }
  }
}

// Up to 16 whole 1x128 tiles of one row starting at element i: the 16 amaxes are reduced
// into one vector so that their scales take one vector division.
template <InType T, Fp8Kind K>
void block_1x128_group(const void* x, int64_t i, int ntiles, const ScaleRule& rule, uint8_t* out, float* scale_inv) {
  __m512i keys[16];
  for (int t = 0; t < 16; ++t) {
    if (t >= ntiles) {
      keys[t] = _mm512_setzero_si512();
      continue;
    }
    __m512i a[4], b[4];
    load_keys64<T>(x, i + 128 * t, 64, a);
    load_keys64<T>(x, i + 128 * t + 64, 64, b);
    keys[t] = key_max<T>(fold_keys<T>(a), fold_keys<T>(b));
  }
  __m512i k = reduce16<T>(keys);
  if constexpr (is16(T)) k = keys16_to_f32<T>(k);
  const __m512 scale = compute_scales(k, rule);
  alignas(64) float sc[16];
  _mm512_store_ps(sc, scale);
  _mm512_mask_storeu_ps(scale_inv, first16(ntiles), _mm512_div_ps(_mm512_set1_ps(1.0f), scale));
  const __m512i order = pack_order<T>();
  for (int t = 0; t < ntiles; ++t) {
    const __m512 s = _mm512_set1_ps(sc[t]);
    for (int h = 0; h < 2; ++h) {
      prefetch64<T>(x, i + 128 * t + 64 * h + 2048);  // the next group, in a contiguous input
      Block64<T> b = load64<T>(x, i + 128 * t + 64 * h, 64);
      for (int q = 0; q < 4; ++q) b.mag[q] = _mm512_mul_ps(b.mag[q], s);
      _mm512_storeu_si512(out + 128 * t + 64 * h, fp8_bytes<K>(b.mag, order, b.top));
    }
  }
}

template <InType T, Fp8Kind K>
void block_rowwise_t(Src x, int64_t M, int64_t Kc, const BlockParams& p, int64_t t0, int64_t t1, uint8_t* out,
                     float* scale_inv) {
  const int64_t tiles_k = (Kc + p.tile_cols - 1) / p.tile_cols;
  int64_t t = t0;
  while (t < t1) {
    const int64_t tr = t / tiles_k, tc = t % tiles_k;
    const int64_t r0 = tr * p.tile_rows, c0 = tc * p.tile_cols;
    if (p.tile_rows == 1 && p.tile_cols == 128) {
      // whole tiles left in this row (and in this thread's range), in groups of 16
      const int64_t whole = imin(Kc / 128 - tc, t1 - t);
      if (whole > 0) {
        const int n = static_cast<int>(imin(16, whole));
        block_1x128_group<T, K>(x.data, r0 * x.ld + c0, n, p.rule, out + r0 * Kc + c0, scale_inv + t);
        t += n;
        continue;
      }
    }
    // side-by-side tiles of this tile row: up to 8, and a strip of at most 256 KiB (the
    // strip and the next one, prefetched during the cast pass, stay in L2)
    const int64_t strip_cols = (256 * 1024) / (p.tile_rows * static_cast<int64_t>(is16(T) ? 2 : 4));
    const int64_t group = imin(8, strip_cols >= p.tile_cols ? strip_cols / p.tile_cols : 1);
    const int n = static_cast<int>(imin(group, imin(tiles_k - tc, t1 - t)));
    block_tiles<T, K>(x, r0, imin(M, r0 + p.tile_rows), c0, Kc, p.tile_cols, n, p.rule, out, Kc, scale_inv + t);
    t += n;
  }
}

template <InType T>
void block_rowwise_k(Src x, int64_t M, int64_t K, const BlockParams& p, int64_t t0, int64_t t1, uint8_t* out,
                     float* scale_inv) {
  if (p.kind == Fp8Kind::E4M3) return block_rowwise_t<T, Fp8Kind::E4M3>(x, M, K, p, t0, t1, out, scale_inv);
  return block_rowwise_t<T, Fp8Kind::E5M2>(x, M, K, p, t0, t1, out, scale_inv);
}

void block_rowwise(Src x, int64_t M, int64_t K, const BlockParams& p, int64_t t0, int64_t t1, uint8_t* out,
                   float* scale_inv) {
  switch (x.type) {
    case InType::F32: return block_rowwise_k<InType::F32>(x, M, K, p, t0, t1, out, scale_inv);
    case InType::BF16: return block_rowwise_k<InType::BF16>(x, M, K, p, t0, t1, out, scale_inv);
    default: return block_rowwise_k<InType::F16>(x, M, K, p, t0, t1, out, scale_inv);
  }
}

// Transposed input: the quantized tensor is y = x^T. A panel is x rows [a0, a1) (one tile
// along y's columns) by x columns [b0, b1) (whole tiles along y's rows, at most 1024;
// bindings.cpp runs the panels down the rows first):
// first the per-column amax of x over the panel, then the scales, then 64x64 regions
// cast with per-column scales and written transposed.
template <InType T, Fp8Kind K>
void block_transposed_t(Src x, int64_t A, int64_t B, const BlockParams& p, int64_t a0, int64_t a1, int64_t b0,
                        int64_t b1, uint8_t* out, float* scale_inv) {
  (void)B;
  const int64_t tiles_a = (A + p.tile_cols - 1) / p.tile_cols;
  const int64_t a_tile = a0 / p.tile_cols;
  const int64_t width = b1 - b0;
  alignas(64) uint32_t col_key[1024];
  alignas(64) float col_scale[1024 + 64];
  // per-column amax over the panel's rows, 256 columns at a time (keys in registers)
  const int64_t chunks = (width + 63) / 64;
  for (int64_t j0 = 0; j0 < chunks; j0 += 4) {
    const int64_t nj = imin(4, chunks - j0);
    __m512i k[4][4];
    for (int j = 0; j < 4; ++j)
      for (int q = 0; q < 4; ++q) k[j][q] = _mm512_setzero_si512();
    for (int64_t a = a0; a < a1; ++a) {
      for (int j = 0; j < nj; ++j) {
        const int64_t c = 64 * (j0 + j);
        __m512i v[4];
        load_keys64<T>(x.data, a * x.ld + b0 + c, width - c, v);
        for (int q = 0; q < key_vectors(T); ++q) k[j][q] = key_max<T>(k[j][q], v[q]);
      }
    }
    for (int j = 0; j < nj; ++j) {
      __m512i f[4];
      column_keys_f32<T>(k[j], f);
      for (int g = 0; g < 4; ++g) _mm512_store_si512(col_key + 64 * (j0 + j) + 16 * g, f[g]);
    }
  }
  if (p.tile_rows == 1) {
    for (int64_t c = 0; c < width; c += 16) {
      const __m512 s = compute_scales(_mm512_load_si512(col_key + c), p.rule);
      _mm512_store_ps(col_scale + c, s);
      alignas(64) float inv[16];
      _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), s));
      for (int64_t l = 0; l < imin(16, width - c); ++l) scale_inv[(b0 + c + l) * tiles_a + a_tile] = inv[l];
    }
  } else {
    for (int64_t c = 0; c < width; c += p.tile_rows) {
      const int64_t n = imin(p.tile_rows, width - c);
      uint32_t key = 0;
      for (int64_t l = 0; l < n; ++l) key = key > col_key[c + l] ? key : col_key[c + l];
      const float scale = compute_scale_key(key, p.rule);
      scale_inv[((b0 + c) / p.tile_rows) * tiles_a + a_tile] = 1.0f / scale;
      for (int64_t l = 0; l < n; ++l) col_scale[c + l] = scale;
    }
  }
  for (int64_t l = width; l < ((width + 63) / 64) * 64; ++l) col_scale[l] = 1.0f;  // lanes past the edge
  // the cast pass reads the panel from L2 and fetches the next panel into L2 meanwhile
  // the next panel (see bindings.cpp): the next tile_cols rows, or the next column panel
  const int64_t next = a1 < A ? (a1 - a0) * x.ld : (b1 - b0) - a0 * x.ld;
  for (int64_t c = 0; c < width; c += 64) {
    __m512 s[4];
    scales_in_block_order<T>(col_scale + c, s);
    for (int64_t a = a0; a < a1; a += 64) {
      cast_region64<T, K>(x.data, a * x.ld + b0 + c, x.ld, imin(64, a1 - a), imin(64, width - c), s, nullptr, 0,
                          out + (b0 + c) * A + a, A, next);
    }
  }
}

template <InType T>
void block_transposed_k(Src x, int64_t A, int64_t B, const BlockParams& p, int64_t a0, int64_t a1, int64_t b0,
                        int64_t b1, uint8_t* out, float* scale_inv) {
  if (p.kind == Fp8Kind::E4M3) return block_transposed_t<T, Fp8Kind::E4M3>(x, A, B, p, a0, a1, b0, b1, out, scale_inv);
  return block_transposed_t<T, Fp8Kind::E5M2>(x, A, B, p, a0, a1, b0, b1, out, scale_inv);
}

void block_transposed(Src x, int64_t A, int64_t B, const BlockParams& p, int64_t a0, int64_t a1, int64_t b0,
                      int64_t b1, uint8_t* out, float* scale_inv) {
  switch (x.type) {
    case InType::F32: block_transposed_k<InType::F32>(x, A, B, p, a0, a1, b0, b1, out, scale_inv); break;
    case InType::BF16: block_transposed_k<InType::BF16>(x, A, B, p, a0, a1, b0, b1, out, scale_inv); break;
    default: block_transposed_k<InType::F16>(x, A, B, p, a0, a1, b0, b1, out, scale_inv); break;
  }
  _mm_sfence();  // order the streaming stores before the caller reads the data
}

// ----------------------------------------------------------------------------- MXFP8
// E8M0 codes of 16 block amax keys (vector forms of e8m0_rceil / e8m0_floor).
template <Fp8Kind K>
ENGINE_INLINE __m512i e8m0_codes(__m512i keys, bool rceil) {
  const __m512i code_nan = _mm512_set1_epi32(0xFF);
  if (rceil) {
    constexpr float kRcp = static_cast<float>(1.0 / (K == Fp8Kind::E4M3 ? 448.0 : 57344.0));
    const __m512 d_value = _mm512_mul_ps(_mm512_castsi512_ps(keys), _mm512_set1_ps(kRcp));
    const __m512i d = _mm512_and_si512(_mm512_castps_si512(d_value), _mm512_set1_epi32(0x7FFFFFFF));
    const __m512i exponent = _mm512_srli_epi32(d, 23);
    const __m512i mantissa = _mm512_and_si512(d, _mm512_set1_epi32(0x7FFFFF));
    const __mmask16 up = _mm512_test_epi32_mask(mantissa, mantissa) &
                         _mm512_cmpneq_epu32_mask(exponent, _mm512_set1_epi32(0xFE)) &
                         ~(_mm512_cmpeq_epu32_mask(exponent, _mm512_setzero_si512()) &
                           _mm512_cmple_epu32_mask(mantissa, _mm512_set1_epi32(0x400000)));
    __m512i code = _mm512_mask_add_epi32(exponent, up, exponent, _mm512_set1_epi32(1));
    const __mmask16 inf = _mm512_cmpeq_epu32_mask(d, _mm512_set1_epi32(0x7F800000));
    code = _mm512_mask_mov_epi32(code, inf, _mm512_set1_epi32(0xFE));
    return _mm512_mask_mov_epi32(code, _mm512_cmpgt_epu32_mask(d, _mm512_set1_epi32(0x7F800000)), code_nan);
  }
  constexpr int kEmax = K == Fp8Kind::E4M3 ? 8 : 15;
  const __m512i biased = _mm512_srli_epi32(keys, 23);  // keys have no sign bit
  __m512i code = _mm512_sub_epi32(biased, _mm512_set1_epi32(kEmax));
  code = _mm512_max_epi32(_mm512_min_epi32(code, _mm512_set1_epi32(254)), _mm512_setzero_si512());
  return _mm512_mask_mov_epi32(code, _mm512_cmpeq_epu32_mask(biased, code_nan), code_nan);
}

// 2^(127 - code) per lane: 2^-127 (subnormal) for code 254, NaN for 255. Elements times
// a NaN multiplier are NaN: the canonical code 0x7F (fp8_bytes drops their sign).
ENGINE_INLINE __m512 e8m0_element_scales(__m512i code) {
  __m512i bits = _mm512_slli_epi32(_mm512_sub_epi32(_mm512_set1_epi32(254), code), 23);
  const __mmask16 subnormal = _mm512_cmpeq_epu32_mask(code, _mm512_set1_epi32(254));
  const __mmask16 nan = _mm512_cmpeq_epu32_mask(code, _mm512_set1_epi32(0xFF));
  bits = _mm512_mask_mov_epi32(bits, subnormal, _mm512_set1_epi32(0x00400000));
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(bits, nan, _mm512_set1_epi32(0x7FC00000)));
}

// 16 whole blocks (512 elements) of one row starting at element i.
template <InType T, Fp8Kind K>
void mx_row_16_blocks(const void* x, int64_t i, bool rceil, uint8_t* out, uint8_t* codes) {
  __m512i keys[16];
  for (int q = 0; q < 8; ++q) {
    __m512i k[4];
    load_keys64<T>(x, i + 64 * q, 64, k);
    if constexpr (is16(T)) {
      keys[2 * q] = k[0];
      keys[2 * q + 1] = k[1];
    } else {
      keys[2 * q] = _mm512_max_epu32(k[0], k[1]);
      keys[2 * q + 1] = _mm512_max_epu32(k[2], k[3]);
    }
  }
  __m512i k = reduce16<T>(keys);
  if constexpr (is16(T)) k = keys16_to_f32<T>(k);
  const __m512i code = e8m0_codes<K>(k, rceil);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(codes), _mm512_cvtepi32_epi8(code));
  alignas(64) float sc[16];
  _mm512_store_ps(sc, e8m0_element_scales(code));
  const __m512i order = pack_order<T>();
  for (int q = 0; q < 8; ++q) {
    prefetch64<T>(x, i + 64 * q + 2048);  // four groups ahead, in a contiguous input
    Block64<T> b = load64<T>(x, i + 64 * q, 64);
    const __m512 s0 = _mm512_set1_ps(sc[2 * q]), s1 = _mm512_set1_ps(sc[2 * q + 1]);
    b.mag[0] = _mm512_mul_ps(b.mag[0], s0);
    b.mag[1] = _mm512_mul_ps(b.mag[1], s0);
    b.mag[2] = _mm512_mul_ps(b.mag[2], s1);
    b.mag[3] = _mm512_mul_ps(b.mag[3], s1);
    _mm512_storeu_si512(out + 64 * q, fp8_bytes<K>(b.mag, order, b.top));
  }
}

// Any run of blocks (the tail of a row, possibly partial): one block per 32 elements.
template <InType T, Fp8Kind K>
void mx_row_blocks(const void* x, int64_t i, int64_t n, bool rceil, uint8_t* out, uint8_t* codes) {
  const __m512i order = pack_order<T>();
  for (int64_t c = 0; c < n; c += 64) {
    const int64_t m = imin(64, n - c);
    __m512i k[4];
    load_keys64<T>(x, i + c, m, k);
    uint32_t key[2];
    if constexpr (is16(T)) {
      __m512i z = _mm512_setzero_si512();
      key[0] = scalar_key<T>(_mm512_max_epu16(k[0], z));
      key[1] = scalar_key<T>(_mm512_max_epu16(k[1], z));
    } else {
      key[0] = scalar_key<T>(_mm512_max_epu32(k[0], k[1]));
      key[1] = scalar_key<T>(_mm512_max_epu32(k[2], k[3]));
    }
    const __m512i two_keys = _mm512_maskz_loadu_epi32(0x3, key);
    const __m512i code = e8m0_codes<K>(two_keys, rceil);
    alignas(64) uint32_t cd[16];
    alignas(64) float sc[16];
    _mm512_store_si512(cd, code);
    _mm512_store_ps(sc, e8m0_element_scales(code));
    const int nblocks = m > 32 ? 2 : 1;
    for (int b = 0; b < nblocks; ++b) codes[c / 32 + b] = static_cast<uint8_t>(cd[b]);
    Block64<T> blk = load64<T>(x, i + c, m);
    const __m512 s0 = _mm512_set1_ps(sc[0]), s1 = _mm512_set1_ps(sc[1]);
    blk.mag[0] = _mm512_mul_ps(blk.mag[0], s0);
    blk.mag[1] = _mm512_mul_ps(blk.mag[1], s0);
    blk.mag[2] = _mm512_mul_ps(blk.mag[2], s1);
    blk.mag[3] = _mm512_mul_ps(blk.mag[3], s1);
    store64(out + c, fp8_bytes<K>(blk.mag, order, blk.top), m);
  }
}

template <InType T, Fp8Kind K>
void mx_rowwise_t(Src x, int64_t Kc, bool rceil, int64_t r0, int64_t r1, uint8_t* out, uint8_t* codes) {
  const int64_t nb = (Kc + kMx - 1) / kMx;
  if (Kc % kMx == 0 && x.ld == Kc) {  // whole blocks in a dense tensor: rows [r0, r1) are one run of blocks
    const int64_t start = r0 * Kc, n = (r1 - r0) * Kc;
    int64_t c = 0;
    for (; c + 512 <= n; c += 512) {
      mx_row_16_blocks<T, K>(x.data, start + c, rceil, out + start + c, codes + (start + c) / kMx);
    }
    if (c < n) mx_row_blocks<T, K>(x.data, start + c, n - c, rceil, out + start + c, codes + (start + c) / kMx);
    return;
  }
  for (int64_t r = r0; r < r1; ++r) {
    int64_t c = 0;
    for (; c + 512 <= Kc; c += 512) {
      mx_row_16_blocks<T, K>(x.data, r * x.ld + c, rceil, out + r * Kc + c, codes + r * nb + c / 32);
    }
    if (c < Kc) mx_row_blocks<T, K>(x.data, r * x.ld + c, Kc - c, rceil, out + r * Kc + c, codes + r * nb + c / 32);
  }
}

template <InType T>
void mx_rowwise_k(Src x, int64_t K, Fp8Kind kind, bool rceil, int64_t r0, int64_t r1, uint8_t* out, uint8_t* codes) {
  if (kind == Fp8Kind::E4M3) return mx_rowwise_t<T, Fp8Kind::E4M3>(x, K, rceil, r0, r1, out, codes);
  return mx_rowwise_t<T, Fp8Kind::E5M2>(x, K, rceil, r0, r1, out, codes);
}

void mx_rowwise(Src x, int64_t M, int64_t K, Fp8Kind kind, bool rceil, int64_t r0, int64_t r1, uint8_t* out,
                uint8_t* codes) {
  (void)M;
  switch (x.type) {
    case InType::F32: return mx_rowwise_k<InType::F32>(x, K, kind, rceil, r0, r1, out, codes);
    case InType::BF16: return mx_rowwise_k<InType::BF16>(x, K, kind, rceil, r0, r1, out, codes);
    default: return mx_rowwise_k<InType::F16>(x, K, kind, rceil, r0, r1, out, codes);
  }
}

// 32x1 blocks, block-rows [br0, br1) x columns [c0, c1) (at most 512 columns): the
// column amax over the block's rows (row by row: sequential reads), the codes, then the
// rows cast with per-column multipliers (data stays row-major, not transposed) while the
// next unit is fetched into L2.
template <InType T, Fp8Kind K>
void mx_colwise_t(Src x, int64_t M, int64_t Kc, bool rceil, int64_t br0, int64_t br1, int64_t c0, int64_t c1,
                  uint8_t* out, uint8_t* codes) {
  const __m512i order = pack_order<T>();
  const int64_t width = c1 - c0, chunks = (width + 63) / 64;
  __m512i key[8][4];
  __m512 scale[8][4];
  for (int64_t br = br0; br < br1; ++br) {
    const int64_t r0 = br * kMx, r1 = imin(M, r0 + kMx);
    for (int64_t j0 = 0; j0 < chunks; j0 += 4) {  // 256 columns at a time: keys stay in registers
      const int64_t nj = imin(4, chunks - j0);
      __m512i k[4][4];
      for (int j = 0; j < 4; ++j)
        for (int q = 0; q < 4; ++q) k[j][q] = _mm512_setzero_si512();
      for (int64_t r = r0; r < r1; ++r) {
        for (int j = 0; j < nj; ++j) {
          const int64_t c = 64 * (j0 + j);
          __m512i v[4];
          load_keys64<T>(x.data, r * x.ld + c0 + c, width - c, v);
          for (int q = 0; q < key_vectors(T); ++q) k[j][q] = key_max<T>(k[j][q], v[q]);
        }
      }
      for (int j = 0; j < nj; ++j)
        for (int q = 0; q < 4; ++q) key[j0 + j][q] = k[j][q];
    }
    for (int64_t j = 0; j < chunks; ++j) {
      __m512i f[4];
      column_keys_f32<T>(key[j], f);
      alignas(64) float col_scale[64];
      for (int g = 0; g < 4; ++g) {
        const __m512i code = e8m0_codes<K>(f[g], rceil);
        const int64_t col = 64 * j + 16 * g;
        _mm512_mask_cvtepi32_storeu_epi8(codes + br * Kc + c0 + col, first16(width - col), code);
        _mm512_store_ps(col_scale + 16 * g, e8m0_element_scales(code));
      }
      scales_in_block_order<T>(col_scale, scale[j]);
    }
    const int64_t next = next_unit_offset(c0, c1, Kc, kMx, x.ld);
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t j = 0; j < chunks; ++j) {
        const int64_t c = c0 + 64 * j;
        prefetch64<T>(x.data, r * x.ld + c + next);
        Block64<T> b = load64<T>(x.data, r * x.ld + c, c1 - c);
        for (int q = 0; q < 4; ++q) b.mag[q] = _mm512_mul_ps(b.mag[q], scale[j][q]);
        store64(out + r * Kc + c, fp8_bytes<K>(b.mag, order, b.top), c1 - c);
      }
    }
  }
}

template <InType T>
void mx_colwise_k(Src x, int64_t M, int64_t K, Fp8Kind kind, bool rceil, int64_t br0, int64_t br1, int64_t c0,
                  int64_t c1, uint8_t* out, uint8_t* codes) {
  if (kind == Fp8Kind::E4M3) return mx_colwise_t<T, Fp8Kind::E4M3>(x, M, K, rceil, br0, br1, c0, c1, out, codes);
  return mx_colwise_t<T, Fp8Kind::E5M2>(x, M, K, rceil, br0, br1, c0, c1, out, codes);
}

void mx_colwise(Src x, int64_t M, int64_t K, Fp8Kind kind, bool rceil, int64_t br0, int64_t br1, int64_t c0,
                int64_t c1, uint8_t* out, uint8_t* codes) {
  switch (x.type) {
    case InType::F32: return mx_colwise_k<InType::F32>(x, M, K, kind, rceil, br0, br1, c0, c1, out, codes);
    case InType::BF16: return mx_colwise_k<InType::BF16>(x, M, K, kind, rceil, br0, br1, c0, c1, out, codes);
    default: return mx_colwise_k<InType::F16>(x, M, K, kind, rceil, br0, br1, c0, c1, out, codes);
  }
}

// ---------------------------------------------------------------------------- fp8 -> bf16
// A 256-entry table of bf16 words split into byte planes: the low byte depends on the 7
// magnitude bits only; the high byte on all 8 bits (NaN drops the sign), so it takes two
// 128-entry lookups selected by the sign bit. Built once per format (immutable after).
struct Fp8Bf16Table {
  __m512i lo0, lo1, hp0, hp1, hn0, hn1, idx_lo, idx_hi;
};

Fp8Bf16Table make_fp8_bf16_table(Fp8Kind kind) {
  alignas(64) uint8_t lo[128], hi_pos[128], hi_neg[128];
  for (int i = 0; i < 128; ++i) {
    lo[i] = static_cast<uint8_t>(fp8_to_bf16_bits(static_cast<uint8_t>(i), kind) & 0xFF);
    hi_pos[i] = static_cast<uint8_t>(fp8_to_bf16_bits(static_cast<uint8_t>(i), kind) >> 8);
    hi_neg[i] = static_cast<uint8_t>(fp8_to_bf16_bits(static_cast<uint8_t>(i | 0x80), kind) >> 8);
  }
  // interleave: word w of the first output = (lo[w], hi[w]), of the second = (lo[32+w], hi[32+w])
  alignas(64) uint8_t ilo[64], ihi[64];
  for (int w = 0; w < 32; ++w) {
    ilo[2 * w] = static_cast<uint8_t>(w);
    ilo[2 * w + 1] = static_cast<uint8_t>(64 + w);
    ihi[2 * w] = static_cast<uint8_t>(32 + w);
    ihi[2 * w + 1] = static_cast<uint8_t>(96 + w);
  }
  return {_mm512_load_si512(lo),     _mm512_load_si512(lo + 64),     _mm512_load_si512(hi_pos),
          _mm512_load_si512(hi_pos + 64), _mm512_load_si512(hi_neg), _mm512_load_si512(hi_neg + 64),
          _mm512_load_si512(ilo),    _mm512_load_si512(ihi)};
}

const Fp8Bf16Table& fp8_bf16_table(Fp8Kind kind) {
  static const Fp8Bf16Table e4m3 = make_fp8_bf16_table(Fp8Kind::E4M3), e5m2 = make_fp8_bf16_table(Fp8Kind::E5M2);
  return kind == Fp8Kind::E4M3 ? e4m3 : e5m2;
}

// The bf16 words of 64 codes (lanes past n zero): elements 0-31 in w0, 32-63 in w1.
ENGINE_INLINE void decode64(const Fp8Bf16Table& t, const uint8_t* codes, int64_t n, __m512i& w0, __m512i& w1) {
  const __m512i c = _mm512_maskz_loadu_epi8(first64(n), codes);
  const __m512i l = _mm512_permutex2var_epi8(t.lo0, c, t.lo1);
  const __m512i h = _mm512_mask_blend_epi8(_mm512_movepi8_mask(c), _mm512_permutex2var_epi8(t.hp0, c, t.hp1),
                                           _mm512_permutex2var_epi8(t.hn0, c, t.hn1));
  w0 = _mm512_permutex2var_epi8(l, t.idx_lo, h);
  w1 = _mm512_permutex2var_epi8(l, t.idx_hi, h);
}

void fp8_to_bf16(const uint8_t* codes, Fp8Kind kind, int64_t begin, int64_t end, uint16_t* out) {
  const Fp8Bf16Table& t = fp8_bf16_table(kind);
  for (int64_t i = begin; i < end; i += 64) {
    const int64_t n = imin(64, end - i);
    __m512i w0, w1;
    decode64(t, codes + i, n, w0, w1);
    if (n == 64) {
      _mm512_storeu_si512(out + i, w0);
      _mm512_storeu_si512(out + i + 32, w1);
    } else {
      _mm512_mask_storeu_epi16(out + i, first32(n), w0);
      _mm512_mask_storeu_epi16(out + i + 32, first32(n - 32), w1);
    }
  }
}

// bf16(x * s) for 16 bf16 lanes: the fp32 product, rounded to nearest even, every NaN 0x7FC0 (scaled_bf16).
ENGINE_INLINE __m256i scaled16(__m256i h, __m512 s) {
  const __m512i u = _mm512_castps_si512(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)), s));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                _mm512_set1_epi32(0x7F800000));
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0)));
}

// bf16(x * s) for 32 bf16 lanes, `shift` = log2(s) when s is a positive normal power of two, else kNoShift
// (pow2_shift). Exact, so where x is finite and not zero and the result stays normal, x's exponent field moves by
// log2(s); zeros, infinities and NaNs stay as the fp32 product gives them (NaNs as 0x7FC0). A vector with a lane
// that would leave the normal range, or any s that is not such a power of two, takes the fp32 product.

ENGINE_INLINE __m512i scaled32(__m512i x, float s, int shift) {
  if (shift != kNoShift) {
    const __m512i ex = _mm512_and_si512(_mm512_srli_epi16(x, 7), _mm512_set1_epi16(0xFF));
    const __mmask32 finite = _mm512_cmpneq_epi16_mask(ex, _mm512_setzero_si512()) &
                             _mm512_cmpneq_epi16_mask(ex, _mm512_set1_epi16(0xFF));
    const __m512i shifted = _mm512_add_epi16(ex, _mm512_set1_epi16(static_cast<int16_t>(shift)));
    const __mmask32 normal = _mm512_cmple_epu16_mask(_mm512_sub_epi16(shifted, _mm512_set1_epi16(1)),
                                                     _mm512_set1_epi16(253));  // 1 <= exponent <= 254
    if ((finite & ~normal) == 0) {
      const __mmask32 nan = _mm512_cmpgt_epu16_mask(_mm512_and_si512(x, _mm512_set1_epi16(0x7FFF)),
                                                    _mm512_set1_epi16(0x7F80));
      const __m512i y = _mm512_mask_add_epi16(x, finite, x, _mm512_set1_epi16(static_cast<int16_t>(shift * 128)));
      return _mm512_mask_mov_epi16(y, nan, _mm512_set1_epi16(0x7FC0));
    }
  }
  const __m512 sv = _mm512_set1_ps(s);
  const __m256i lo = scaled16(_mm512_castsi512_si256(x), sv), hi = scaled16(_mm512_extracti64x4_epi64(x, 1), sv);
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// scale_bf16_runs_loop, vectorised: run 1 reads one scale per 16 lanes; a run that is a multiple of 32 (MXFP8's
// 32, block scaling's 128) scales 32 lanes at a time (scaled32), one of 16 (NVFP4's) 16 lanes by the product;
// other runs take the scalar loop.
void scale_bf16(uint16_t* x, const float* s, int64_t n, int64_t run) {
  if (run == 1) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + i), scaled16(h, _mm512_loadu_ps(s + i)));
    }
    scale_bf16_loop(x + i, s + i, n - i);
    return;
  }
  if (run % 16 == 0 && run % 32 != 0) {  // NVFP4's 16
    for (int64_t i = 0, t = 0; i < n; i += run, ++t) {
      const __m512 st = _mm512_set1_ps(s[t]);
      for (int64_t j = i, end = imin(n, i + run); j < end; j += 16) {
        const __mmask16 m = first16(end - j);
        _mm256_mask_storeu_epi16(x + j, m, scaled16(_mm256_maskz_loadu_epi16(m, x + j), st));
      }
    }
    return;
  }
  if (run % 32 != 0) {
    scale_bf16_runs_loop(x, s, n, run);
    return;
  }
  for (int64_t i = 0, t = 0; i < n; i += run, ++t) {
    const int shift = pow2_shift(s[t]);
    const int64_t end = imin(n, i + run);
    for (int64_t j = i; j < end; j += 32) {
      const __mmask32 m = first32(end - j);
      _mm512_mask_storeu_epi16(x + j, m, scaled32(_mm512_maskz_loadu_epi16(m, x + j), s[t], shift));
    }
  }
}

// Lanes whose codes are finite and nonzero (magnitudes 1 .. first_special_magnitude - 1), for the 64 codes at
// `codes` (n of them).
ENGINE_INLINE __mmask64 live_codes64(const uint8_t* codes, int64_t n, Fp8Kind kind) {
  const __m512i mag = _mm512_and_si512(_mm512_maskz_loadu_epi8(first64(n), codes), _mm512_set1_epi8(0x7F));
  return _mm512_cmplt_epu8_mask(_mm512_sub_epi8(mag, _mm512_set1_epi8(1)),
                                _mm512_set1_epi8(static_cast<char>(first_special_magnitude(kind) - 1)));
}

void fp8_to_bf16_shifted(const uint8_t* codes, Fp8Kind kind, int64_t n, uint16_t* out, const int16_t* adds) {
  const Fp8Bf16Table& t = fp8_bf16_table(kind);
  for (int64_t i = 0; i < n; i += 64) {
    const int64_t len = imin(64, n - i);
    __m512i w[2];
    decode64(t, codes + i, len, w[0], w[1]);
    const __mmask64 live = live_codes64(codes + i, len, kind);
    for (int h = 0; h < 2 && 32 * h < len; ++h) {
      const __mmask32 m = first32(len - 32 * h);
      const __m512i add = _mm512_maskz_loadu_epi16(m, adds + i + 32 * h);
      _mm512_mask_storeu_epi16(out + i + 32 * h, m,
                               _mm512_mask_add_epi16(w[h], static_cast<__mmask32>(live >> (32 * h)), w[h], add));
    }
  }
}

// For the scales s[0, count): bit j of `plain` (count bits, zeroed first) set when s[j] is a power of two 2^shift
// with shift_stays_normal(kind, shift), adds[j] = shift * 128 then; 16 scales at a time. (Such shifts keep the
// biased exponent within [10, 246], so "positive, mantissa zero, shift in range" is the whole test.)
ENGINE_INLINE void plain_adds(const float* s, int64_t count, Fp8Kind kind, int16_t* adds, uint64_t* plain) {
  const __m512i min_shift = _mm512_set1_epi32(min_normal_shift(kind));
  const __m512i max_shift = _mm512_set1_epi32(max_normal_shift(kind));
  for (int64_t j = 0; j < (count + 63) / 64; ++j) plain[j] = 0;
  for (int64_t j = 0; j < count; j += 16) {
    const __mmask16 m = first16(count - j);
    const __m512i b = _mm512_castps_si512(_mm512_maskz_loadu_ps(m, s + j));
    const __m512i shift = _mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(b, 23), _mm512_set1_epi32(0xFF)),
                                           _mm512_set1_epi32(127));
    const __mmask16 ok = m & _mm512_testn_epi32_mask(b, _mm512_set1_epi32(static_cast<int>(0x807FFFFFu))) &
                         _mm512_cmpge_epi32_mask(shift, min_shift) & _mm512_cmple_epi32_mask(shift, max_shift);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(adds + j), _mm512_cvtepi32_epi16(_mm512_slli_epi32(shift, 7)));
    plain[j / 64] |= static_cast<uint64_t>(ok) << (j % 64);
  }
}

// fp8_to_bf16 of codes [0, n) and scale_bf16 of the result in one pass (a multiple-of-32 run: in registers).
// A scale that keeps every code normal adds to the exponents of the lanes whose codes are finite and nonzero
// (zeros, infinities and NaNs keep their decoded words, as scaled32 gives them); others take scaled32. Which
// scales do is found 16 at a time before the element loop (plain_adds), for up to kChunkTiles runs at once.
void fp8_to_bf16_scaled(const uint8_t* codes, Fp8Kind kind, int64_t n, uint16_t* out, const float* s, int64_t run) {
  if (run % 32 != 0) {
    fp8_to_bf16(codes, kind, 0, n, out);
    scale_bf16(out, s, n, run);
    return;
  }
  constexpr int64_t kChunkTiles = 256;
  alignas(64) int16_t adds[kChunkTiles + 16];
  uint64_t plain[kChunkTiles / 64];
  const Fp8Bf16Table& t = fp8_bf16_table(kind);
  const int64_t halves_per_run = run / 32;
  for (int64_t c0 = 0; c0 < n; c0 += kChunkTiles * run) {
    const int64_t cn = imin(kChunkTiles * run, n - c0);
    const float* cs = s + c0 / run;
    plain_adds(cs, (cn + run - 1) / run, kind, adds, plain);
    int64_t tile = 0, half = 0;  // the run of the current 32 lanes, and which 32 of that run they are
    for (int64_t i = 0; i < cn; i += 64) {
      const int64_t len = imin(64, cn - i);
      __m512i w[2];
      decode64(t, codes + c0 + i, len, w[0], w[1]);
      const __mmask64 live = live_codes64(codes + c0 + i, len, kind);
      for (int h = 0; h < 2 && 32 * h < len; ++h) {
        if (half == halves_per_run) {
          half = 0;
          ++tile;
        }
        ++half;
        const __m512i y = (plain[tile / 64] >> (tile % 64)) & 1
                              ? _mm512_mask_add_epi16(w[h], static_cast<__mmask32>(live >> (32 * h)), w[h],
                                                      _mm512_set1_epi16(adds[tile]))
                              : scaled32(w[h], cs[tile], pow2_shift(cs[tile]));
        _mm512_mask_storeu_epi16(out + c0 + i + 32 * h, first32(len - 32 * h), y);
      }
    }
  }
}

// 64 x 64 byte tiles: each read (zero past the edges) into an aligned buffer, transposed in registers.
void transpose_bytes(const uint8_t* src, int64_t rows, int64_t cols, int64_t r0, int64_t r1, uint8_t* dst) {
  alignas(64) uint8_t tile[64 * 64];
  for (int64_t r = r0; r < r1; r += 64) {
    const int64_t nr = imin(64, r1 - r);
    for (int64_t c = 0; c < cols; c += 64) {
      const int64_t nc = imin(64, cols - c);
      for (int64_t i = 0; i < 64; ++i) {
        const __m512i line = i < nr ? _mm512_maskz_loadu_epi8(first64(nc), src + (r + i) * cols + c)
                                    : _mm512_setzero_si512();
        _mm512_store_si512(tile + 64 * i, line);
      }
      transpose64_store(tile, nr, nc, dst + c * rows + r, rows, /*stream=*/false);  // a weight the GEMM reads next
    }
  }
}

}  // namespace

const Kernels* fp8_avx512_vbmi_kernels() {
  static const Kernels k = {"avx512",         amax_key,   cast,       cast_transpose_region, block_rowwise,
                            block_transposed, mx_rowwise, mx_colwise, fp8_to_bf16,
                            scale_bf16,       fp8_to_bf16_scaled, fp8_to_bf16_shifted, transpose_bytes,
                            nullptr};  // mx_both: the glue makes the two passes
  return &k;
}

}  // namespace engine_native

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else  // no AVX-512 code on this compiler / architecture

namespace engine_native {
const Kernels* fp8_avx512_vbmi_kernels() { return nullptr; }
}  // namespace engine_native

#endif
