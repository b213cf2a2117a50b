// The weight-only GEMM kernels of wo_gemm.h, one source compiled per instruction set (common/isa_begin.h).
//
// Vectors are the native width of the level: L = 16 fp32 lanes (AVX-512), 8 (AVX2), 4 (SSE2, NEON), so each
// is one register and the compiler never splits or scalarises them. A tile is MB rows of x times NR rows of
// w over all of K, its MB x NR sums in vectors (added up at the end).
//
// The weight bytes are read as whole 32-bit words and their codes taken out by shifts, so nothing is widened:
//   int4: a step reads 16 bytes (32 codes, 4 words) of a row into every group of 4 lanes; vector v shifts
//         lane l by 4 * (v * L / 4 + l / 4), leaving code 8 * (l % 4) + v * L / 4 + l / 4 in its low nibble.
//         The code becomes (q - 8) * scale + zero (the product exact: the reference's value bit for bit) by a
//         16-entry lookup table made once per group (AVX-512: one permute, which reads the low 4 bits of the
//         lane) or by arithmetic (AVX2 and below: mask, convert, multiply, add).
//   int8: a block is 4L bytes of a row, widened to 32-bit lanes (see int8_vector).
// x is stored in the matching order by the pack functions, so the sums run over matching pairs.
#include "inference/wo_gemm.h"
#include "common/vec.h"

#if ENGINE_ISA_LEVEL >= 1 && defined(__x86_64__)
#include <immintrin.h>  // the int8 widening (below), and at AVX-512 the bf16 path
#endif
#if ENGINE_ISA_LEVEL == 2 && defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ENGINE_WO_BF16 1  // int4 x bf16 by vdpbf16ps (AVX512-BF16), chosen at run time
#endif

namespace engine_native {
namespace ENGINE_ISA_NS {
namespace {

#define WO_INLINE inline __attribute__((always_inline))

constexpr int L = vec::kNativeLanes;  // the level's native vectors (common/vec.h)
using fv = vec::f32n;
using uv = vec::u32n;
using iv = vec::i32n;
typedef uint32_t u32x4 __attribute__((vector_size(16)));

// An unaligned load (a memcpy into a vector variable makes GCC 12 copy it through the stack).
template <typename V>
WO_INLINE V load(const void* p) {
  typedef V unaligned __attribute__((aligned(1), may_alias));
  return *static_cast<const unaligned*>(p);
}

// Every lane = s (not 0 + s, which would turn -0 into +0).
WO_INLINE fv splat(float s) {
  fv v;
  for (int i = 0; i < L; ++i) v[i] = s;
  return v;
}

// c + a * b: one fused rounding where the level has FMA (any order and rounding of the sums is in the contract).
WO_INLINE fv madd(fv a, fv b, fv c) {
#if ENGINE_ISA_LEVEL >= 1 || defined(__aarch64__)
  fv r;
  for (int i = 0; i < L; ++i) r[i] = __builtin_fmaf(a[i], b[i], c[i]);
  return r;
#else
  return c + a * b;
#endif
}

// The lanes' sum, by halving (the same order for every tile).
WO_INLINE float reduce_add(fv v) {
  float a[L];
  std::memcpy(a, &v, sizeof a);
  for (int w = L / 2; w >= 1; w /= 2) {
    for (int i = 0; i < w; ++i) a[i] += a[i + w];
  }
  return a[0];
}

WO_INLINE float bf16_value(uint32_t bits16) {
  const uint32_t u = bits16 << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// A tile reads NR weight rows as NR streams at once; fetching this far ahead of each (past a row's end: the next
// tile's rows) keeps memory busy where the hardware prefetcher ramps up too slowly for short rows (M = 1 on weights
// not in the cache). Measured best of 1, 4, 8 and 16 KiB (AVX-512 build).
constexpr int64_t kPrefetchBytes = 8192;
WO_INLINE void prefetch(const void* p) { __builtin_prefetch(static_cast<const char*>(p) + kPrefetchBytes, 0, 3); }

// ------------------------------------------------------------------------------ int4, fp32 x
constexpr int kInt4Vectors = static_cast<int>(kWoChunk) / L;  // vectors of codes per 32-code step

// The shifts of vector v (see the top).
WO_INLINE uv int4_shift(int v) {
  uv s;
  for (int l = 0; l < L; ++l) s[l] = static_cast<uint32_t>(4 * (v * L / 4 + l / 4));
  return s;
}

// 16 bytes of a row in every group of 4 lanes.
WO_INLINE uv int4_words(const uint8_t* p) {
  const u32x4 w = load<u32x4>(p);
#if ENGINE_ISA_LEVEL == 2  // by way of 8 lanes: GCC 12 takes the direct 4 -> 16 shuffle through memory
  typedef uint32_t u32x8 __attribute__((vector_size(32)));
  const u32x8 h = __builtin_shufflevector(w, w, 0, 1, 2, 3, 0, 1, 2, 3);
  return __builtin_shufflevector(h, h, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
#elif ENGINE_ISA_LEVEL == 1
  return __builtin_shufflevector(w, w, 0, 1, 2, 3, 0, 1, 2, 3);
#else
  return w;
#endif
}

// A group's (q - 8) * scale + zero for the code in the low nibble of each lane (higher bits ignored).
struct Int4Decoder {
#if ENGINE_ISA_LEVEL == 2
  fv table;  // entry q: (q - 8) * scale + zero
  Int4Decoder() = default;
  WO_INLINE explicit Int4Decoder(uint32_t sz) {
    fv q8;
    for (int i = 0; i < L; ++i) q8[i] = static_cast<float>(i - 8);
    table = q8 * splat(bf16_value(sz & 0xFFFFu)) + splat(bf16_value(sz >> 16));
  }
  WO_INLINE fv operator()(uv codes) const { return __builtin_shuffle(table, reinterpret_cast<iv&>(codes)); }
#else
  fv s, z;
  Int4Decoder() = default;
  WO_INLINE explicit Int4Decoder(uint32_t sz) : s(splat(bf16_value(sz & 0xFFFFu))), z(splat(bf16_value(sz >> 16))) {}
  WO_INLINE fv operator()(uv codes) const {
    const iv q = reinterpret_cast<iv>(codes & 15u) - 8;
    return __builtin_convertvector(q, fv) * s + z;
  }
#endif
};

void int4_pack_x(const float* x, int64_t M, int64_t K, float* out) {
  for (int64_t i = 0; i < M * K; i += kWoChunk) {
    for (int v = 0; v < kInt4Vectors; ++v) {
      for (int l = 0; l < L; ++l) out[i + v * L + l] = x[i + 8 * (l % 4) + v * L / 4 + l / 4];
    }
  }
}

template <int MB, int NR>
void int4_tile(const WoInt4Job& job, int64_t m0, int64_t n0) {
  const int64_t K = job.K, kb = K / 2, groups = K / job.group, steps = job.group / kWoChunk;
  const uint8_t* w[NR];
  for (int r = 0; r < NR; ++r) w[r] = job.w + (n0 + r) * kb;
  const float* x = job.x + m0 * K;
  fv acc[MB][NR];
  for (int m = 0; m < MB; ++m) {
    for (int r = 0; r < NR; ++r) acc[m][r] = fv{};
  }
  for (int64_t g = 0; g < groups; ++g) {
    const uint32_t* sz = job.sz + g * job.sz_ld + n0;
    Int4Decoder decode[NR];
    for (int r = 0; r < NR; ++r) decode[r] = Int4Decoder(sz[r]);
    for (int64_t c = 0; c < steps; ++c) {
      const int64_t k0 = (g * steps + c) * kWoChunk;
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) {
        prefetch(w[r] + k0 / 2);
        const uv words = int4_words(w[r] + k0 / 2);
#pragma GCC unroll 8
        for (int v = 0; v < kInt4Vectors; ++v) {
          const fv wv = decode[r](words >> int4_shift(v));
#pragma GCC unroll 8
          for (int m = 0; m < MB; ++m) acc[m][r] = madd(load<fv>(x + m * K + k0 + v * L), wv, acc[m][r]);
        }
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int r = 0; r < NR; ++r) job.y[(m0 + m) * job.ldy + n0 + r] = reduce_add(acc[m][r]);
  }
}

// ------------------------------------------------------------------------------ int8 / E4M3, fp32 x
constexpr int64_t kInt8Block = 4 * L;  // bytes of a row per block: 4 vectors

// AVX2 / AVX-512: bytes widened to 32-bit lanes by vpmovsxbd / vpmovzxbd, which GCC 12 does not make of
// __builtin_convertvector (it goes byte by byte): hand intrinsics, measured on Zen 4 at M = 1 against the
// shift form below (AVX-512 build, one thread): 1.42x with the weight in the cache (2048x2048), 1.25x cold
// (4096x4096); x in natural order. Elsewhere: a block is read as L words, byte j of lane l is weight 4l + j,
// taken out by shifts, x stored in that order.
#if ENGINE_ISA_LEVEL >= 1 && defined(__x86_64__)
#define WO_INT8_WIDEN 1
WO_INLINE iv widen_i8(const int8_t* p) {
#if ENGINE_ISA_LEVEL == 2
  return reinterpret_cast<iv>(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  return reinterpret_cast<iv>(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#endif
}
WO_INLINE uv widen_u8(const int8_t* p) {
#if ENGINE_ISA_LEVEL == 2
  return reinterpret_cast<uv>(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  return reinterpret_cast<uv>(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#endif
}
#endif

// x position of weight byte i of a block.
WO_INLINE int64_t int8_position(int64_t i) {
#ifdef WO_INT8_WIDEN
  return i;
#else
  return (i % 4) * L + i / 4;
#endif
}

void int8_pack_x(const float* x, int64_t M, int64_t K, float* out, int64_t ldx) {
  for (int64_t m = 0; m < M; ++m) {
    const float* src = x + m * K;
    float* dst = out + m * ldx;
    for (int64_t b = 0; b < ldx; b += kInt8Block) {
      for (int64_t i = 0; i < kInt8Block; ++i) dst[b + int8_position(i)] = b + i < K ? src[b + i] : 0.0f;
    }
  }
}

// An E4M3 code per lane (0..255) decoded exactly: its magnitude bits placed in an fp32's exponent and mantissa
// and scaled by 2^120, the bias difference (subnormal codes land on fp32 denormals, exact too, since the threads
// run without DAZ); the NaN codes S.1111.111 become a quiet NaN.
WO_INLINE fv e4m3_value(uv code) {
  const uv mag = code & 0x7Fu;
  const uv bits = ((code & 0x80u) << 24) | (mag << 20);
  const fv v = reinterpret_cast<const fv&>(bits) * splat(1.329227995784916e36f);  // 2^120
  const iv nan = mag == 0x7Fu;
  const iv quiet = reinterpret_cast<iv>(uv{} + 0x7FC00000u);
  const iv out = (reinterpret_cast<const iv&>(v) & ~nan) | (quiet & nan);
  return reinterpret_cast<const fv&>(out);
}

// Vector j of the block at p as fp32: int8 values, or E4M3 codes decoded.
template <bool E4M3>
WO_INLINE fv int8_vector(const int8_t* p, int j) {
#ifdef WO_INT8_WIDEN
  if (E4M3) return e4m3_value(widen_u8(p + j * L));
  return __builtin_convertvector(widen_i8(p + j * L), fv);
#else
  const uv top = load<uv>(p) << (24 - 8 * j);  // byte j of each word in bits 24..31
  if (E4M3) return e4m3_value(top >> 24);
  return __builtin_convertvector(reinterpret_cast<const iv&>(top) >> 24, fv);
#endif
}

template <int MB, int NR, bool E4M3>
void int8_tile(const WoInt8Job& job, int64_t m0, int64_t n0) {
  const int64_t K = job.K, ldx = job.ldx, full = K / kInt8Block * kInt8Block;
  const int8_t* w[NR];
  for (int r = 0; r < NR; ++r) w[r] = job.w + (n0 + r) * K;
  const float* x = job.x + m0 * ldx;
  fv acc[MB][NR];
  for (int m = 0; m < MB; ++m) {
    for (int r = 0; r < NR; ++r) acc[m][r] = fv{};
  }
  auto block = [&](int64_t k, const int8_t* const* rows) {
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      fv wv[NR];
      for (int r = 0; r < NR; ++r) wv[r] = int8_vector<E4M3>(rows[r], j);
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        const fv xv = load<fv>(x + m * ldx + k + j * L);
#pragma GCC unroll 4
        for (int r = 0; r < NR; ++r) acc[m][r] = madd(xv, wv[r], acc[m][r]);
      }
    }
  };
  for (int64_t k = 0; k < full; k += kInt8Block) {
    const int8_t* rows[NR];
    for (int r = 0; r < NR; ++r) {
      if (k % 64 == 0) prefetch(w[r] + k);
      rows[r] = w[r] + k;
    }
    block(k, rows);
  }
  if (full < K) {  // the tail: zero bytes past K (zeros in x too)
    int8_t tail[NR][kInt8Block] = {};
    const int8_t* rows[NR];
    for (int r = 0; r < NR; ++r) {
      std::memcpy(tail[r], w[r] + full, static_cast<size_t>(K - full));
      rows[r] = tail[r];
    }
    block(full, rows);
  }
  for (int m = 0; m < MB; ++m) {
    for (int r = 0; r < NR; ++r) {
      job.y[(m0 + m) * job.ldy + n0 + r] = reduce_add(acc[m][r]) * job.scale[n0 + r];
    }
  }
}

// ------------------------------------------------------------------------------ tiling
// Rows of x per tile at M > 1 (the MB x 2 sums and the decoded weights fill about half the registers).
constexpr int kMaxMB = L == 16 ? 8 : 4;

// Every m for the NR rows at n0: blocks of kMaxMB, then 4, 2, 1 rows of x (the weight rows stay in L1 meanwhile).
template <int NR, typename Job, typename Tile>
WO_INLINE void all_m(const Job& job, int64_t n0, Tile tile) {
  int64_t m = 0;
  for (; m + kMaxMB <= job.M; m += kMaxMB) tile(std::integral_constant<int, kMaxMB>{}, job, m, n0);
  if (kMaxMB > 4 && m + 4 <= job.M) { tile(std::integral_constant<int, 4>{}, job, m, n0); m += 4; }
  if (m + 2 <= job.M) { tile(std::integral_constant<int, 2>{}, job, m, n0); m += 2; }
  if (m < job.M) tile(std::integral_constant<int, 1>{}, job, m, n0);
}

WO_INLINE const float* x_rows(const WoInt8Job& job, int64_t m0) { return job.x + m0 * job.ldx; }
WO_INLINE const float* x_rows(const WoInt4Job& job, int64_t m0) { return job.x ? job.x + m0 * job.K : nullptr; }
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
    part.x = x_rows(job, m0);
    advance(part, m0, groups);
    rows(part, n0, n1);
  }
}

// Rows per tile: 4 for a single row of x (more independent sums), else 2.
void int4_panel(const WoInt4Job& job, int64_t n0, int64_t n1) {
  const auto tile2 = [](auto mb, const WoInt4Job& j, int64_t m, int64_t n) { int4_tile<decltype(mb)::value, 2>(j, m, n); };
  const auto tile1 = [](auto mb, const WoInt4Job& j, int64_t m, int64_t n) { int4_tile<decltype(mb)::value, 1>(j, m, n); };
  int64_t n = n0;
  if (job.M == 1) {
    for (; n + 4 <= n1; n += 4) int4_tile<1, 4>(job, 0, n);
  } else {
    for (; n + 2 <= n1; n += 2) all_m<2>(job, n, tile2);
  }
  for (; n < n1; ++n) all_m<1>(job, n, tile1);
}

template <bool E4M3>
void byte_panel(const WoInt8Job& job, int64_t n0, int64_t n1) {
  const auto tile2 = [](auto mb, const WoInt8Job& j, int64_t m, int64_t n) {
    int8_tile<decltype(mb)::value, 2, E4M3>(j, m, n);
  };
  const auto tile1 = [](auto mb, const WoInt8Job& j, int64_t m, int64_t n) {
    int8_tile<decltype(mb)::value, 1, E4M3>(j, m, n);
  };
  int64_t n = n0;
  if (job.M == 1) {
    for (; n + 4 <= n1; n += 4) int8_tile<1, 4, E4M3>(job, 0, n);
  } else {
    for (; n + 2 <= n1; n += 2) all_m<2>(job, n, tile2);
  }
  for (; n < n1; ++n) all_m<1>(job, n, tile1);
}

void int4_rows(const WoInt4Job& job, int64_t n0, int64_t n1) {
  by_panels(job, n0, n1, job.K * 4, job.K / job.group, int4_panel);
}

void int8_rows(const WoInt8Job& job, int64_t n0, int64_t n1) {
  if (job.e4m3) return by_panels(job, n0, n1, job.ldx * 4, 0, byte_panel<true>);
  by_panels(job, n0, n1, job.ldx * 4, 0, byte_panel<false>);
}

// ------------------------------------------------------------------------------ helpers of the glue
bool has_subnormal(const float* x, int64_t n) {
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(x);
  bool found = false;
  for (int64_t i = 0; i < n; ++i) found |= (bits[i] & 0x7F800000u) == 0 && (bits[i] & 0x007FFFFFu) != 0;
  return found;
}

void to_bf16(const float* y, int64_t n, uint16_t* out) {
  const uint32_t* src = reinterpret_cast<const uint32_t*>(y);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = src[i];
    out[i] = (u & 0x7FFFFFFFu) > 0x7F800000u ? static_cast<uint16_t>((u >> 16) | 0x40u)
                                             : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
}

}  // namespace
}  // namespace ENGINE_ISA_NS
}  // namespace engine_native

#ifdef ENGINE_WO_BF16
#include "inference/wo_gemm_bf16_kernels.h"
#endif

namespace engine_native {
namespace ENGINE_ISA_NS {

const WoKernels& wo_kernels() {
  static const WoKernels table = [] {
    WoKernels t{};
    t.int4_pack_x = int4_pack_x;
    t.int4_rows = int4_rows;
    t.int8_block = kInt8Block;
    t.int8_pack_x = int8_pack_x;
    t.int8_rows = int8_rows;
    t.has_subnormal = has_subnormal;
    t.to_bf16 = to_bf16;
#ifdef ENGINE_WO_BF16
    if (bf16_supported()) {
      t.int4_pack_x_bf16 = int4_pack_x_bf16;
      t.int4_rows_bf16 = int4_rows_bf16;
    }
#endif
    return t;
  }();
  return table;
}

}  // namespace ENGINE_ISA_NS
}  // namespace engine_native
