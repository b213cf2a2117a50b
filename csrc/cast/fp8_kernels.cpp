// The FP8 cast kernels of cast/fp8.h, one source for every instruction-set level (compiled once per level
// by a generated wrapper, see common/isa_begin.h). The per-element rules are fp8_vec.h's branch-free forms
// of fp8_scalar.h's: the casts run them on groups of 4 native-width vectors (fp8_vec.h's *_g loops; the
// amax passes are plain loops the compiler vectorises), plus the blocking of the work: strips of 64 rows
// cast as whole row runs into a buffer whose 64x64 byte tiles are transposed out (transpose/byte_transpose.h)
// for the transposing casts, amax passes whose second (cast) pass re-reads the data from L1/L2, prefetches
// of the next unit while the current one is cast, and large outputs streamed past the caches.
// Measured at avx2 (Zen 4 capped, 1 thread, 512 KiB of bf16 in cache, ms per 4096^2, before -> after the magnitude
// form of fp8_vec.h's cast_group, the padded strip buffer and no division per block scale): flat cast 3.77 -> 3.06,
// cast+transpose 5.7-7.3 -> 4.5-4.7, block 1x128 rowwise 4.48 -> 3.83, columnwise 6.26 -> 4.93, 128x128 4.71 -> 4.14,
// MXFP8 rowwise 5.6-7.2 -> 4.56, columnwise 5.39 -> 4.80.
//
// Every scale, any value (0, negative, inf, NaN, subnormal), goes through the same rule: the code of the
// fp32 product x * s (reference.cast_to_fp8), so no scale needs a separate path.
#include "cast/fp8.h"
#include "cast/fp8_vec.h"
#include "transpose/byte_transpose.h"

namespace engine_native {
namespace ENGINE_ISA_NS {
namespace {

using namespace fp8v;

constexpr int64_t kMx = 32;

inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

template <typename T>
T tmax(T a, T b) {
  return a > b ? a : b;
}

// Dispatch of a kernel template over the input type and FP8 format (one instantiation each).
#define FP8_DISPATCH(type, kind, call)                                                  \
  switch (type) {                                                                       \
    case InType::F32:                                                                   \
      if (kind == Fp8Kind::E4M3) { constexpr InType T = InType::F32; constexpr Fp8Kind K = Fp8Kind::E4M3; call; } \
      else { constexpr InType T = InType::F32; constexpr Fp8Kind K = Fp8Kind::E5M2; call; }                    \
      break;                                                                            \
    case InType::BF16:                                                                  \
      if (kind == Fp8Kind::E4M3) { constexpr InType T = InType::BF16; constexpr Fp8Kind K = Fp8Kind::E4M3; call; } \
      else { constexpr InType T = InType::BF16; constexpr Fp8Kind K = Fp8Kind::E5M2; call; }                   \
      break;                                                                            \
    default:                                                                            \
      if (kind == Fp8Kind::E4M3) { constexpr InType T = InType::F16; constexpr Fp8Kind K = Fp8Kind::E4M3; call; } \
      else { constexpr InType T = InType::F16; constexpr Fp8Kind K = Fp8Kind::E5M2; call; }                    \
      break;                                                                            \
  }

// --------------------------------------------------------------------------------- amax
template <InType T>
uint32_t amax_key_t(const void* x, int64_t begin, int64_t end) {
  return f32_key<T>(max_key<T>(at<T>(x, begin), end - begin));
}

uint32_t amax_key(const void* x, InType type, int64_t begin, int64_t end) {
  switch (type) {
    case InType::F32: return amax_key_t<InType::F32>(x, begin, end);
    case InType::BF16: return amax_key_t<InType::BF16>(x, begin, end);
    default: return amax_key_t<InType::F16>(x, begin, end);
  }
}

// --------------------------------------------------------------------------- flat cast
template <InType T, Fp8Kind K>
uint32_t cast_t(const void* x, int64_t begin, int64_t end, float scale, uint8_t* out) {
  return f32_key<T>(cast_keyed_g<T, K>(at<T>(x, begin), end - begin, scale, out + begin));
}

uint32_t cast(const void* x, InType type, int64_t begin, int64_t end, float scale, Fp8Kind kind, uint8_t* out) {
  uint32_t key = 0;
  FP8_DISPATCH(type, kind, (key = cast_t<T, K>(x, begin, end, scale, out)));
  return key;
}

// ---------------------------------------------------------------------- cast transpose
// Outputs of at least this many bytes are written around the caches (vec::store_stream), in whole lines: they
// will not stay cached anyway, and stream stores skip reading each line first.
constexpr int64_t kStreamBytes = int64_t{1} << 22;

// Whether whole 64-byte rows at p + i * ld can be streamed (16-byte aligned).
inline bool streamable(const uint8_t* p, int64_t ld) {
  return p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 == 0 && ld % 16 == 0;
}

// A strip of at most 64 rows x kStrip columns at element `base` (row stride ld): each row cast with one scale
// as one run (sequential reads, which the hardware prefetchers follow) into `out` (row stride ld_out) when only
// that is asked for, else into a buffer whose 64x64 tiles are then transposed into `out_t` (row stride ld_t) and
// whose rows are copied to `out`; outputs streamed where `stream`. The same rows `next` elements further are
// prefetched meanwhile. Returns max(key, the strip's max key). (64x64 regions cast one by one, with prefetches
// of the next region, measured 2x slower at avx2: the prefetches of 64 short row pieces stall.)
constexpr int64_t kStrip = 1024;
// The buffer's row stride: a row and 64 bytes, so that the 64 rows of a tile column fall in different L1 sets (a
// stride of 1024 bytes puts them all in 4 of the 64 sets, and the transpose then reads them from L2).
constexpr int64_t kBufLd = kStrip + 64;

template <InType T, Fp8Kind K>
raw_t<T> cast_strip(const void* x, int64_t base, int64_t ld, int64_t rows, int64_t cols, float scale, uint8_t* out,
                    int64_t ld_out, uint8_t* out_t, int64_t ld_t, int64_t next, bool stream, raw_t<T> key) {
  alignas(64) uint8_t buf[64 * kBufLd];
  for (int64_t r = 0; r < rows; ++r) {
    const raw_t<T>* row = at<T>(x, base + r * ld);
    key = cast_keyed_g<T, K>(row, cols, scale, out_t ? buf + kBufLd * r : out + r * ld_out, key, row + next);
  }
  if (!out_t) return key;
  for (int64_t c = 0; c < cols; c += 64) {
    transpose::transpose64_store(buf + c, kBufLd, rows, imin(64, cols - c), out_t + c * ld_t, ld_t, stream);
  }
  for (int64_t r = 0; r < rows && out; ++r) {
    uint8_t* d = out + r * ld_out;
    const uint8_t* b = buf + kBufLd * r;
    if (stream) {
      int64_t c = 0;
      for (; c + 16 <= cols; c += 16) vec::store_stream(d + c, vec::load<vec::u8x16>(b + c));
      std::memcpy(d + c, b + c, static_cast<size_t>(cols - c));
    } else {
      std::memcpy(d, b, static_cast<size_t>(cols));
    }
  }
  return key;
}

template <InType T, Fp8Kind K>
uint32_t cast_transpose_t(Src x, int64_t M, int64_t Kc, int64_t r0, int64_t r1, int64_t c0, int64_t c1, float scale,
                          uint8_t* out, uint8_t* out_t) {
  // streamed when every output asked for is large and allows it
  const bool stream = M * Kc >= kStreamBytes && out_t != nullptr && streamable(out_t, M) &&
                      (out == nullptr || streamable(out, Kc));
  raw_t<T> key = 0;
  for (int64_t r = r0; r < r1; r += 64) {
    for (int64_t c = c0; c < c1; c += kStrip) {
      const int64_t rows = imin(64, r1 - r), cols = imin(kStrip, c1 - c);
      // prefetch the next strip to the right (or the next row block)
      const int64_t next = c + kStrip < c1 ? kStrip : 64 * x.ld + c0 - c;
      key = cast_strip<T, K>(x.data, r * x.ld + c, x.ld, rows, cols, scale, out ? out + r * Kc + c : nullptr, Kc,
                             out_t ? out_t + c * M + r : nullptr, M, next, stream, key);
    }
  }
  if (stream) vec::stream_fence();
  return f32_key<T>(key);
}

uint32_t cast_transpose_region(Src x, int64_t M, int64_t K, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                               float scale, Fp8Kind kind, uint8_t* out, uint8_t* out_t) {
  uint32_t key = 0;
  const int64_t Kc = K;
  FP8_DISPATCH(x.type, kind, (key = cast_transpose_t<T, K>(x, M, Kc, r0, r1, c0, c1, scale, out, out_t)));
  return key;
}

// -------------------------------------------------------------------- block scaling
float tile_scale(uint32_t key, const ScaleRule& rule) { return compute_scale(key_to_amax(key), rule); }

// compute_scale(key_to_amax(key), rule) and its inverse for n amax keys, branch-free so that the loop vectorises
// (one scalar compute_scale per 128 elements; at avx2, 1 thread, x in L2, ms per 4096^2: 1x128 rowwise 3.80 -> 3.69,
// columnwise 5.06 -> 4.53).
template <InType T>
FP8_LANE void tile_scales(const raw_t<T>* __restrict key, int64_t n, const ScaleRule& rule, float* __restrict scale,
                          float* __restrict inv) {
  const float fp8_max = rule.fp8_max, eps = rule.epsilon;
  const uint32_t eps_bits = bits_of(eps), vfi = bits_of(rule.value_for_inf);
  const uint32_t keep = rule.pow2 ? 0xFF800000u : 0xFFFFFFFFu;  // a power of 2 keeps the sign and exponent
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t k = f32_key<T>(key[i]);
    const uint32_t amax = pick(k > 0x7F800000u, 0x7FC00000u, k);
    const uint32_t a = pick(float_of(amax) < eps, eps_bits, amax);
    uint32_t sb = bits_of(fp8_max / float_of(a));
    sb = pick((sb & 0x7FFFFFFFu) == 0x7F800000u, vfi, sb);
    const uint32_t a_mag = a & 0x7FFFFFFFu;
    sb = pick(a_mag == 0u || a_mag >= 0x7F800000u, 0x3F800000u, sb) & keep;  // 0, inf or NaN amax: 1
    scale[i] = float_of(sb);
    inv[i] = 1.0f / float_of(sb);
  }
}

// Element offset from the current work unit to the next one the same thread takes (see fp8_glue.cpp): the
// next unit along the row, or the first one of the next strip.
inline int64_t next_unit_offset(int64_t c0, int64_t c1, int64_t c_end, int64_t rows, int64_t ld) {
  return c1 < c_end ? c1 - c0 : rows * ld - c0;
}

// Up to 8 side-by-side tiles: rows [r0, r1), tile j = cols [c0 + j tile_cols, ...) cut at c_end. The amax
// pass walks whole row segments (sequential reads), one key per tile; the cast pass re-reads the strip
// from L1/L2 and prefetches the next group.
template <InType T, Fp8Kind K>
void block_tiles(Src x, int64_t r0, int64_t r1, int64_t c0, int64_t c_end, int64_t tile_cols, int n,
                 const ScaleRule& rule, uint8_t* out, int64_t ld_out, float* scale_inv) {
  raw_t<T> key[8] = {};
  for (int64_t r = r0; r < r1; ++r) {
    for (int j = 0; j < n; ++j) {
      const int64_t t0 = c0 + j * tile_cols, t1 = imin(c_end, t0 + tile_cols);
      key[j] = tmax(key[j], max_key<T>(at<T>(x.data, r * x.ld + t0), t1 - t0));
    }
  }
  float scale[8];
  for (int j = 0; j < n; ++j) {
    scale[j] = tile_scale(f32_key<T>(key[j]), rule);
    scale_inv[j] = 1.0f / scale[j];
  }
  const int64_t c1 = imin(c_end, c0 + n * tile_cols);
  const int64_t next = next_unit_offset(c0, c1, c_end, r1 - r0, x.ld);
  for (int64_t r = r0; r < r1; ++r) {
    for (int j = 0; j < n; ++j) {
      const int64_t t0 = c0 + j * tile_cols, t1 = imin(c_end, t0 + tile_cols);
      cast_run_g<T, K>(at<T>(x.data, r * x.ld + t0), t1 - t0, scale[j], out + r * ld_out + t0,
                       at<T>(x.data, r * x.ld + t0 + next));
    }
  }
}

// Up to 16 whole 1x128 tiles of one row from element i: their amaxes, then their casts from L1.
template <InType T, Fp8Kind K>
void block_1x128_group(const void* x, int64_t i, int ntiles, const ScaleRule& rule, uint8_t* out, float* scale_inv) {
  raw_t<T> key[16];
  for (int t = 0; t < ntiles; ++t) key[t] = max_key<T>(at<T>(x, i + 128 * t), 128);
  float scale[16];
  tile_scales<T>(key, ntiles, rule, scale, scale_inv);
  prefetch<T>(at<T>(x, i + 128 * ntiles), 128 * ntiles);  // the next group, in a contiguous input
  for (int t = 0; t < ntiles; ++t) cast_run_g<T, K>(at<T>(x, i + 128 * t), 128, scale[t], out + 128 * t);
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
    // side-by-side tiles of this tile row: up to 8, and a strip of at most 256 KiB (the strip and the next
    // one, prefetched during the cast pass, stay in L2)
    const int64_t strip_cols = (256 * 1024) / (p.tile_rows * static_cast<int64_t>(sizeof(raw_t<T>)));
    const int64_t group = imin(8, strip_cols >= p.tile_cols ? strip_cols / p.tile_cols : 1);
    const int n = static_cast<int>(imin(group, imin(tiles_k - tc, t1 - t)));
    block_tiles<T, K>(x, r0, imin(M, r0 + p.tile_rows), c0, Kc, p.tile_cols, n, p.rule, out, Kc, scale_inv + t);
    t += n;
  }
}

void block_rowwise(Src x, int64_t M, int64_t K, const BlockParams& p, int64_t t0, int64_t t1, uint8_t* out,
                   float* scale_inv) {
  const int64_t Kc = K;
  FP8_DISPATCH(x.type, p.kind, (block_rowwise_t<T, K>(x, M, Kc, p, t0, t1, out, scale_inv)));
}

// Transposed input: the quantized tensor is y = x^T. A panel is x rows [a0, a1) (one tile along y's
// columns) by x columns [b0, b1) (whole tiles along y's rows, at most kPanel; the glue runs the panels
// down the rows first): the per-column amax of x over the panel, the scales, then 64x64 regions cast with
// per-column scales and written transposed while the next panel is fetched into L2.
constexpr int64_t kPanel = 1024;

template <InType T, Fp8Kind K>
void block_transposed_t(Src x, int64_t A, int64_t B, const BlockParams& p, int64_t a0, int64_t a1, int64_t b0, int64_t b1,
                        uint8_t* out, float* scale_inv) {
  const int64_t tiles_a = (A + p.tile_cols - 1) / p.tile_cols;
  const int64_t a_tile = a0 / p.tile_cols;
  const int64_t width = b1 - b0;
  alignas(64) raw_t<T> col_key[kPanel] = {};
  alignas(64) float col_scale[kPanel];
  for (int64_t a = a0; a < a1; ++a) max_keys_into<T>(at<T>(x.data, a * x.ld + b0), width, col_key);
  float* tile_scale_inv = scale_inv + (b0 / p.tile_rows) * tiles_a + a_tile;  // b0 is a multiple of tile_rows
  if (p.tile_rows == 1) {  // a tile per column: the scales in one vectorised loop
    alignas(64) float inv[kPanel];
    tile_scales<T>(col_key, width, p.rule, col_scale, inv);
    for (int64_t c = 0; c < width; ++c) tile_scale_inv[c * tiles_a] = inv[c];
  }
  for (int64_t c = 0; p.tile_rows > 1 && c < width; c += p.tile_rows, tile_scale_inv += tiles_a) {  // (no division per tile)
    const int64_t n = imin(p.tile_rows, width - c);
    raw_t<T> key = 0;
    for (int64_t l = 0; l < n; ++l) key = tmax(key, col_key[c + l]);
    const float scale = tile_scale(f32_key<T>(key), p.rule);
    *tile_scale_inv = 1.0f / scale;
    for (int64_t l = 0; l < n; ++l) col_scale[c + l] = scale;
  }
  alignas(64) float arranged_buf[kPanel];  // the scales in group lane order
  const float* arranged = arrange_scales<T>(col_scale, width, arranged_buf) ? arranged_buf : nullptr;
  // the next panel (see fp8_glue.cpp): the next tile_cols rows, or the next column panel
  const int64_t next = a1 < A ? (a1 - a0) * x.ld : width - a0 * x.ld;
  // 64 rows at a time cast as whole runs into a buffer (sequential reads from L2), its 64x64 tiles transposed out
  alignas(64) uint8_t buf[64 * kBufLd];
  static_assert(kPanel <= kStrip, "a panel row fits a buffer row");
  const bool stream = A * B >= kStreamBytes && streamable(out, A) && a0 % 16 == 0;
  for (int64_t a = a0; a < a1; a += 64) {
    const int64_t rows = imin(64, a1 - a);
    for (int64_t r = 0; r < rows; ++r) {
      const raw_t<T>* row = at<T>(x.data, (a + r) * x.ld + b0);
      cast_scaled_g<T, K>(row, width, col_scale, arranged, buf + kBufLd * r, row + next);
    }
    for (int64_t c = 0; c < width; c += 64) {
      transpose::transpose64_store(buf + c, kBufLd, rows, imin(64, width - c), out + (b0 + c) * A + a, A, stream);
    }
  }
  if (stream) vec::stream_fence();
}

void block_transposed(Src x, int64_t A, int64_t B, const BlockParams& p, int64_t a0, int64_t a1, int64_t b0,
                      int64_t b1, uint8_t* out, float* scale_inv) {
  FP8_DISPATCH(x.type, p.kind, (block_transposed_t<T, K>(x, A, B, p, a0, a1, b0, b1, out, scale_inv)));
}

// ----------------------------------------------------------------------------- MXFP8
template <Fp8Kind K>
uint8_t mx_code(uint32_t key, bool rceil) {
  constexpr float kMax = K == Fp8Kind::E4M3 ? 448.0f : 57344.0f;
  constexpr int kEmax = K == Fp8Kind::E4M3 ? 8 : 15;
  const float amax = key_to_amax(key);
  return rceil ? e8m0_rceil(amax, static_cast<float>(1.0 / kMax)) : e8m0_floor(amax, kEmax);
}

// mx_code and e8m0_element_scale of an amax key (fp32 |x| bits, a NaN above every number), branch-free so that
// the loops over a group's keys vectorise (the scalar forms' branches kept them scalar: one code per 32 elements
// for each usage; mx_both at avx2, 1 thread, x in L2: 9.25 -> 8.31 ms per 4096^2).
template <Fp8Kind K, bool RCEIL>
FP8_LANE uint32_t mx_code_lane(uint32_t key) {
  const uint32_t amax = pick(key > 0x7F800000u, 0x7FC00000u, key);  // key_to_amax
  if constexpr (RCEIL) {  // e8m0_rceil(amax, 1 / max)
    constexpr float kRcp = static_cast<float>(1.0 / (K == Fp8Kind::E4M3 ? 448.0 : 57344.0));
    const uint32_t d = bits_of(float_of(amax) * kRcp) & 0x7FFFFFFFu;
    const uint32_t e = d >> 23, m = d & 0x7FFFFFu;
    const uint32_t up = static_cast<uint32_t>(m != 0u) & static_cast<uint32_t>(e != 0xFEu) &
                        ~(static_cast<uint32_t>(e == 0u) & static_cast<uint32_t>(m <= 0x400000u));
    return pick(d > 0x7F800000u, 0xFFu, pick(d == 0x7F800000u, 0xFEu, e + up));
  } else {  // e8m0_floor(amax, emax): amax has no sign bit
    constexpr int32_t kEmax = K == Fp8Kind::E4M3 ? 8 : 15;
    int32_t shared = static_cast<int32_t>(amax >> 23) - 127 - kEmax;
    shared = shared < -127 ? -127 : shared;
    shared = shared > 127 ? 127 : shared;
    return pick((amax & 0x7F800000u) == 0x7F800000u, 0xFFu, static_cast<uint32_t>(shared + 127));
  }
}

// e8m0_element_scale's bits: 2^(127 - code), the subnormal 2^-127 for 254, NaN for 255.
FP8_LANE uint32_t mx_scale_bits(uint32_t code) {
  return pick(code == 0xFFu, 0x7FC00000u, pick(code == 254u, 0x00400000u, (254u - code) << 23));
}

// The codes (into `codes`) and multipliers (into `scale`) of n amax keys.
template <InType T, Fp8Kind K, bool RCEIL>
void mx_codes_of(const raw_t<T>* __restrict key, int64_t n, uint8_t* __restrict codes, float* __restrict scale) {
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t code = mx_code_lane<K, RCEIL>(f32_key<T>(key[j]));
    codes[j] = static_cast<uint8_t>(code);
    scale[j] = float_of(mx_scale_bits(code));
  }
}

template <InType T, Fp8Kind K>
void mx_codes(const raw_t<T>* key, int64_t n, bool rceil, uint8_t* codes, float* scale) {
  if (rceil) {
    mx_codes_of<T, K, true>(key, n, codes, scale);
  } else {
    mx_codes_of<T, K, false>(key, n, codes, scale);
  }
}

// 1x32 blocks along rows, rows [r0, r1), in groups of up to 16 blocks (512 columns): the group's amaxes,
// then its codes and multipliers 2^(127 - code) (NaN for code 255: every element then casts to the
// canonical NaN 0x7F), then its casts from L1. Grouping keeps the scalar code work out of the vector loops
// (one block at a time measured 1.3-1.5x slower at avx2).
// The columns [c0, c1) of one row (c0 a multiple of 32; c1 a multiple of 32 or the row's end K).
template <InType T, Fp8Kind K>
void mx_row_segment(const raw_t<T>* row, int64_t c0, int64_t c1, bool rceil, uint8_t* out_row, uint8_t* code_row) {
  const int64_t whole = c1 / kMx;
  for (int64_t b0 = c0 / kMx; b0 < whole; b0 += 16) {
    const int n = static_cast<int>(imin(16, whole - b0));
    raw_t<T> key[16];
    for (int j = 0; j < n; ++j) key[j] = max_key<T>(row + (b0 + j) * kMx, kMx);
    float s[16];
    mx_codes<T, K>(key, n, rceil, code_row + b0, s);
    // whole groups with each lane vector's block scale, then the blocks left one by one
    const int64_t len = n * kMx;
    const raw_t<T>* xb = row + b0 * kMx;
    uint8_t* ob = out_row + b0 * kMx;
    keyv<T> unused[4] = {};
    int64_t g = 0;
    for (; g + kGroup <= len; g += kGroup) {
      vec::f32n sc[4];
      for (int j = 0; j < 4; ++j) sc[j] = vec::splat<vec::f32n>(s[(g + lane_first<T>(j)) / kMx]);
      cast_group<T, K>(xb + g, sc, 0, ob + g, unused);  // the multipliers are > 0 or NaN
    }
    for (; g < len; g += kMx) cast_run<T, K>(xb + g, kMx, s[g / kMx], ob + g);
  }
  if (whole * kMx < c1) {  // the last, partial block
    const int64_t b = whole * kMx, n = c1 - b;
    const uint8_t code = mx_code<K>(f32_key<T>(max_key<T>(row + b, n)), rceil);
    code_row[whole] = code;
    cast_run<T, K>(row + b, n, e8m0_element_scale(code), out_row + b);
  }
}

// 1x32 blocks along rows, rows [r0, r1), in groups of up to 16 blocks (512 columns): the group's amaxes,
// then its codes and multipliers 2^(127 - code) (NaN for code 255: every element then casts to the
// canonical NaN 0x7F), then its casts from L1. Grouping keeps the scalar code work out of the vector loops
// (one block at a time measured 1.3-1.5x slower at avx2).
template <InType T, Fp8Kind K>
void mx_rowwise_t(Src x, int64_t Kc, bool rceil, int64_t r0, int64_t r1, uint8_t* out, uint8_t* codes) {
  const int64_t nb = (Kc + kMx - 1) / kMx;
  for (int64_t r = r0; r < r1; ++r) {
    const raw_t<T>* row = at<T>(x.data, r * x.ld);
    prefetch<T>(row + x.ld, Kc);  // the next row
    mx_row_segment<T, K>(row, 0, Kc, rceil, out + r * Kc, codes + r * nb);
  }
}

void mx_rowwise(Src x, int64_t M, int64_t K, Fp8Kind kind, bool rceil, int64_t r0, int64_t r1, uint8_t* out,
                uint8_t* codes) {
  (void)M;
  const int64_t Kc = K;
  FP8_DISPATCH(x.type, kind, (mx_rowwise_t<T, K>(x, Kc, rceil, r0, r1, out, codes)));
}

// 32x1 blocks along columns, block-rows [br0, br1) x columns [c0, c1) (at most kMxColumns): the column
// amaxes over the block's rows (row by row: sequential reads), the codes, then the rows cast with
// per-column multipliers (data stays row-major) while the next unit is fetched into L2.
constexpr int64_t kMxColumns = 512;

template <InType T, Fp8Kind K>
void mx_colwise_t(Src x, int64_t M, int64_t Kc, bool rceil, int64_t br0, int64_t br1, int64_t c0, int64_t c1,
                  uint8_t* out, uint8_t* codes) {
  const int64_t width = c1 - c0;
  alignas(64) float col_scale[kMxColumns];
  for (int64_t br = br0; br < br1; ++br) {
    const int64_t r0 = br * kMx, r1 = imin(M, r0 + kMx);
    alignas(64) raw_t<T> col_key[kMxColumns] = {};
    for (int64_t r = r0; r < r1; ++r) max_keys_into<T>(at<T>(x.data, r * x.ld + c0), width, col_key);
    mx_codes<T, K>(col_key, width, rceil, codes + br * Kc + c0, col_scale);
    alignas(64) float arranged_buf[kMxColumns];
    const float* arranged = arrange_scales<T>(col_scale, width, arranged_buf) ? arranged_buf : nullptr;
    const int64_t next = next_unit_offset(c0, c1, Kc, kMx, x.ld);
    for (int64_t r = r0; r < r1; ++r) {
      const raw_t<T>* row = at<T>(x.data, r * x.ld + c0);
      cast_scaled_g<T, K>(row, width, col_scale, arranged, out + r * Kc + c0, row + next);
    }
  }
}

void mx_colwise(Src x, int64_t M, int64_t K, Fp8Kind kind, bool rceil, int64_t br0, int64_t br1, int64_t c0,
                int64_t c1, uint8_t* out, uint8_t* codes) {
  const int64_t Kc = K;
  FP8_DISPATCH(x.type, kind, (mx_colwise_t<T, K>(x, M, Kc, rceil, br0, br1, c0, c1, out, codes)));
}

// Both usages of a unit, x read from memory once instead of twice: its block-rows' column amaxes and codes (which
// read them into L1/L2 and prefetch the next unit), then each row's block amaxes and codes and both usages' casts
// in one walk over the row: each group of elements is loaded and split into magnitudes and signs once for the two
// (at avx2, 1 thread, x in L2, 4096^2 E4M3 RCEIL: 9.25 ms with the casts apart, 7.35 with vectorised codes and the
// shared walk).
template <InType T, Fp8Kind K>
void mx_both_t(Src x, int64_t M, int64_t Kc, bool rceil, int64_t br0, int64_t br1, int64_t c0, int64_t c1,
               uint8_t* out_row, uint8_t* codes_row, uint8_t* out_col, uint8_t* codes_col) {
  const int64_t nb = (Kc + kMx - 1) / kMx;
  const int64_t width = c1 - c0, whole = width / kMx;  // c0 is a multiple of 32; whole blocks of the segment
  alignas(64) float col_scale[kMxColumns];
  alignas(64) float arranged_buf[kMxColumns];
  for (int64_t br = br0; br < br1; ++br) {
    const int64_t r0 = br * kMx, r1 = imin(M, r0 + kMx);
    alignas(64) raw_t<T> col_key[kMxColumns] = {};
    for (int64_t r = r0; r < r1; ++r) max_keys_into<T>(at<T>(x.data, r * x.ld + c0), width, col_key);
    mx_codes<T, K>(col_key, width, rceil, codes_col + br * Kc + c0, col_scale);
    const float* arranged = arrange_scales<T>(col_scale, width, arranged_buf) ? arranged_buf : nullptr;
    const int64_t next = next_unit_offset(c0, c1, Kc, kMx, x.ld);
    for (int64_t r = r0; r < r1; ++r) {
      const raw_t<T>* row = at<T>(x.data, r * x.ld + c0);
      uint8_t* orow = out_row + r * Kc + c0;
      uint8_t* ocol = out_col + r * Kc + c0;
      uint8_t* crow = codes_row + r * nb + c0 / kMx;
      raw_t<T> key[kMxColumns / kMx];
      for (int64_t b = 0; b < whole; ++b) key[b] = max_key<T>(row + b * kMx, kMx);
      float s[kMxColumns / kMx];
      mx_codes<T, K>(key, whole, rceil, crow, s);
      // whole groups: both casts from one load (the multipliers are > 0 or NaN), the next unit prefetched
      int64_t g = 0;
      for (; arranged && g + kGroup <= whole * kMx; g += kGroup) {
        prefetch_group<T>(row + next + g);
        vec::f32n v[4];
        vec::u32n sg[4];
        vec::u8n signs;
        keyv<T> unused[4] = {};
        load_group<T>(row + g, 0, v, sg, signs, unused);
        vec::u32n qr[4], qc[4];
        for (int j = 0; j < 4; ++j) {
          qr[j] = magnitude_codes<K>(v[j] * vec::splat<vec::f32n>(s[(g + lane_first<T>(j)) / kMx])) | sg[j];
          qc[j] = magnitude_codes<K>(v[j] * vec::load<vec::f32n>(arranged + g + j * kL)) | sg[j];
        }
        const vec::u8n br_ = pack_group<T>(qr) | signs, bc = pack_group<T>(qc) | signs;
        vec::store(orow + g, br_ ^ (vec::bits<vec::u8n>(br_ == 0xFF) & 0x80));
        vec::store(ocol + g, bc ^ (vec::bits<vec::u8n>(bc == 0xFF) & 0x80));
      }
      // the rest: whole blocks one by one, then the last, partial block (c1 = K)
      prefetch_tail<T>(row + next, g, width);
      for (int64_t b = g / kMx; b < whole; ++b) cast_run<T, K>(row + b * kMx, kMx, s[b], orow + b * kMx);
      if (whole * kMx < width) {
        const int64_t b = whole * kMx;
        const uint8_t code = mx_code<K>(f32_key<T>(max_key<T>(row + b, width - b)), rceil);
        crow[whole] = code;
        cast_run<T, K>(row + b, width - b, e8m0_element_scale(code), orow + b);
      }
      if (g < width) cast_scaled<T, K>(row + g, width - g, col_scale + g, ocol + g);
    }
  }
}

void mx_both(Src x, int64_t M, int64_t K, Fp8Kind kind, bool rceil, int64_t br0, int64_t br1, int64_t c0, int64_t c1,
             uint8_t* out_row, uint8_t* codes_row, uint8_t* out_col, uint8_t* codes_col) {
  const int64_t Kc = K;
  FP8_DISPATCH(x.type, kind,
               (mx_both_t<T, K>(x, M, Kc, rceil, br0, br1, c0, c1, out_row, codes_row, out_col, codes_col)));
}

// ---------------------------------------------------------------------------- fp8 -> bf16
template <Fp8Kind K>
void fp8_to_bf16_t(const uint8_t* __restrict codes, int64_t n, uint16_t* __restrict out) {
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_word<K>(codes[i]);
}

void fp8_to_bf16(const uint8_t* codes, Fp8Kind kind, int64_t begin, int64_t end, uint16_t* out) {
  if (kind == Fp8Kind::E4M3) return fp8_to_bf16_t<Fp8Kind::E4M3>(codes + begin, end - begin, out + begin);
  fp8_to_bf16_t<Fp8Kind::E5M2>(codes + begin, end - begin, out + begin);
}

// scale_bf16_loop / scale_bf16_runs_loop of fp8_scalar.h: branch-free loops, vectorised here for the level.
void scale_bf16(uint16_t* x, const float* s, int64_t n, int64_t run) {
  if (run == 1) {
    scale_bf16_loop(x, s, n);
  } else {
    scale_bf16_runs_loop(x, s, n, run);
  }
}

// Decode and scale in one pass: each run of `run` codes with its scale.
template <Fp8Kind K>
void fp8_to_bf16_scaled_t(const uint8_t* __restrict codes, int64_t n, uint16_t* __restrict out,
                          const float* __restrict s, int64_t run) {
  if (run == 1) {
    for (int64_t i = 0; i < n; ++i) out[i] = scaled_bf16(bf16_word<K>(codes[i]), s[i]);
    return;
  }
  for (int64_t i = 0, t = 0; i < n; i += run, ++t) {
    const float st = s[t];
    const int64_t len = imin(run, n - i);
    for (int64_t j = 0; j < len; ++j) out[i + j] = scaled_bf16(bf16_word<K>(codes[i + j]), st);
  }
}

void fp8_to_bf16_scaled(const uint8_t* codes, Fp8Kind kind, int64_t n, uint16_t* out, const float* s, int64_t run) {
  if (kind == Fp8Kind::E4M3) return fp8_to_bf16_scaled_t<Fp8Kind::E4M3>(codes, n, out, s, run);
  fp8_to_bf16_scaled_t<Fp8Kind::E5M2>(codes, n, out, s, run);
}

// The decoded word plus adds[i] where the code is finite and nonzero (magnitudes 1 .. first special - 1).
template <Fp8Kind K>
void fp8_to_bf16_shifted_t(const uint8_t* __restrict codes, int64_t n, uint16_t* __restrict out,
                           const int16_t* __restrict adds) {
  constexpr uint32_t kSpecial = K == Fp8Kind::E4M3 ? 0x7F : 0x7C;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t w = bf16_word<K>(codes[i]);
    const uint32_t live_minus_1 = static_cast<uint32_t>(codes[i] & 0x7Fu) - 1u;  // wraps for 0
    const uint32_t add = static_cast<uint16_t>(adds[i]);
    out[i] = static_cast<uint16_t>(w + pick(live_minus_1 < kSpecial - 1u, add, 0u));
  }
}

void fp8_to_bf16_shifted(const uint8_t* codes, Fp8Kind kind, int64_t n, uint16_t* out, const int16_t* adds) {
  if (kind == Fp8Kind::E4M3) return fp8_to_bf16_shifted_t<Fp8Kind::E4M3>(codes, n, out, adds);
  fp8_to_bf16_shifted_t<Fp8Kind::E5M2>(codes, n, out, adds);
}

// ------------------------------------------------------------------------ byte transpose
// 64 x 64 tiles: each copied (zero past the edges) into an aligned buffer, then transposed.
void transpose_bytes(const uint8_t* src, int64_t rows, int64_t cols, int64_t r0, int64_t r1, uint8_t* dst) {
  alignas(64) uint8_t tile[64 * 64];
  for (int64_t r = r0; r < r1; r += 64) {
    const int64_t nr = imin(64, r1 - r);
    for (int64_t c = 0; c < cols; c += 64) {
      const int64_t nc = imin(64, cols - c);
      for (int64_t i = 0; i < 64; ++i) {
        if (i < nr && nc == 64) {
          std::memcpy(tile + 64 * i, src + (r + i) * cols + c, 64);
        } else {
          std::memset(tile + 64 * i, 0, 64);
          if (i < nr) std::memcpy(tile + 64 * i, src + (r + i) * cols + c, static_cast<size_t>(nc));
        }
      }
      transpose::transpose64_store(tile, 64, nr, nc, dst + c * rows + r, rows, false);  // the GEMM reads it next
    }
  }
}

#define FP8_STR2(x) #x
#define FP8_STR(x) FP8_STR2(x)

}  // namespace

const Kernels& fp8_kernels() {
  static const Kernels k = {FP8_STR(ENGINE_ISA_NS), amax_key,   cast,       cast_transpose_region,
                            block_rowwise,          block_transposed, mx_rowwise, mx_colwise,
                            fp8_to_bf16,            scale_bf16, fp8_to_bf16_scaled, fp8_to_bf16_shifted,
                            transpose_bytes,        mx_both};
  return k;
}

}  // namespace ENGINE_ISA_NS
}  // namespace engine_native
