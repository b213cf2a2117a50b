// int4 weight-only GEMM with bf16 x on CPUs with AVX512-BF16 (WoKernels::int4_rows_bf16), part of the AVX-512
// variant of wo_gemm_kernels.cpp (included from there only), chosen at run time by CPUID. Intrinsics: vdpbf16ps
// has no portable spelling. Measured against the portable path of the same variant (M = 1, one thread, weights
// cycled through 128 MiB, Zen 4, loaded machine): 1.24x (4096x4096 g128), 1.11x (g32), 1.23x (4096x11008 g128
// and g32), below the 1.3x of the rule for hand intrinsics, but without it int4 with bf16 x at avx512 would be
// that much slower than the hand-written kernels it replaces: kept (the lead's call).
//
// Each step reads 32 bytes (64 codes) of a row, widens them to 32 words, looks the low and the high nibbles up
// in a 32-entry table of bf16(q - 8) (vpermw reads the low 5 bits of its index; the table repeats every 16, so
// the bit above the nibble does not matter) and multiply-adds both against x's even and odd k's with vdpbf16ps
// (products of bf16 x and q - 8 are exact in fp32). At the end of a group: sums = fma(t, scale, sums), then
// sums += zero * (the group's x sum, in lane 0).
#pragma once

#ifndef ENGINE_WO_BF16
#error "wo_gemm_bf16_kernels.h is part of the AVX-512 variant of wo_gemm_kernels.cpp"
#endif

namespace engine_native {
namespace ENGINE_ISA_NS {
namespace {

#define WO_BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

bool bf16_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16");
}

// x bf16 bits -> each run of 64 k's as even k's, then odd k's; the fp32 sum of x over each group.
void int4_pack_x_bf16(const uint16_t* xbits, const float* x, int64_t M, int64_t K, int64_t group, uint16_t* xb,
                      float* xsum) {
  for (int64_t i = 0; i < M * K; i += 64) {
    for (int64_t j = 0; j < 32; ++j) {
      xb[i + j] = xbits[i + 2 * j];
      xb[i + 32 + j] = xbits[i + 2 * j + 1];
    }
  }
  for (int64_t i = 0; i < M * K / group; ++i) {
    float sum = 0.0f;
    for (int64_t k = 0; k < group; ++k) sum += x[i * group + k];
    xsum[i] = sum;
  }
}

WO_BF16 WO_INLINE __m512 bits_ps(uint32_t bits) { return _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(bits))); }

// bf16 bits of a small integer v (|v| <= 8: exact), by way of fp32.
inline uint32_t bf16_of_small_int(int v) {
  const float f = static_cast<float>(v);
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u >> 16;
}

constexpr int64_t kStep = 64;

// PAIR (group size 32): a step holds two groups, the first in lanes 0-7 of the sums, the second in lanes 8-15.
template <int MB, int NR, bool PAIR>
WO_BF16 void int4_tile_bf16(const WoInt4Job& job, int64_t m0, int64_t n0) {
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
        // the x sum of the group in lane 0 (and of the next one in lane 8, PAIR: the pair broadcast, masked)
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
WO_BF16 void int4_all_m_bf16(const WoInt4Job& job, int64_t n0) {
  int64_t m = 0;
  for (; m + 4 <= job.M; m += 4) int4_tile_bf16<4, NR, PAIR>(job, m, n0);
  if (m + 2 <= job.M) {
    int4_tile_bf16<2, NR, PAIR>(job, m, n0);
    m += 2;
  }
  if (m < job.M) int4_tile_bf16<1, NR, PAIR>(job, m, n0);
}

template <bool PAIR>
WO_BF16 void int4_panel_bf16(const WoInt4Job& job, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (job.M == 1) {
    for (; n + 4 <= n1; n += 4) int4_tile_bf16<1, 4, PAIR>(job, 0, n);
  } else {
    for (; n + 2 <= n1; n += 2) int4_all_m_bf16<2, PAIR>(job, n);
  }
  for (; n < n1; ++n) int4_all_m_bf16<1, PAIR>(job, n);
}

void int4_rows_bf16(const WoInt4Job& job, int64_t n0, int64_t n1) {
  if (job.group == 32) return by_panels(job, n0, n1, job.K * 2, job.K / job.group, int4_panel_bf16<true>);
  by_panels(job, n0, n1, job.K * 2, job.K / job.group, int4_panel_bf16<false>);
}

#undef WO_BF16

}  // namespace
}  // namespace ENGINE_ISA_NS
}  // namespace engine_native
