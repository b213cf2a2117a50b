// The small exact GEMM of small_gemm.h for AVX-512 (F, BW, DQ, VL), compiled for it by the target pragma below
// whatever flags the build uses; called only after a CPUID check (bindings.cpp).
//
// Outer-product form: a tile keeps 16-wide fp32 accumulators of one output row (or column) each; per k it loads the
// packed v vectors and multiply-adds each broadcast s element into them (vfmadd231ps, fp32: no vdpbf16ps, which
// flushes bf16 subnormals). Each output lane is one sequential fma chain over k = 0..K-1 from +0 whatever the tile,
// so the numerics of small_gemm.h hold for every blocking. Two orientations (the glue picks the cheaper packing):
//   * s = A, v = B: tiles of 8 rows of out x 32 columns (16 accumulators), stored row by row;
//   * s = B, v = A: tiles of 16 columns of out x 16 rows (16 accumulators), transposed in registers, then stored.
#include <algorithm>
#include <cstdint>

#include "gemm/small_gemm.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,prefer-vector-width=512")
#endif

namespace engine_native {
namespace small_gemm_avx512 {
namespace {

#define SG_INLINE inline __attribute__((always_inline))

constexpr int kLanes = 16;
constexpr int kRowTile = 8;   // s rows per tile, s = A
constexpr int kPanelTile = 2;  // v panels per tile, s = A

SG_INLINE __mmask16 first(int64_t n) {
  return n >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << std::max<int64_t>(n, 0)) - 1u);
}

// n (<= 16) bf16 values -> fp32 lanes (exact: bf16 is fp32's top half); missing lanes +0.
SG_INLINE __m512 widen(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// r[j] lane i <- r[i] lane j: in-lane unpacks of 32- and 64-bit elements, then two rounds of 128-bit block shuffles.
SG_INLINE void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // r[4g + c], block b: column 4b + c of rows 4g..4g+3
    const __m512d a = _mm512_castps_pd(t[4 * g]), b = _mm512_castps_pd(t[4 * g + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * g + 1]), d = _mm512_castps_pd(t[4 * g + 3]);
    r[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    r[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    r[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    r[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  for (int c = 0; c < 4; ++c) {
    t[c] = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88);
    t[4 + c] = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xDD);
    t[8 + c] = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
    t[12 + c] = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xDD);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0x88);
    r[8 + c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0xDD);
    r[4 + c] = _mm512_shuffle_f32x4(t[4 + c], t[12 + c], 0x88);
    r[12 + c] = _mm512_shuffle_f32x4(t[4 + c], t[12 + c], 0xDD);
  }
}

struct Shape {
  int64_t M, N, K;
  int64_t s_prs, s_pks;  // strides of s_pack
  int64_t panels;        // of v
};

Shape shape_of(const SmallGemmJob& j) {
  const bool s_row_major = j.s.ks == 1;
  return {j.out_transposed ? j.v.rows : j.s.rows, j.out_transposed ? j.s.rows : j.v.rows, j.K,
          s_row_major ? j.K : 1, s_row_major ? 1 : j.s.rows, (j.v.rows + kLanes - 1) / kLanes};
}

// out[m, n0 .. n0 + count) = round(fp32(alpha * acc) (+ bias)), the formula of small_gemm.h.
SG_INLINE void store_row(const SmallGemmJob& j, int64_t N, int64_t m, int64_t n0, __m512 acc, int64_t count) {
  const __mmask16 mask = first(count);
  __m512 y = _mm512_mul_ps(acc, _mm512_set1_ps(j.alpha));
  if (j.bias) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(mask, j.bias + n0));
  const int64_t at = m * N + n0;
  switch (j.out_type) {
    case SgOut::F32:
      _mm512_mask_storeu_ps(static_cast<float*>(j.out) + at, mask, y);
      break;
    case SgOut::BF16: {  // round to nearest even on the bits; NaN -> 0x7FC0 (torch's), no flush of subnormals
      const __m512i bits = _mm512_castps_si512(y);
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
      __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
      r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
      _mm256_mask_storeu_epi16(static_cast<uint16_t*>(j.out) + at, mask, _mm512_cvtepi32_epi16(r));
      break;
    }
    case SgOut::F16:
      _mm256_mask_storeu_epi16(static_cast<uint16_t*>(j.out) + at, mask,
                               _mm512_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      break;
  }
}

// s = A: rows [i0, i0 + MB) of out x the NV panels from p0 (columns 16 p0 ..).
template <int MB, int NV>
void tile_rows(const SmallGemmJob& j, const Shape& sh, int64_t i0, int64_t p0) {
  const float* s[MB];
  for (int i = 0; i < MB; ++i) s[i] = j.s_pack + (i0 + i) * sh.s_prs;
  const float* v = j.v_pack + p0 * sh.K * kLanes;
  const int64_t vstride = sh.K * kLanes, sk = sh.s_pks;
  __m512 acc[MB][NV];
  for (int i = 0; i < MB; ++i) {
    for (int c = 0; c < NV; ++c) acc[i][c] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < sh.K; ++k) {
    __m512 b[NV];
    for (int c = 0; c < NV; ++c) b[c] = _mm512_loadu_ps(v + c * vstride + k * kLanes);
    for (int i = 0; i < MB; ++i) {
      const __m512 a = _mm512_set1_ps(s[i][k * sk]);
      for (int c = 0; c < NV; ++c) acc[i][c] = _mm512_fmadd_ps(a, b[c], acc[i][c]);
    }
  }
  for (int i = 0; i < MB; ++i) {
    for (int c = 0; c < NV; ++c) {
      const int64_t n0 = (p0 + c) * kLanes;
      store_row(j, sh.N, i0 + i, n0, acc[i][c], sh.N - n0);
    }
  }
}

template <int NV>
void tile_rows_tail(const SmallGemmJob& j, const Shape& sh, int64_t i0, int64_t p0, int64_t mb) {
  switch (mb) {
    case 1: return tile_rows<1, NV>(j, sh, i0, p0);
    case 2: return tile_rows<2, NV>(j, sh, i0, p0);
    case 3: return tile_rows<3, NV>(j, sh, i0, p0);
    case 4: return tile_rows<4, NV>(j, sh, i0, p0);
    case 5: return tile_rows<5, NV>(j, sh, i0, p0);
    case 6: return tile_rows<6, NV>(j, sh, i0, p0);
    case 7: return tile_rows<7, NV>(j, sh, i0, p0);
    default: return tile_rows<8, NV>(j, sh, i0, p0);
  }
}

// s = B: columns [i0, i0 + 16) of out (rows of B; past N, B's last row again, never stored) x panel p (rows
// 16 p .. of out): the 16 accumulators hold columns of out, transposed before the stores.
void tile_cols(const SmallGemmJob& j, const Shape& sh, int64_t i0, int64_t p) {
  const float* s[kLanes];
  for (int i = 0; i < kLanes; ++i) s[i] = j.s_pack + std::min(i0 + i, sh.N - 1) * sh.s_prs;
  const float* v = j.v_pack + p * sh.K * kLanes;
  const int64_t sk = sh.s_pks;
  __m512 acc[kLanes];
  for (int i = 0; i < kLanes; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < sh.K; ++k) {
    const __m512 b = _mm512_loadu_ps(v + k * kLanes);
    for (int i = 0; i < kLanes; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(s[i][k * sk]), b, acc[i]);
  }
  transpose16(acc);
  const int64_t rows = std::min<int64_t>(kLanes, sh.M - p * kLanes);
  for (int64_t t = 0; t < rows; ++t) store_row(j, sh.N, p * kLanes + t, i0, acc[t], sh.N - i0);
}

}  // namespace

bool compiled() { return true; }

int64_t v_units(const SmallGemmJob& j) { return (j.v.rows + kLanes - 1) / kLanes; }

void widen(const uint16_t* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; i += kLanes) _mm512_mask_storeu_ps(dst + i, first(n - i), widen(src + i, first(n - i)));
}

void pack_v(const SmallGemmJob& j, int64_t p0, int64_t p1) {
  const int64_t K = j.K;
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t rows = std::min<int64_t>(kLanes, j.v.rows - p * kLanes);
    float* dst = j.v_pack + p * K * kLanes;
    if (j.v.ks != 1) {  // column-major storage: the 16 rows of a k are adjacent
      const uint16_t* src = j.v.x + p * kLanes * j.v.rs;
      for (int64_t k = 0; k < K; ++k) _mm512_storeu_ps(dst + k * kLanes, widen(src + k * j.v.ks, first(rows)));
      continue;
    }
    for (int64_t k0 = 0; k0 < K; k0 += kLanes) {  // row-major: 16 x 16 blocks, transposed
      const __mmask16 kmask = first(K - k0);
      __m512 r[kLanes];
      for (int t = 0; t < kLanes; ++t) {
        r[t] = t < rows ? widen(j.v.x + (p * kLanes + t) * j.v.rs + k0, kmask) : _mm512_setzero_ps();
      }
      transpose16(r);
      const int64_t kn = std::min<int64_t>(kLanes, K - k0);
      for (int64_t t = 0; t < kn; ++t) _mm512_storeu_ps(dst + (k0 + t) * kLanes, r[t]);
    }
  }
}

int64_t tiles(const SmallGemmJob& j) {
  const Shape sh = shape_of(j);
  if (j.out_transposed) return (sh.N + kLanes - 1) / kLanes * sh.panels;
  return (sh.M + kRowTile - 1) / kRowTile * ((sh.panels + kPanelTile - 1) / kPanelTile);
}

// Tile u of a grid of `blocks` s blocks x `groups` v groups, in chunks of `chunk` s blocks: within a chunk every v
// group in turn meets every s block of the chunk, so the chunk's packed s rows (~256 KiB) stay in L2 and each
// group's v panels in L1/L2 while they are used.
struct Tile {
  int64_t block, group;
};

Tile tile_of(int64_t u, int64_t blocks, int64_t groups, int64_t chunk) {
  const int64_t c = u / (chunk * groups), in = u % (chunk * groups);
  const int64_t width = std::min(chunk, blocks - c * chunk);
  return {c * chunk + in % width, in / width};
}

int64_t chunk_blocks(int64_t rows_per_block, int64_t K) {
  return std::max<int64_t>(1, (int64_t{64} << 10) / std::max<int64_t>(1, rows_per_block * K));  // 256 KiB of fp32
}

void run_tiles(const SmallGemmJob& j, int64_t u0, int64_t u1) {
  const Shape sh = shape_of(j);
  if (j.out_transposed) {
    const int64_t nb = (sh.N + kLanes - 1) / kLanes, chunk = chunk_blocks(kLanes, sh.K);
    for (int64_t u = u0; u < u1; ++u) {
      const Tile t = tile_of(u, nb, sh.panels, chunk);
      tile_cols(j, sh, t.block * kLanes, t.group);
    }
    return;
  }
  const int64_t mb = (sh.M + kRowTile - 1) / kRowTile, chunk = chunk_blocks(kRowTile, sh.K);
  const int64_t groups = (sh.panels + kPanelTile - 1) / kPanelTile;
  for (int64_t u = u0; u < u1; ++u) {
    const Tile t = tile_of(u, mb, groups, chunk);
    const int64_t i0 = t.block * kRowTile, p0 = t.group * kPanelTile;
    const int64_t rows = std::min<int64_t>(kRowTile, sh.M - i0);
    if (sh.panels - p0 >= kPanelTile) {
      if (rows == kRowTile) {
        tile_rows<kRowTile, kPanelTile>(j, sh, i0, p0);
      } else {
        tile_rows_tail<kPanelTile>(j, sh, i0, p0, rows);
      }
    } else {
      tile_rows_tail<1>(j, sh, i0, p0, rows);
    }
  }
}

}  // namespace small_gemm_avx512
}  // namespace engine_native

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else  // no AVX-512 build on this compiler / architecture

namespace engine_native {
namespace small_gemm_avx512 {
bool compiled() { return false; }
int64_t v_units(const SmallGemmJob&) { return 0; }
void widen(const uint16_t*, int64_t, float*) {}
void pack_v(const SmallGemmJob&, int64_t, int64_t) {}
int64_t tiles(const SmallGemmJob&) { return 0; }
void run_tiles(const SmallGemmJob&, int64_t, int64_t) {}
}  // namespace small_gemm_avx512
}  // namespace engine_native

#endif
