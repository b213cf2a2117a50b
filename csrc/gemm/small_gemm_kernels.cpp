// The small exact GEMM of small_gemm.h, one source compiled per instruction set (common/isa_begin.h), written with
// the compiler's vector extensions at the level's native width W (16 fp32 lanes: one zmm at avx512; 8: one ymm at
// avx2; 4: one xmm at baseline and on NEON). gcc 12 splits common/vec.h's 64-byte vectors at avx2 through the
// stack (the first version of this kernel on them: 30x slower than addmm at avx2), so this file declares its own.
//
// Outer-product form: a tile keeps fp32 accumulators of 16 outputs of one output row (or column) each; per k it
// loads the packed v vectors and multiply-adds each broadcast s element into them (a lane-wise fused fma:
// vfmadd231ps; no vdpbf16ps, which flushes bf16 subnormals). Each output lane is one sequential fma chain over
// k = 0..K-1 from +0 whatever the tile or the level, so the numerics of small_gemm.h hold for every blocking. Two
// orientations (the glue picks the cheaper packing):
//   * s = A, v = B: tiles of kRowTile rows of out x kPanelTile panels of 16 columns, stored row by row;
//   * s = B, v = A: tiles of kColTile columns of out x 16 rows, stored through a small transposing buffer.
// The tile sizes fit each level's 32 zmm / 16 ymm / 16 xmm registers. The x86 baseline (SSE2) has no fma
// instruction: its fma is libm's (exact, slow), and the glue never picks the kernel there.
#include "gemm/small_gemm.h"
#include "common/vec.h"

#if defined(ENGINE_X86_64) && ENGINE_ISA_LEVEL >= 1
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace engine_native {
namespace ENGINE_ISA_NS {
namespace {

#define SG_INLINE inline __attribute__((always_inline))

constexpr int kLanes = 16;  // outputs per panel row (the packed layout of small_gemm.h)
#if defined(ENGINE_X86_64) && ENGINE_ISA_LEVEL >= 2
constexpr int kW = 16, kRowTile = 8, kPanelTile = 2, kColTile = 16;
#elif defined(ENGINE_X86_64) && ENGINE_ISA_LEVEL == 1
constexpr int kW = 8, kRowTile = 6, kPanelTile = 1, kColTile = 6;
#else
constexpr int kW = 4, kRowTile = 2, kPanelTile = 1, kColTile = 2;
#endif
constexpr int kVecs = kLanes / kW;  // native vectors per 16 outputs

static_assert(kW == vec::kNativeLanes, "the tiles are of the level's native vectors (common/vec.h)");
using F = vec::f32n;
using U = vec::u32n;
using I = vec::i32n;
typedef uint16_t H __attribute__((vector_size(2 * kW)));

using vec::load;
using vec::load_first;  // the first n lanes (n <= 0: none), the others 0
using vec::store_first;

// Every lane = x: a broadcast (x - 0 is x for every x, -0 included, so the compiler drops the subtraction; 0 + x
// would turn -0 into +0, and a lane-by-lane fill compiles to 16 masked inserts at avx512).
SG_INLINE F splat(float x) { return x - F{}; }

template <typename M, typename V>
SG_INLINE V select(M m, V a, V b) {
  return (V)(((U)a & (U)m) | ((U)b & ~(U)m));
}

// Lane-wise fma(a, b, c), rounded once (-ffp-contract=off keeps a * b + c unfused, so the levels name theirs).
SG_INLINE F fma(F a, F b, F c) {
#if defined(__clang__)
  return __builtin_elementwise_fma(a, b, c);
#elif defined(ENGINE_X86_64) && ENGINE_ISA_LEVEL >= 2
  return (F)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(ENGINE_X86_64) && ENGINE_ISA_LEVEL == 1
  return (F)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#elif defined(__aarch64__)
  return (F)vfmaq_f32((float32x4_t)c, (float32x4_t)a, (float32x4_t)b);
#else
  F r;
  for (int i = 0; i < kW; ++i) r[i] = __builtin_fmaf(a[i], b[i], c[i]);
  return r;
#endif
}

// n (<= W) bf16 words -> fp32 lanes (exact: bf16 is fp32's top half); missing lanes +0.
SG_INLINE F widen_w(const uint16_t* p, int64_t n) {
  return (F)(__builtin_convertvector(load_first<H>(p, n), U) << 16);
}

// fp32 -> bf16 bits, round to nearest even; NaN -> 0x7FC0 (torch's); subnormals kept.
SG_INLINE U to_bf16_bits(F y) {
  const U u = (U)y;
  const U r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return select(y != y, U{} + 0x7FC0u, r);
}

// fp32 -> fp16 bits, round to nearest even (IEEE's conversion): overflow to inf, subnormals rounded, NaN -> 0x7E00,
// the sign kept throughout.
SG_INLINE U to_f16_bits(F y) {
  const U u = (U)y;
  const U sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
  // normal: rebias the exponent (127 -> 15) and round away the low 13 bits (a carry may reach the exponent)
  const U t = a - 0x38000000u;
  const U normal = (t + 0xFFFu + ((t >> 13) & 1u)) >> 13;
  // below 2^-14: the multiple of 2^-24 nearest |y|, by an fp32 add to 0.5 (whose ulp is 2^-24), 0x400 at most
  const U sub = (U)((F)a + 0.5f) - 0x3F000000u;
  U h = select(a < 0x38800000u, sub, normal);
  h = select(a >= 0x477FF000u, U{} + 0x7C00u, h);  // 65520 and above round to inf
  h = select(a > 0x7F800000u, U{} + 0x7E00u, h);
  return h | sign;
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

// y = fp32(alpha * acc) (+ bias), the formula of small_gemm.h before the output's rounding.
SG_INLINE F finish(const SmallGemmJob& j, F acc, F bias) {
  const F y = acc * j.alpha;
  return j.bias ? y + bias : y;
}

// out[at .. at + count) (count <= W) = y rounded to the output dtype.
SG_INLINE void store_out(const SmallGemmJob& j, int64_t at, F y, int64_t count) {
  switch (j.out_type) {
    case SgOut::F32:
      store_first(static_cast<float*>(j.out) + at, y, count);
      break;
    case SgOut::BF16:
      store_first(static_cast<uint16_t*>(j.out) + at, __builtin_convertvector(to_bf16_bits(y), H), count);
      break;
    case SgOut::F16:
      store_first(static_cast<uint16_t*>(j.out) + at, __builtin_convertvector(to_f16_bits(y), H), count);
      break;
  }
}

// s = A: rows [i0, i0 + MB) of out x the NV panels from p0 (columns 16 p0 ..).
template <int MB, int NV>
void tile_rows(const SmallGemmJob& j, const Shape& sh, int64_t i0, int64_t p0) {
  constexpr int C = NV * kVecs;  // accumulators per row
  const float* s[MB];
  for (int i = 0; i < MB; ++i) s[i] = j.s_pack + (i0 + i) * sh.s_prs;
  const float* v = j.v_pack + p0 * sh.K * kLanes;
  const int64_t vstride = sh.K * kLanes, sk = sh.s_pks;
  F acc[MB][C];
  for (int i = 0; i < MB; ++i) {
    for (int c = 0; c < C; ++c) acc[i][c] = F{};
  }
  for (int64_t k = 0; k < sh.K; ++k) {
    F b[C];
    for (int c = 0; c < C; ++c) b[c] = load<F>(v + (c / kVecs) * vstride + k * kLanes + (c % kVecs) * kW);
    for (int i = 0; i < MB; ++i) {
      const F a = splat(s[i][k * sk]);
      for (int c = 0; c < C; ++c) acc[i][c] = fma(a, b[c], acc[i][c]);
    }
  }
  for (int c = 0; c < C; ++c) {
    const int64_t n0 = p0 * kLanes + c * kW, count = sh.N - n0;
    const F bias = j.bias ? load_first<F>(j.bias + n0, count) : F{};
    for (int i = 0; i < MB; ++i) store_out(j, (i0 + i) * sh.N + n0, finish(j, acc[i][c], bias), count);
  }
}

// Tiles of the last rows (fewer than kRowTile).
template <int NV, int MB = kRowTile - 1>
void tile_rows_tail(const SmallGemmJob& j, const Shape& sh, int64_t i0, int64_t p0, int64_t mb) {
  if constexpr (MB >= 1) {
    if (mb == MB) return tile_rows<MB, NV>(j, sh, i0, p0);
    return tile_rows_tail<NV, MB - 1>(j, sh, i0, p0, mb);
  }
}

// s = B: columns [i0, i0 + CB) of out (rows of B) x panel p (rows 16 p .. of out): accumulators i hold column i0 + i;
// finished and rounded in the vectors, then written through `buf` as rows of out.
template <int CB>
void tile_cols(const SmallGemmJob& j, const Shape& sh, int64_t i0, int64_t p) {
  const float* s[CB];
  for (int i = 0; i < CB; ++i) s[i] = j.s_pack + (i0 + i) * sh.s_prs;
  const float* v = j.v_pack + p * sh.K * kLanes;
  const int64_t sk = sh.s_pks;
  F acc[CB][kVecs];
  for (int i = 0; i < CB; ++i) {
    for (int q = 0; q < kVecs; ++q) acc[i][q] = F{};
  }
  for (int64_t k = 0; k < sh.K; ++k) {
    F b[kVecs];
    for (int q = 0; q < kVecs; ++q) b[q] = load<F>(v + k * kLanes + q * kW);
    for (int i = 0; i < CB; ++i) {
      const F a = splat(s[i][k * sk]);
      for (int q = 0; q < kVecs; ++q) acc[i][q] = fma(a, b[q], acc[i][q]);
    }
  }
  const int64_t rows = std::min<int64_t>(kLanes, sh.M - p * kLanes);
  if (j.out_type == SgOut::F32) {
    float buf[kLanes][CB];
    for (int i = 0; i < CB; ++i) {
      const F bias = splat(j.bias ? j.bias[i0 + i] : 0.0f);
      for (int q = 0; q < kVecs; ++q) {
        const F y = finish(j, acc[i][q], bias);
        for (int t = 0; t < kW; ++t) buf[q * kW + t][i] = y[t];
      }
    }
    for (int64_t t = 0; t < rows; ++t) {
      std::memcpy(static_cast<float*>(j.out) + (p * kLanes + t) * sh.N + i0, buf[t], CB * sizeof(float));
    }
    return;
  }
  uint16_t buf[kLanes][CB];
  for (int i = 0; i < CB; ++i) {
    const F bias = splat(j.bias ? j.bias[i0 + i] : 0.0f);
    for (int q = 0; q < kVecs; ++q) {
      const F y = finish(j, acc[i][q], bias);
      const U h = j.out_type == SgOut::BF16 ? to_bf16_bits(y) : to_f16_bits(y);
      for (int t = 0; t < kW; ++t) buf[q * kW + t][i] = static_cast<uint16_t>(h[t]);
    }
  }
  for (int64_t t = 0; t < rows; ++t) {
    std::memcpy(static_cast<uint16_t*>(j.out) + (p * kLanes + t) * sh.N + i0, buf[t], CB * sizeof(uint16_t));
  }
}

// The last columns (fewer than kColTile).
template <int CB = kColTile - 1>
void tile_cols_tail(const SmallGemmJob& j, const Shape& sh, int64_t i0, int64_t p, int64_t cb) {
  if constexpr (CB >= 1) {
    if (cb == CB) return tile_cols<CB>(j, sh, i0, p);
    return tile_cols_tail<CB - 1>(j, sh, i0, p, cb);
  }
}

int64_t v_units(const SmallGemmJob& j) { return (j.v.rows + kLanes - 1) / kLanes; }

void widen(const uint16_t* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; i += kW) store_first(dst + i, widen_w(src + i, n - i), n - i);
}

void pack_v(const SmallGemmJob& j, int64_t p0, int64_t p1) {
  const int64_t K = j.K;
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t rows = std::min<int64_t>(kLanes, j.v.rows - p * kLanes);
    float* dst = j.v_pack + p * K * kLanes;
    if (j.v.ks != 1) {  // column-major storage: the 16 rows of a k are adjacent
      const uint16_t* src = j.v.x + p * kLanes * j.v.rs;
      for (int64_t k = 0; k < K; ++k) {
        for (int q = 0; q < kVecs; ++q) {
          store_first(dst + k * kLanes + q * kW, widen_w(src + k * j.v.ks + q * kW, rows - q * kW), kW);
        }
      }
      continue;
    }
    for (int64_t k0 = 0; k0 < K; k0 += kLanes) {  // row-major: 16 x 16 blocks, widened, then transposed
      const int64_t kn = std::min<int64_t>(kLanes, K - k0);
      float block[kLanes][kLanes] = {};
      for (int64_t t = 0; t < rows; ++t) widen(j.v.x + (p * kLanes + t) * j.v.rs + k0, kn, block[t]);
      for (int64_t c = 0; c < kn; ++c) {
        for (int t = 0; t < kLanes; ++t) dst[(k0 + c) * kLanes + t] = block[t][c];
      }
    }
  }
}

int64_t tiles(const SmallGemmJob& j) {
  const Shape sh = shape_of(j);
  if (j.out_transposed) return (sh.N + kColTile - 1) / kColTile * sh.panels;
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
    const int64_t nb = (sh.N + kColTile - 1) / kColTile, chunk = chunk_blocks(kColTile, sh.K);
    for (int64_t u = u0; u < u1; ++u) {
      const Tile t = tile_of(u, nb, sh.panels, chunk);
      const int64_t i0 = t.block * kColTile, cols = std::min<int64_t>(kColTile, sh.N - i0);
      if (cols == kColTile) {
        tile_cols<kColTile>(j, sh, i0, t.group);
      } else {
        tile_cols_tail(j, sh, i0, t.group, cols);
      }
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
    } else if (rows == kRowTile) {
      tile_rows<kRowTile, 1>(j, sh, i0, p0);
    } else {
      tile_rows_tail<1>(j, sh, i0, p0, rows);
    }
  }
}

}  // namespace

const SmallGemmKernels& small_gemm_kernels() {
  static const SmallGemmKernels table{widen, v_units, pack_v, tiles, run_tiles};
  return table;
}

}  // namespace ENGINE_ISA_NS
}  // namespace engine_native
