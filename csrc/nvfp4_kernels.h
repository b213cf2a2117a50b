// NVFP4 kernels without torch: the per-element rules and the tile loops, included by kernels_nvfp4.cpp
// (portable build) and kernels_nvfp4_avx512.cpp (after its AVX-512 target pragma). Everything is in an
// anonymous namespace, so each file gets its own copy compiled for its own instruction set. Each includer
// defines NVFP4_NAMESPACE, the namespace of its entry points.
//
// Bit for bit engine/ops/nvfp4.py (TE's order of fp32 operations) and engine/ops/nvfp4_sr.py:
//   S_enc = fmin(2688 / amax, FLT_MAX), 1 if amax is 0 or that is 0; S_dec = 1 / S_enc
//   s_b   = e4m3_rne_satfinite(block_amax * (S_enc * fp32(1/6))), NaN -> 0x7F
//   enc_b = fmin(1 / (float(s_b) * S_dec), FLT_MAX);  q = e2m1(x * enc_b), RNE or stochastic
//   RHT   y[k] = bf16(sum_{i=0..15} x_i * H[i][k]) in fp32 in that order, H = diag(signs) H16 / 4
// A tile is 16 rows x kNvfp4TileCols columns of x, converted to fp32 once: its rows hold the rowwise 1x16
// blocks, its columns the columnwise 16x1 blocks (of x, or of the RHT of the 16 tokens), its 16x16 squares
// the 2D tiles. The rules are branch-free fp32 / integer operations in loops over short arrays, which the
// compiler vectorises (SSE2 in the portable build, AVX-512 in the other). The threads run with
// round-to-nearest and without flush-to-zero or denormals-are-zero (the glue sets MXCSR).
#pragma once

#include <cstdint>
#include <cstring>

#include "nvfp4.h"

#ifndef NVFP4_NAMESPACE
#error "define NVFP4_NAMESPACE before including nvfp4_kernels.h"
#endif

namespace engine_native {
namespace NVFP4_NAMESPACE {

namespace {

constexpr int64_t kB = kNvfp4Block;
constexpr int64_t kT = kNvfp4TileCols;
constexpr float kFltMax = 3.4028234663852886e38f;

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint32_t umax(uint32_t a, uint32_t b) { return a > b ? a : b; }

// ------------------------------------------------------------------------------ element rules
// The E2M1 code of |a| (a >= 0 or NaN) rounded to nearest even, saturating: the count of grid midpoints
// below it (a tie goes to the even code: > at a midpoint whose lower neighbour has an even code, >= else).
inline uint32_t e2m1_magnitude(float a) {
  return static_cast<uint32_t>(a > 0.25f) + static_cast<uint32_t>(a >= 0.75f) + static_cast<uint32_t>(a > 1.25f) +
         static_cast<uint32_t>(a >= 1.75f) + static_cast<uint32_t>(a > 2.5f) + static_cast<uint32_t>(a >= 3.5f) +
         static_cast<uint32_t>(a > 5.0f);
}

// mx_elements.encode(y, E2M1): RNE, +-inf -> +-6, NaN -> 0, the sign kept (-0 -> 8).
inline uint32_t e2m1_rne(float y) {
  const uint32_t b = bits_of(y);
  const uint32_t code = e2m1_magnitude(float_of(b & 0x7FFFFFFFu)) | ((b >> 28) & 8u);
  return (b & 0x7FFFFFFFu) > 0x7F800000u ? 0u : code;
}

// nvfp4_sr.encode_e2m1_stochastic for one element with random byte r: a = min(|y|, 6), step the grid step at
// a, lo = floor(a / step) * step; up one step iff (a - lo) / step * 256 >= 256 - r (every operation exact).
inline uint32_t e2m1_stochastic(float y, uint32_t r) {
  const uint32_t b = bits_of(y);
  const float mag = float_of(b & 0x7FFFFFFFu);
  const float a = mag < 6.0f ? mag : 6.0f;  // NaN -> 6, zeroed below
  const float step = a < 2.0f ? 0.5f : (a < 4.0f ? 1.0f : 2.0f);
  const float inv = a < 2.0f ? 2.0f : (a < 4.0f ? 1.0f : 0.5f);
  const float lo = static_cast<float>(static_cast<int32_t>(a * inv)) * step;  // a * inv >= 0: truncation is floor
  const float frac256 = (a - lo) * (inv * 256.0f);
  const bool up = (frac256 >= static_cast<float>(256u - r)) & (lo < 6.0f);
  const float value = up ? lo + step : lo;
  const uint32_t code = e2m1_magnitude(value) | ((b >> 28) & 8u);
  return (b & 0x7FFFFFFFu) > 0x7F800000u ? 0u : code;
}

// ------------------------------------------------------------------------------ the random bits
inline uint32_t hash32(uint32_t v) {  // "lowbias32"
  v ^= v >> 16;
  v *= 0x7FEB352Du;
  v ^= v >> 15;
  v *= 0x846CA68Bu;
  return v ^ (v >> 16);
}

inline uint32_t seed_key(uint64_t seed) {
  return hash32(static_cast<uint32_t>(seed)) ^ static_cast<uint32_t>(seed >> 32);
}

// The random byte of counter index j = (hi << 32) + lo (nvfp4_sr.random_bits).
inline uint32_t random_byte(uint32_t lo, uint32_t hi, uint32_t key) {
  return hash32(hash32(lo) ^ key ^ (hi * 0x9E3779B9u)) & 0xFFu;
}

// ------------------------------------------------------------------------------ scales
// E4M3 code of v, RNE, saturating at 448, NaN -> 0x7F, the sign kept (reference.cast_to_fp8). With c = min(|v|,
// 448) and e = max(c's exponent field, 121 = that of 2^-6, E4M3's smallest normal), the fp32 sum c + M with
// M = 2^(e - 107) + ((e - 121) << 3) ulps has E4M3's step at c as its ulp: it rounds c to that step, ties to
// even, and its low mantissa bits are the code (subnormals included, no fp32 subnormal arithmetic needed).
inline uint32_t e4m3_code(float v) {
  const uint32_t b = bits_of(v);
  const uint32_t mag = b & 0x7FFFFFFFu;
  const uint32_t c = mag < 0x43E00000u ? mag : 0x43E00000u;
  const uint32_t field = (c >> 23) > 121u ? (c >> 23) : 121u;
  const uint32_t magic = ((field + 20u) << 23) + ((field - 121u) << 3);
  const uint32_t code = (bits_of(float_of(c) + float_of(magic)) & 0x7FFFFFu) | ((b >> 24) & 0x80u);
  return mag > 0x7F800000u ? 0x7Fu : code;
}

// The fp32 value of an E4M3 code: its bits placed as an fp32 with the exponent 120 too small, times 2^120
// (exact, subnormal codes included); 0x7F / 0xFF are NaN.
inline float e4m3_value(uint32_t code) {
  const float m = float_of((code & 0x7Fu) << 20) * 0x1p120f;
  const float v = float_of(bits_of(m) | ((code & 0x80u) << 24));
  return (code & 0x7Fu) == 0x7Fu ? float_of(0x7FC00000u) : v;
}

// A usage's per-tensor factors (nvfp4.encode_scale and its reciprocal, and the block multiplier).
struct TensorScale {
  float s_dec, mult;
};

inline TensorScale tensor_scale(float amax) {
  float s = 2688.0f / amax;
  s = s < kFltMax ? s : kFltMax;  // fmin: a NaN quotient gives FLT_MAX
  if (amax == 0.0f || s == 0.0f) s = 1.0f;
  return {1.0f / s, s * static_cast<float>(1.0 / 6.0)};
}

// The E4M3 scale code of a block from its amax key, and the factor of its elements.
inline uint32_t block_code(uint32_t key, const TensorScale& ts) { return e4m3_code(float_of(key) * ts.mult); }

inline float block_encode(uint32_t code, const TensorScale& ts) {
  const float e = 1.0f / (e4m3_value(code) * ts.s_dec);
  return e < kFltMax ? e : kFltMax;  // fmin(., FLT_MAX): NaN and inf give FLT_MAX
}

// ------------------------------------------------------------------------------ the RHT
// Sign of H[i][k]: TE's sign vector times Sylvester's H16 (-1 where popcount(i & k) is odd).
constexpr int kRhtSigns[16] = {1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1};

constexpr float h_sign(int i, int k) {
  return static_cast<float>(kRhtSigns[i] * ((__builtin_popcount(static_cast<unsigned>(i & k)) & 1) ? -1 : 1));
}

struct SignTable {
  float s[16][16];
};

constexpr SignTable make_signs() {
  SignTable t{};
  for (int i = 0; i < 16; ++i) {
    for (int k = 0; k < 16; ++k) t.s[i][k] = h_sign(i, k);
  }
  return t;
}

constexpr SignTable kSigns = make_signs();

inline float bf16_round(float v) {
  const uint32_t u = bits_of(v);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? float_of(0x7FC00000u) : float_of(r);
}

// y[k][c] = bf16(sum_i t[i][c] * H[i][k]) for the 16 tokens t[0..15][c] of each column c. x_i * (+-1/4) is
// +-(x_i * 0.25) exactly, so each term is q_i or -q_i with q_i = x_i * 0.25, added in the order i = 0..15.
inline void rht_tile(const float (*__restrict t)[kT], float (*__restrict y)[kT]) {
  for (int64_t c = 0; c < kT; ++c) {
    float q[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) q[i] = t[i][c] * 0.25f;
#pragma GCC unroll 16
    for (int k = 0; k < 16; ++k) {
      float acc = q[0] * kSigns.s[0][k];
#pragma GCC unroll 16
      for (int i = 1; i < 16; ++i) acc = acc + q[i] * kSigns.s[i][k];
      y[k][c] = bf16_round(acc);
    }
  }
}

// ------------------------------------------------------------------------------ tiles
template <bool BF16>
inline float load(const void* x, int64_t i) {
  if (BF16) return float_of(static_cast<uint32_t>(static_cast<const uint16_t*>(x)[i]) << 16);
  return static_cast<const float*>(x)[i];
}

struct TileBox {
  int64_t r0, rows, c0, w;
};

inline TileBox tile_box(const Nvfp4Job& job, int64_t u) {
  const int64_t col_tiles = (job.K + kT - 1) / kT;
  const int64_t r0 = (u / col_tiles) * kB, c0 = (u % col_tiles) * kT;
  return {r0, (r0 + kB < job.M ? r0 + kB : job.M) - r0, c0, (c0 + kT < job.K ? c0 + kT : job.K) - c0};
}

// x[r0 + i, c0 + c] as fp32 into t[i][c], zero-padded to 16 x kT (zeros change no amax and get code 0).
template <bool BF16>
inline void load_tile(const Nvfp4Job& job, const TileBox& b, float (*__restrict t)[kT]) {
  for (int64_t i = 0; i < kB; ++i) {
    if (i < b.rows) {
      const int64_t base = (b.r0 + i) * job.ld + b.c0;
      for (int64_t c = 0; c < b.w; ++c) t[i][c] = load<BF16>(job.x, base + c);
      for (int64_t c = b.w; c < kT; ++c) t[i][c] = 0.0f;
    } else {
      for (int64_t c = 0; c < kT; ++c) t[i][c] = 0.0f;
    }
  }
}

inline uint32_t tile_key(const float (*__restrict t)[kT]) {
  uint32_t key = 0;
  for (int64_t i = 0; i < kB; ++i) {
    for (int64_t c = 0; c < kT; ++c) key = umax(key, bits_of(t[i][c]) & 0x7FFFFFFFu);
  }
  return key;
}

template <bool BF16>
void amax_tiles(const Nvfp4Job& job, int64_t u0, int64_t u1, uint32_t* x_key, uint32_t* rht_key) {
  alignas(64) float t[kB][kT];
  alignas(64) float y[kB][kT];
  uint32_t xk = 0, yk = 0;
  for (int64_t u = u0; u < u1; ++u) {
    const TileBox b = tile_box(job, u);
    load_tile<BF16>(job, b, t);
    if (x_key) xk = umax(xk, tile_key(t));
    if (rht_key) {
      rht_tile(t, y);
      yk = umax(yk, tile_key(y));
    }
  }
  if (x_key) *x_key = xk;
  if (rht_key) *rht_key = yk;
}

// Packs 16 codes per 16 values of `row` (kT of them) into bytes, two per byte, element 2i in the low nibble.
inline void pack_row(const uint8_t* __restrict q, int64_t w, uint8_t* __restrict out) {
  const int64_t pairs = (w + 1) / 2;
  for (int64_t p = 0; p < pairs; ++p) out[p] = static_cast<uint8_t>(q[2 * p] | (q[2 * p + 1] << 4));
}

// The rowwise usage of a tile: 1x16 blocks of each row (or the 16x16 tiles' keys `tile_keys` when 2D).
template <bool SR>
void rowwise_tile(const Nvfp4Job& job, const TileBox& b, const float (*__restrict t)[kT],
                  const uint32_t* __restrict tile_keys, uint32_t rkey) {
  const TensorScale ts = tensor_scale(job.row_amax);
  const int64_t nbk = (job.K + kB - 1) / kB, kp = (job.K + 1) / 2, blocks = (b.w + kB - 1) / kB;
  alignas(64) uint32_t codes[kT / kB];
  alignas(64) float enc[kT / kB];
  alignas(64) uint8_t q[kT];
  if (job.two_d) {
    for (int64_t j = 0; j < kT / kB; ++j) {
      codes[j] = block_code(tile_keys[j], ts);
      enc[j] = block_encode(codes[j], ts);
    }
  }
  for (int64_t i = 0; i < b.rows; ++i) {
    const float* __restrict row = t[i];
    if (!job.two_d) {
      for (int64_t j = 0; j < kT / kB; ++j) {
        uint32_t key = 0;
        for (int64_t c = 0; c < kB; ++c) key = umax(key, bits_of(row[j * kB + c]) & 0x7FFFFFFFu);
        codes[j] = block_code(key, ts);
        enc[j] = block_encode(codes[j], ts);
      }
    }
    const int64_t r = b.r0 + i;
    uint8_t* scales = job.row_scales + r * nbk + b.c0 / kB;
    for (int64_t j = 0; j < blocks; ++j) scales[j] = static_cast<uint8_t>(codes[j]);
    if (SR) {
      const uint64_t base = job.row_offset + static_cast<uint64_t>(r) * static_cast<uint64_t>(job.K) +
                            static_cast<uint64_t>(b.c0);
      const uint32_t blo = static_cast<uint32_t>(base), bhi = static_cast<uint32_t>(base >> 32);
      for (int64_t j = 0; j < kT / kB; ++j) {
        for (int64_t c = 0; c < kB; ++c) {
          const uint32_t lo = blo + static_cast<uint32_t>(j * kB + c);
          const uint32_t rb = random_byte(lo, bhi + static_cast<uint32_t>(lo < blo), rkey);
          q[j * kB + c] = static_cast<uint8_t>(e2m1_stochastic(row[j * kB + c] * enc[j], rb));
        }
      }
    } else {
      for (int64_t j = 0; j < kT / kB; ++j) {
        for (int64_t c = 0; c < kB; ++c) q[j * kB + c] = static_cast<uint8_t>(e2m1_rne(row[j * kB + c] * enc[j]));
      }
    }
    pack_row(q, b.w, job.row_data + r * kp + b.c0 / 2);
  }
}

// The columnwise usage of a tile: the 16x1 blocks of its columns, of `src` (x, or the RHT output).
template <bool SR>
void columnwise_tile(const Nvfp4Job& job, const TileBox& b, const float (*__restrict src)[kT],
                     const uint32_t* __restrict tile_keys, uint32_t rkey) {
  const TensorScale ts = tensor_scale(job.col_amax);
  const int64_t nbm = (job.M + kB - 1) / kB, mp = (job.M + 1) / 2;
  alignas(64) uint32_t codes[kT];
  alignas(64) float enc[kT];
  alignas(64) uint32_t lo_word[kT];
  alignas(64) uint32_t hi_word[kT];
  alignas(64) uint32_t base_lo[kT];
  alignas(64) uint32_t base_hi[kT];
  if (job.two_d) {
    for (int64_t j = 0; j < kT / kB; ++j) {
      const uint32_t code = block_code(tile_keys[j], ts);
      const float e = block_encode(code, ts);
      for (int64_t c = 0; c < kB; ++c) {
        codes[j * kB + c] = code;
        enc[j * kB + c] = e;
      }
    }
  } else {
    for (int64_t c = 0; c < kT; ++c) codes[c] = 0;
    for (int64_t k = 0; k < kB; ++k) {
      for (int64_t c = 0; c < kT; ++c) codes[c] = umax(codes[c], bits_of(src[k][c]) & 0x7FFFFFFFu);
    }
    for (int64_t c = 0; c < kT; ++c) {
      codes[c] = block_code(codes[c], ts);
      enc[c] = block_encode(codes[c], ts);
    }
  }
  const int64_t block_row = b.r0 / kB;
  for (int64_t c = 0; c < b.w; ++c) job.col_scales[(b.c0 + c) * nbm + block_row] = static_cast<uint8_t>(codes[c]);
  for (int64_t c = 0; c < kT; ++c) {
    lo_word[c] = 0;
    hi_word[c] = 0;
  }
  if (SR) {
    for (int64_t c = 0; c < kT; ++c) {
      const uint64_t base = job.col_offset + static_cast<uint64_t>(b.c0 + c) * static_cast<uint64_t>(job.M) +
                            static_cast<uint64_t>(b.r0);
      base_lo[c] = static_cast<uint32_t>(base);
      base_hi[c] = static_cast<uint32_t>(base >> 32);
    }
  }
  for (int64_t k = 0; k < kB; ++k) {
    uint32_t* __restrict word = k < 8 ? lo_word : hi_word;
    const uint32_t shift = static_cast<uint32_t>(4 * (k & 7));
    if (SR) {
      for (int64_t c = 0; c < kT; ++c) {
        const uint32_t lo = base_lo[c] + static_cast<uint32_t>(k);
        const uint32_t rb = random_byte(lo, base_hi[c] + static_cast<uint32_t>(lo < base_lo[c]), rkey);
        word[c] |= e2m1_stochastic(src[k][c] * enc[c], rb) << shift;
      }
    } else {
      for (int64_t c = 0; c < kT; ++c) word[c] |= e2m1_rne(src[k][c] * enc[c]) << shift;
    }
  }
  const int64_t bytes = (b.rows + 1) / 2;
  uint8_t* out = job.col_data + b.c0 * mp + b.r0 / 2;
  for (int64_t c = 0; c < b.w; ++c) {
    const uint64_t word = static_cast<uint64_t>(lo_word[c]) | (static_cast<uint64_t>(hi_word[c]) << 32);
    if (bytes == 8) {
      std::memcpy(out + c * mp, &word, 8);  // little endian: element 2i in the low nibble of byte i
    } else {
      for (int64_t p = 0; p < bytes; ++p) out[c * mp + p] = static_cast<uint8_t>(word >> (8 * p));
    }
  }
}

template <bool BF16, bool SR>
void quantize_tiles(const Nvfp4Job& job, int64_t u0, int64_t u1) {
  alignas(64) float t[kB][kT];
  alignas(64) float y[kB][kT];
  alignas(64) uint32_t tile_keys[kT / kB];
  const uint32_t rkey = seed_key(job.seed);
  for (int64_t u = u0; u < u1; ++u) {
    const TileBox b = tile_box(job, u);
    load_tile<BF16>(job, b, t);
    if (job.two_d) {
      for (int64_t j = 0; j < kT / kB; ++j) {
        uint32_t key = 0;
        for (int64_t i = 0; i < kB; ++i) {
          for (int64_t c = 0; c < kB; ++c) key = umax(key, bits_of(t[i][j * kB + c]) & 0x7FFFFFFFu);
        }
        tile_keys[j] = key;
      }
    }
    if (job.row_data) rowwise_tile<SR>(job, b, t, tile_keys, rkey);
    if (job.col_data) {
      if (job.rht) rht_tile(t, y);
      columnwise_tile<SR>(job, b, job.rht ? y : t, tile_keys, rkey);
    }
  }
}

}  // namespace

void nvfp4_amax_tiles(const Nvfp4Job& job, int64_t u0, int64_t u1, uint32_t* x_key, uint32_t* rht_key) {
  if (job.bf16) return amax_tiles<true>(job, u0, u1, x_key, rht_key);
  return amax_tiles<false>(job, u0, u1, x_key, rht_key);
}

void nvfp4_quantize_tiles(const Nvfp4Job& job, int64_t u0, int64_t u1) {
  if (job.bf16) return job.sr ? quantize_tiles<true, true>(job, u0, u1) : quantize_tiles<true, false>(job, u0, u1);
  return job.sr ? quantize_tiles<false, true>(job, u0, u1) : quantize_tiles<false, false>(job, u0, u1);
}

}  // namespace NVFP4_NAMESPACE
}  // namespace engine_native
