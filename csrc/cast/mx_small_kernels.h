// MXFP4 / MXFP6 kernels without torch: the per-element rules and the tile loop, included by
// kernels_mx_small.cpp (portable build) and kernels_mx_small_avx512.cpp (after its AVX-512 target
// pragma). Everything is in an anonymous namespace, so each file gets its own copy compiled for its
// own instruction set. Each includer defines MX_SMALL_NAMESPACE, the namespace of its entry point.
//
// Bit for bit the rules of engine/ops/mx_elements.py and reference.e8m0_rceil / e8m0_floor:
//   scale code  RCEIL: d = amax * fp32(1/max_elem), rounded up to a power of two (0..254; inf amax 254)
//               FLOOR: floor(log2 amax) - emax_elem, clamped to [-127, 127] (inf amax 255)
//               a NaN amax gives 255 under both
//   element     x * 2^(127 - code) in fp32 (NaN for code 255), rounded to nearest even onto the grid,
//               saturating at +-max, NaN -> code 0, the sign bit kept (-0 has a code)
//   storage     E2M1: two codes per byte along the last dim, element 0 in the low nibble (an odd last dim
//               ends in a byte whose high nibble is 0); E2M3 / E3M2: one code per byte
// The per-element rules are branch-free integer and fp32 operations (selects written as bit masks), in
// loops over short arrays that the compiler vectorises (SSE2 in the portable build). The AVX-512 build
// (kernels_mx_small_avx512.cpp) defines MX_SMALL_OWN_ENTRY and its own entry point: its intrinsics path for
// most tiles, `tile` below for the rare tiles that hold a NaN scale code.
#pragma once

#include <cstdint>
#include <cstring>

#include "cast/mx_small.h"

#ifndef MX_SMALL_NAMESPACE
#error "define MX_SMALL_NAMESPACE before including mx_small_kernels.h"
#endif

namespace engine_native {
namespace MX_SMALL_NAMESPACE {

namespace {

constexpr int64_t kBlock = kMxSmallBlock;
constexpr int64_t kTileCols = kMxSmallTileCols;

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

inline uint32_t mask_if(bool c) { return 0u - static_cast<uint32_t>(c); }
inline uint32_t select(uint32_t m, uint32_t a, uint32_t b) { return (a & m) | (b & ~m); }

// The facts of one element format, as compile-time constants.
template <int EB, int MB, int BIAS>
struct Format {
  static constexpr int kBits = 1 + EB + MB;
  static constexpr int kMant = MB;
  static constexpr int kBias = BIAS;
  static constexpr int kDrop = 23 - MB;  // fp32 mantissa bits the cast drops
  static constexpr int kEmax = (1 << EB) - 1 - BIAS;  // no inf/NaN: the top exponent holds normals
  static constexpr uint32_t kMinField = static_cast<uint32_t>(1 - BIAS + 127);  // fp32 exponent field of emin
  static constexpr uint32_t kMaxField = static_cast<uint32_t>(kEmax + 127);     // ... of the top binade
  static constexpr uint32_t kMaxBits = (static_cast<uint32_t>(kEmax + 127) << 23) | (((1u << MB) - 1u) << kDrop);
  static constexpr uint32_t kMinNormalBits = static_cast<uint32_t>(1 - BIAS + 127) << 23;
  static constexpr uint32_t kOffset = static_cast<uint32_t>(127 - BIAS) << MB;
  // 2^23 * (smallest subnormal): adding it rounds a magnitude below the smallest normal to whole subnormal steps
  static constexpr uint32_t kMagicBits = static_cast<uint32_t>(23 + 1 - BIAS - MB + 127) << 23;
};
using E2M1 = Format<2, 1, 1>;
using E2M3 = Format<2, 3, 1>;
using E3M2 = Format<3, 2, 3>;

// Saturating round-to-nearest-even fp32 -> element code (mx_elements.encode), branch-free. With c = min(|y|, max)
// and E' = max(exponent of c, the smallest normal exponent), M = 2^(E' + 23 - mbits) + j ulp(M) has the element's
// step at c as its ulp, and j = (E' - emin) << mbits counts the codes below binade E'. The fp32 sum c + M rounds c
// to that step, ties to even (j is even, so the tie parity is c's own), and its low mantissa bits are
// j + round(c / step): the code of |y|, subnormals included, with no fp32 subnormal arithmetic.
template <typename F>
inline uint8_t encode(float y) {
  const uint32_t b = bits_of(y);
  const uint32_t mag = b & 0x7FFFFFFFu;
  const uint32_t c = mag < F::kMaxBits ? mag : F::kMaxBits;  // +-inf saturate (NaN too, zeroed below)
  const uint32_t field = (c >> 23) > F::kMinField ? (c >> 23) : F::kMinField;
  const uint32_t magic = ((field + 23u - F::kMant) << 23) + ((field - F::kMinField) << F::kMant);
  const uint32_t code = (bits_of(float_of(c) + float_of(magic)) & 0x7FFFFFu) | ((b >> (32 - F::kBits)) & (1u << (F::kBits - 1)));
  return static_cast<uint8_t>(mag > 0x7F800000u ? 0u : code);
}

// E8M0 code of a block from its amax key (|x| bits; a NaN is above every number), branch-free (vectorisable).
template <typename F, bool RCEIL>
inline uint32_t scale_code(uint32_t key) {
  if (RCEIL) {
    const float rcp_max = static_cast<float>(1.0 / static_cast<double>(float_of(F::kMaxBits)));
    const uint32_t amax = select(mask_if(key > 0x7F800000u), 0x7FC00000u, key);
    const uint32_t d = bits_of(float_of(amax) * rcp_max) & 0x7FFFFFFFu;
    const uint32_t exponent = d >> 23, mantissa = d & 0x7FFFFFu;
    const uint32_t up = mask_if(mantissa != 0) & mask_if(exponent != 0xFEu) &
                        ~(mask_if(exponent == 0) & mask_if(mantissa <= 0x400000u));
    const uint32_t code = exponent + (up & 1u);
    return select(mask_if(d > 0x7F800000u), 0xFFu, select(mask_if(d == 0x7F800000u), 0xFEu, code));
  }
  const int32_t biased = static_cast<int32_t>(key >> 23);  // 0xFF for inf and NaN
  int32_t shared = biased - 127 - F::kEmax;
  shared = shared < -127 ? -127 : shared;
  shared = shared > 127 ? 127 : shared;
  return select(mask_if(biased == 0xFF), 0xFFu, static_cast<uint32_t>(shared + 127));
}

// The multiplier of a block's elements: 2^(127 - code) (254: the subnormal 2^-127), NaN for 255; branch-free.
inline float element_scale(uint32_t code) {
  const uint32_t normal = (254u - (code < 254u ? code : 254u)) << 23;
  return float_of(select(mask_if(code == 0xFFu), 0x7FC00000u, select(mask_if(code == 254u), 0x00400000u, normal)));
}

inline uint32_t abs_key(float v) { return bits_of(v) & 0x7FFFFFFFu; }
inline uint32_t umax(uint32_t a, uint32_t b) { return a > b ? a : b; }

// Codes q[0, w) of one data row -> its bytes at column c0 (packed for E2M1; q[w] must be writable).
template <typename F>
inline void store_row(uint8_t* __restrict q, int64_t w, uint8_t* __restrict out) {
  if (F::kBits == 4) {
    q[w] = 0;  // an odd last column's partner
    const int64_t pairs = (w + 1) / 2;
    for (int64_t p = 0; p < pairs; ++p) out[p] = static_cast<uint8_t>(q[2 * p] | (q[2 * p + 1] << 4));
  } else {
    for (int64_t c = 0; c < w; ++c) out[c] = q[c];
  }
}

template <bool BF16>
inline float load(const void* x, int64_t i) {
  if (BF16) return float_of(static_cast<uint32_t>(static_cast<const uint16_t*>(x)[i]) << 16);
  return static_cast<const float*>(x)[i];
}

// One tile: rows [r0, r1) (one columnwise block), columns [c0, c1) (c0 a multiple of kTileCols). x is read
// twice: for the columnwise amaxes (from memory), then row by row (from cache) for both usages' codes.
template <typename F, bool BF16, bool RCEIL>
void tile(const MxSmallJob& job, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  constexpr bool kPacked = F::kBits == 4;
  constexpr int64_t kTileBlocks = kTileCols / kBlock;
  const int64_t K = job.K, kp = kPacked ? (K + 1) / 2 : K, nb = (K + kBlock - 1) / kBlock, w = c1 - c0;
  const int64_t data_col = kPacked ? c0 / 2 : c0, blocks = (w + kBlock - 1) / kBlock;
  alignas(64) uint8_t q[kTileCols + 64];
  alignas(64) float row[kTileCols];
  alignas(64) uint32_t col_keys[kTileCols];
  alignas(64) float col_scale[kTileCols];
  auto load_row = [&](int64_t r) {  // x[r, c0:c1] as fp32, zero-padded to the tile (zeros change no amax)
    const int64_t base = r * job.ld + c0;
    for (int64_t c = 0; c < w; ++c) row[c] = load<BF16>(job.x, base + c);
    for (int64_t c = w; c < kTileCols; ++c) row[c] = 0.0f;
  };
  if (job.col_data) {
    for (int64_t c = 0; c < kTileCols; ++c) col_keys[c] = 0;
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t base = r * job.ld + c0;
      for (int64_t c = 0; c < w; ++c) col_keys[c] = umax(col_keys[c], abs_key(load<BF16>(job.x, base + c)));
    }
    for (int64_t c = 0; c < kTileCols; ++c) {
      col_keys[c] = scale_code<F, RCEIL>(col_keys[c]);
      col_scale[c] = element_scale(col_keys[c]);
    }
    uint8_t* codes = job.col_codes + (r0 / kBlock) * K + c0;
    for (int64_t c = 0; c < w; ++c) codes[c] = static_cast<uint8_t>(col_keys[c]);
  }
  for (int64_t r = r0; r < r1; ++r) {
    load_row(r);
    if (job.row_data) {
      alignas(64) uint32_t keys[kTileBlocks];
      alignas(64) float scale[kTileBlocks];
      for (int64_t b = 0; b < kTileBlocks; ++b) {
        uint32_t key = 0;
        for (int64_t c = 0; c < kBlock; ++c) key = umax(key, abs_key(row[b * kBlock + c]));
        keys[b] = key;
      }
      for (int64_t b = 0; b < kTileBlocks; ++b) {
        keys[b] = scale_code<F, RCEIL>(keys[b]);
        scale[b] = element_scale(keys[b]);
      }
      uint8_t* codes = job.row_codes + r * nb + c0 / kBlock;
      for (int64_t b = 0; b < blocks; ++b) codes[b] = static_cast<uint8_t>(keys[b]);
      uint8_t* __restrict dst = job.row_data + r * kp + data_col;
      if (kPacked || w < kTileCols) {
        for (int64_t b = 0; b < kTileBlocks; ++b) {
          const float s = scale[b];
          for (int64_t c = 0; c < kBlock; ++c) q[b * kBlock + c] = encode<F>(row[b * kBlock + c] * s);
        }
        store_row<F>(q, w, dst);
      } else {  // FP6, a whole tile: straight into the output
        for (int64_t b = 0; b < kTileBlocks; ++b) {
          const float s = scale[b];
          for (int64_t c = 0; c < kBlock; ++c) dst[b * kBlock + c] = encode<F>(row[b * kBlock + c] * s);
        }
      }
    }
    if (job.col_data) {
      uint8_t* __restrict dst = job.col_data + r * kp + data_col;
      if (kPacked || w < kTileCols) {
        for (int64_t c = 0; c < kTileCols; ++c) q[c] = encode<F>(row[c] * col_scale[c]);
        store_row<F>(q, w, dst);
      } else {
        for (int64_t c = 0; c < kTileCols; ++c) dst[c] = encode<F>(row[c] * col_scale[c]);
      }
    }
  }
}

// Tile u of the job's grid of ceil(M/32) x ceil(K/256) tiles: rows [r0, r1), columns [c0, c1).
struct TileBounds {
  int64_t r0, r1, c0, c1;
};

inline TileBounds tile_bounds(const MxSmallJob& job, int64_t u) {
  const int64_t col_tiles = (job.K + kTileCols - 1) / kTileCols;
  const int64_t r0 = (u / col_tiles) * kBlock, c0 = (u % col_tiles) * kTileCols;
  return {r0, r0 + kBlock < job.M ? r0 + kBlock : job.M, c0, c0 + kTileCols < job.K ? c0 + kTileCols : job.K};
}

#ifndef MX_SMALL_OWN_ENTRY
template <typename F, bool BF16, bool RCEIL>
void tiles(const MxSmallJob& job, int64_t u0, int64_t u1) {
  for (int64_t u = u0; u < u1; ++u) {
    const TileBounds t = tile_bounds(job, u);
    tile<F, BF16, RCEIL>(job, t.r0, t.r1, t.c0, t.c1);
  }
}

template <typename F>
void tiles_for(const MxSmallJob& job, int64_t u0, int64_t u1) {
  if (job.bf16) {
    return job.rceil ? tiles<F, true, true>(job, u0, u1) : tiles<F, true, false>(job, u0, u1);
  }
  return job.rceil ? tiles<F, false, true>(job, u0, u1) : tiles<F, false, false>(job, u0, u1);
}
#endif

}  // namespace

#ifndef MX_SMALL_OWN_ENTRY
void mx_small_tiles(const MxSmallJob& job, int64_t u0, int64_t u1) {
  switch (job.kind) {
    case 0: return tiles_for<E2M1>(job, u0, u1);
    case 1: return tiles_for<E2M3>(job, u0, u1);
    default: return tiles_for<E3M2>(job, u0, u1);
  }
}
#endif

}  // namespace MX_SMALL_NAMESPACE
}  // namespace engine_native
