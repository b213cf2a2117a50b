// The weight-only GEMM kernels of wo_gemm.h for AVX-512 (F, BW, DQ, VL), compiled for it by the target pragma
// below whatever flags the build uses; called only after a CPUID check (kernels_wo_gemm.cpp).
//
// A tile is MB rows of x times NR rows of w, over all of K, its MB x NR sums in zmm registers (16 fp32 lanes
// each, added up at the end). int4: each step reads 16 bytes (32 codes) of a row, widens them to 16 dwords,
// looks the low and the high nibbles up in a 16-entry fp32 table of q - 8 (vpermps reads the low 4 bits of
// its index), dequantizes both halves with one FMA each ((q - 8) * scale + zero: the product is exact, so
// this is the reference's value bit for bit) and multiply-adds them into the sums against x's even and odd
// k's (x comes deinterleaved). int8: 16 bytes -> 16 dwords -> fp32, multiply-added against x; the scale
// multiplies the finished sum.
#include <algorithm>
#include <cstdint>

#include "inference/wo_gemm.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,prefer-vector-width=512")
#endif

namespace engine_native {
namespace wo_avx512 {
namespace {

#define WO_INLINE inline __attribute__((always_inline))

WO_INLINE __m512 bits_ps(uint32_t bits) { return _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(bits))); }

// bf16 bits of a small integer v (|v| <= 8: exact), by way of fp32.
inline uint32_t bf16_of_small_int(int v) {
  const float f = static_cast<float>(v);
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  return u >> 16;
}

// A tile reads NR weight rows as NR streams at once; fetching this far ahead of each (past a row's end: the next
// tile's rows) keeps memory busy where the hardware prefetcher ramps up too slowly for short rows (M = 1 on weights
// not in the cache: int4 4096x4096 went from 2.5x to 3.5x bf16's speed). Measured best of 1, 4, 8 and 16 KiB.
constexpr int64_t kPrefetchBytes = 8192;

template <int MB, int NR>
void int4_tile(const WoInt4Job& job, int64_t m0, int64_t n0) {
  const __m512 table = _mm512_setr_ps(-8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f, 0.f, 1.f, 2.f, 3.f, 4.f, 5.f,
                                      6.f, 7.f);
  const int64_t K = job.K, kb = K / 2, groups = K / job.group, steps = job.group / kWoChunk;
  const uint8_t* w[NR];
  for (int r = 0; r < NR; ++r) w[r] = job.w + (n0 + r) * kb;
  const float* x = job.x + m0 * K;
  __m512 acc[MB][NR];
  for (int m = 0; m < MB; ++m) {
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    __m512 s[NR], z[NR];
    const uint32_t* sz = job.sz + g * job.sz_ld + n0;
    for (int r = 0; r < NR; ++r) {
      s[r] = bits_ps(sz[r] << 16);
      z[r] = bits_ps(sz[r] & 0xFFFF0000u);
    }
    for (int64_t c = 0; c < steps; ++c) {
      const int64_t k0 = (g * steps + c) * kWoChunk;
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(w[r] + k0 / 2 + kPrefetchBytes), _MM_HINT_T0);
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w[r] + k0 / 2)));
        const __m512 we = _mm512_fmadd_ps(_mm512_permutexvar_ps(b, table), s[r], z[r]);
        const __m512 wo = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table), s[r], z[r]);
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m) {
          acc[m][r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k0), we, acc[m][r]);
          acc[m][r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k0 + 16), wo, acc[m][r]);
        }
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int r = 0; r < NR; ++r) job.y[(m0 + m) * job.ldy + n0 + r] = _mm512_reduce_add_ps(acc[m][r]);
  }
}

// 16 weight bytes as fp32: int8 values, or E4M3 codes decoded exactly (the code's magnitude bits placed in an
// fp32's exponent and mantissa and scaled by 2^120, the bias difference: subnormal codes land on fp32 denormals,
// exact too, since the threads run without DAZ; the NaN codes S.1111.111 become a quiet NaN).
template <bool E4M3>
WO_INLINE __m512 weight_bytes(__m128i bytes) {
  if (!E4M3) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
  const __m512i b = _mm512_cvtepu8_epi32(bytes);
  const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7F));
  const __m512i bits = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24),
                                       _mm512_slli_epi32(mag, 20));
  const __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(1.329227995784916e36f));  // 2^120
  return _mm512_mask_mov_ps(v, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F)),
                            _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)));
}

template <int MB, int NR, bool E4M3>
void int8_tile(const WoInt8Job& job, int64_t m0, int64_t n0) {
  const int64_t K = job.K, full = K / 16 * 16;
  const int8_t* w[NR];
  for (int r = 0; r < NR; ++r) w[r] = job.w + (n0 + r) * K;
  const float* x = job.x + m0 * K;
  __m512 acc[MB][NR];
  for (int m = 0; m < MB; ++m) {
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < full; k += 16) {
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w[r] + k + kPrefetchBytes), _MM_HINT_T0);
      const __m512 wv = weight_bytes<E4M3>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w[r] + k)));
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) acc[m][r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k), wv, acc[m][r]);
    }
  }
  if (full < K) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - full)) - 1u);
    for (int r = 0; r < NR; ++r) {
      const __m512 wv = weight_bytes<E4M3>(_mm_maskz_loadu_epi8(mask, w[r] + full));
      for (int m = 0; m < MB; ++m) {
        acc[m][r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, x + m * K + full), wv, acc[m][r]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int r = 0; r < NR; ++r) {
      job.y[(m0 + m) * job.ldy + n0 + r] = _mm512_reduce_add_ps(acc[m][r]) * job.scale[n0 + r];
    }
  }
}

// Every m for the NR rows at n0: blocks of 8, 4, 2, 1 rows of x (the weight rows stay in L1 meanwhile).
template <int NR, typename Job, typename Tile8, typename Tile4, typename Tile2, typename Tile1>
WO_INLINE void all_m(const Job& job, int64_t n0, Tile8 t8, Tile4 t4, Tile2 t2, Tile1 t1) {
  int64_t m = 0;
  for (; m + 8 <= job.M; m += 8) t8(job, m, n0);
  if (m + 4 <= job.M) { t4(job, m, n0); m += 4; }
  if (m + 2 <= job.M) { t2(job, m, n0); m += 2; }
  if (m < job.M) t1(job, m, n0);
}

WO_INLINE void advance(WoInt8Job&, int64_t, int64_t) {}
WO_INLINE void advance(WoInt4Job& job, int64_t m0, int64_t groups) {
  if (job.xb) job.xb += m0 * job.K;
  if (job.xsum) job.xsum += m0 * groups;
}

// Runs rows(panel, n0, n1) on panels of the rows of x that fit in ~256 KiB (x of big M would otherwise be
// re-read from beyond L2 for every few weight rows), each over all of [n0, n1).
template <typename Job, typename Rows>
WO_INLINE void by_panels(const Job& job, int64_t n0, int64_t n1, int64_t x_row_bytes, int64_t groups, Rows rows) {
  const int64_t panel = std::max<int64_t>(4, (int64_t{256} << 10) / std::max<int64_t>(1, x_row_bytes) / 4 * 4);
  if (job.M <= panel) return rows(job, n0, n1);
  for (int64_t m0 = 0; m0 < job.M; m0 += panel) {
    Job part = job;
    part.M = std::min(panel, job.M - m0);
    part.y = job.y + m0 * job.ldy;
    if (part.x) part.x = job.x + m0 * job.K;
    advance(part, m0, groups);
    rows(part, n0, n1);
  }
}

}  // namespace

bool compiled() { return true; }

namespace {
// Rows per tile: 4 for a single row of x (more independent sums), else 2 (the 8 x 2 tile's 16 sums fill half
// the registers).
void int4_panel(const WoInt4Job& job, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (job.M == 1) {
    for (; n + 4 <= n1; n += 4) int4_tile<1, 4>(job, 0, n);
  } else {
    for (; n + 2 <= n1; n += 2) {
      all_m<2>(job, n, int4_tile<8, 2>, int4_tile<4, 2>, int4_tile<2, 2>, int4_tile<1, 2>);
    }
  }
  for (; n < n1; ++n) all_m<1>(job, n, int4_tile<8, 1>, int4_tile<4, 1>, int4_tile<2, 1>, int4_tile<1, 1>);
}

template <bool E4M3>
void byte_panel(const WoInt8Job& job, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (job.M == 1) {
    for (; n + 4 <= n1; n += 4) int8_tile<1, 4, E4M3>(job, 0, n);
  } else {
    for (; n + 2 <= n1; n += 2) {
      all_m<2>(job, n, int8_tile<8, 2, E4M3>, int8_tile<4, 2, E4M3>, int8_tile<2, 2, E4M3>, int8_tile<1, 2, E4M3>);
    }
  }
  for (; n < n1; ++n) {
    all_m<1>(job, n, int8_tile<8, 1, E4M3>, int8_tile<4, 1, E4M3>, int8_tile<2, 1, E4M3>, int8_tile<1, 1, E4M3>);
  }
}
}  // namespace

void int4_rows(const WoInt4Job& job, int64_t n0, int64_t n1) {
  by_panels(job, n0, n1, job.K * 4, job.K / job.group, int4_panel);
}

void int8_rows(const WoInt8Job& job, int64_t n0, int64_t n1) {
  if (job.e4m3) return by_panels(job, n0, n1, job.K * 4, 0, byte_panel<true>);
  by_panels(job, n0, n1, job.K * 4, 0, byte_panel<false>);
}

}  // namespace wo_avx512
}  // namespace engine_native

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

// ------------------------------------------------------------------------------ int4, bf16 x (AVX512-BF16)
// Each step reads 32 bytes (64 codes) of a row, widens them to 32 words, looks the low and the high nibbles up
// in a 32-entry table of bf16(q - 8) (vpermw reads the low 5 bits of its index; the table repeats every 16, so
// the bit above the nibble does not matter) and multiply-adds both against x's even and odd k's with vdpbf16ps
// (products of bf16 x and q - 8 are exact in fp32). At the end of a group: sums = fma(t, scale, sums), then
// sums += zero * (the group's x sum, in lane 0).
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,prefer-vector-width=512")
#endif

namespace engine_native {
namespace wo_avx512 {
namespace {

constexpr int64_t kStep = 64;

// PAIR (group size 32): a step holds two groups, the first in lanes 0-7 of the sums, the second in lanes 8-15.
template <int MB, int NR, bool PAIR>
void int4_tile_bf16(const WoInt4Job& job, int64_t m0, int64_t n0) {
  alignas(64) uint16_t entries[32];
  for (int i = 0; i < 32; ++i) entries[i] = static_cast<uint16_t>(bf16_of_small_int((i & 15) - 8));
  const __m512i table = _mm512_load_si512(entries);
  const int64_t K = job.K, kb = K / 2, groups = K / job.group, steps = PAIR ? 1 : job.group / kStep;
  const int64_t blocks = PAIR ? K / kStep : groups;  // the scale blocks: a group, or a pair of them
  const uint8_t* w[NR];
  for (int r = 0; r < NR; ++r) w[r] = job.w + (n0 + r) * kb;
  const uint16_t* x = job.xb + m0 * K;
  const float* xsum = job.xsum + m0 * groups;
  __m512 acc[MB][NR];
  for (int m = 0; m < MB; ++m) {
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
  }
  if ((n0 & 15) == 0) {  // a group's scales of 16 rows share a line, a line per group: fetch the next 16 rows'
    for (int64_t g = 0; g < groups; ++g) {
      _mm_prefetch(reinterpret_cast<const char*>(job.sz + g * job.sz_ld + n0 + 16), _MM_HINT_T0);
    }
  }
  for (int64_t g = 0; g < blocks; ++g) {
    __m512 t[MB][NR], u[MB][NR];
    for (int m = 0; m < MB; ++m) {
      for (int r = 0; r < NR; ++r) t[m][r] = u[m][r] = _mm512_setzero_ps();
    }
    for (int64_t c = 0; c < steps; ++c) {
      const int64_t k0 = (g * steps + c) * kStep;
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(w[r] + k0 / 2 + kPrefetchBytes), _MM_HINT_T0);
        const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r] + k0 / 2)));
        const __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(b, table);
        const __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), table);
#pragma GCC unroll 4
        for (int m = 0; m < MB; ++m) {
          t[m][r] = _mm512_dpbf16_ps(t[m][r], (__m512bh)_mm512_loadu_si512(x + m * K + k0), lo);
          u[m][r] = _mm512_dpbf16_ps(u[m][r], (__m512bh)_mm512_loadu_si512(x + m * K + k0 + 32), hi);
        }
      }
    }
    const int64_t first = PAIR ? 2 * g : g;  // the block's first group
    const uint32_t* sz = job.sz + first * job.sz_ld + n0;
    for (int r = 0; r < NR; ++r) {
      __m512 s = bits_ps(sz[r] << 16), z = bits_ps(sz[r] & 0xFFFF0000u);
      if (PAIR) {
        const uint32_t next = sz[job.sz_ld + r];
        s = _mm512_mask_blend_ps(0xFF00, s, bits_ps(next << 16));
        z = _mm512_mask_blend_ps(0xFF00, z, bits_ps(next & 0xFFFF0000u));
      }
      for (int m = 0; m < MB; ++m) {
        acc[m][r] = _mm512_fmadd_ps(_mm512_add_ps(t[m][r], u[m][r]), s, acc[m][r]);
        // the x sum of the group in lane 0 (and of the next one in lane 9, PAIR: the pair broadcast, masked)
        const float* sums = xsum + m * groups + first;
        const __m512 xs = PAIR ? _mm512_maskz_broadcast_f32x2(0x0201, _mm_castpd_ps(_mm_load_sd(
                                     reinterpret_cast<const double*>(sums))))
                               : _mm512_maskz_loadu_ps(1, sums);
        acc[m][r] = _mm512_fmadd_ps(z, xs, acc[m][r]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int r = 0; r < NR; ++r) job.y[(m0 + m) * job.ldy + n0 + r] = _mm512_reduce_add_ps(acc[m][r]);
  }
}

template <int NR, bool PAIR>
void int4_all_m_bf16(const WoInt4Job& job, int64_t n0) {
  int64_t m = 0;
  for (; m + 4 <= job.M; m += 4) int4_tile_bf16<4, NR, PAIR>(job, m, n0);
  if (m + 2 <= job.M) {
    int4_tile_bf16<2, NR, PAIR>(job, m, n0);
    m += 2;
  }
  if (m < job.M) int4_tile_bf16<1, NR, PAIR>(job, m, n0);
}

}  // namespace

bool compiled_bf16() { return true; }


namespace {
template <bool PAIR>
void int4_panel_bf16(const WoInt4Job& job, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (job.M == 1) {
    for (; n + 4 <= n1; n += 4) int4_tile_bf16<1, 4, PAIR>(job, 0, n);
  } else {
    for (; n + 2 <= n1; n += 2) int4_all_m_bf16<2, PAIR>(job, n);
  }
  for (; n < n1; ++n) int4_all_m_bf16<1, PAIR>(job, n);
}
}  // namespace

void int4_rows_bf16(const WoInt4Job& job, int64_t n0, int64_t n1) {
  if (job.group == 32) return by_panels(job, n0, n1, job.K * 2, job.K / job.group, int4_panel_bf16<true>);
  by_panels(job, n0, n1, job.K * 2, job.K / job.group, int4_panel_bf16<false>);
}

}  // namespace wo_avx512
}  // namespace engine_native

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else  // no AVX-512 build on this compiler / architecture

namespace engine_native {
namespace wo_avx512 {
bool compiled() { return false; }
bool compiled_bf16() { return false; }
void int4_rows(const WoInt4Job&, int64_t, int64_t) {}
void int4_rows_bf16(const WoInt4Job&, int64_t, int64_t) {}
void int8_rows(const WoInt8Job&, int64_t, int64_t) {}
}  // namespace wo_avx512
}  // namespace engine_native

#endif
