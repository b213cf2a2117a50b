// The weight-only GEMM kernels of wo_gemm.h, one source compiled per instruction set (common/isa_begin.h).
//
// Vectors are the native width of the level: L = 16 fp32 lanes (AVX-512), 8 (AVX2), 4 (SSE2, NEON), so each
// is one register and the compiler never splits or scalarises them. A tile is MB rows of x times NR rows of
// w over all of K, its MB x NR sums in vectors (added up at the end).
//
// The weight codes are taken out without widening:
//   int4: a step is 4L bytes (8L codes) of a row; an interleave with a constant puts 4 codes under an fp32
//         exponent field in every lane, and each code becomes the float q - 8 by one AND and one subtraction
//         (see int4_lanes / int4_code). The sums run over x * (q - 8) per group; scale and zero are applied per
//         group (scale * sums + zero * the group's x sum). Measured on Zen 4 (one thread, 2048x2048 g128, weight
//         in the cache) against the table / arithmetic dequantization it replaces: 1.7x at avx2, 1.6x at
//         baseline; cold 4096x4096 g128 at avx2 1.35 vs 2.2-2.5 ms.
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
// A step reads 4L bytes (8L codes) of a row. Its 16-bit words (4 codes each) are interleaved with the constant
// 0x4F00 (punpcklwd / punpckhwd: per 16 bytes, words 0-3 into vector a, 4-7 into b), so every 32-bit lane holds
// 4 codes under the exponent field 0x9E. Code j of a lane is then decoded by one AND and one subtraction: the AND
// keeps nibble j and the exponent E_j = 150 - 4j (its bits are a subset of 0x9E's), which makes the float
// 2^(23 - 4j) + q exactly; subtracting 2^(23 - 4j) + 8 leaves q - 8 exactly. Per group the sums run over
// x * (q - 8), then scale * sums + zero * (the group's x sum): the same value as the reference's
// sum x * ((q - 8) * scale + zero) up to the order and grouping of fp32 additions (wo_gemm.h).
constexpr int64_t kInt4Step = 8 * L;  // codes of a row per step; each 32-code chunk fills a group of 4 lanes
typedef uint16_t u16n __attribute__((vector_size(4 * L)));

// Vectors a (k = 0) and b (k = 1) of the step at p: per 128 bits, the interleave of words 4k..4k+3 with 0x4F00.
template <int k>
WO_INLINE uv int4_lanes(const uint8_t* p) {
  const u16n w = load<u16n>(p);
  const u16n e = w - w + static_cast<uint16_t>(0x4F00);
  constexpr int o = 4 * k, n = 2 * L;  // e's lanes are n.. in the shuffle
#if ENGINE_ISA_LEVEL == 2 && defined(__x86_64__)
  return reinterpret_cast<uv>(__builtin_shufflevector(w, e, o, n + o, o + 1, n + o + 1, o + 2, n + o + 2, o + 3,
      n + o + 3, o + 8, n + o + 8, o + 9, n + o + 9, o + 10, n + o + 10, o + 11, n + o + 11, o + 16, n + o + 16,
      o + 17, n + o + 17, o + 18, n + o + 18, o + 19, n + o + 19, o + 24, n + o + 24, o + 25, n + o + 25, o + 26,
      n + o + 26, o + 27, n + o + 27));
#elif ENGINE_ISA_LEVEL == 1 && defined(__x86_64__)
  return reinterpret_cast<uv>(__builtin_shufflevector(w, e, o, n + o, o + 1, n + o + 1, o + 2, n + o + 2, o + 3,
      n + o + 3, o + 8, n + o + 8, o + 9, n + o + 9, o + 10, n + o + 10, o + 11, n + o + 11));
#else
  return reinterpret_cast<uv>(__builtin_shufflevector(w, e, o, n + o, o + 1, n + o + 1, o + 2, n + o + 2, o + 3,
      n + o + 3));
#endif
}

// Code j of each lane (from int4_lanes) as the float q - 8.
template <int j>
WO_INLINE fv int4_code(uv lanes) {
  constexpr uint32_t exponent = 150u - 4u * j;
  constexpr float offset = static_cast<float>((1 << (23 - 4 * j)) + 8);
  const uv kept = lanes & ((exponent << 23) | (0xFu << (4 * j)));
  return reinterpret_cast<const fv&>(kept) - offset;
}

// x position (within its step) of code j of lane l of vector k (see int4_lanes) is 4 * word + j.
WO_INLINE int64_t int4_position(int k, int j, int l) { return 4 * ((l / 4) * 8 + 4 * k + l % 4) + j; }

// x [M, K] -> out [M, ldx] (ldx: K rounded up to a step), vector 4k + j of each step holding the x's of code j of
// vector k, zeros past K; xsum [M, K / group]: x's fp32 sum over each group, in k order.
void int4_pack_x(const float* x, int64_t M, int64_t K, int64_t group, float* out, int64_t ldx, float* xsum) {
  for (int64_t m = 0; m < M; ++m) {
    const float* src = x + m * K;
    float* dst = out + m * ldx;
    for (int64_t s = 0; s < ldx; s += kInt4Step) {
      for (int k = 0; k < 2; ++k) {
        for (int j = 0; j < 4; ++j) {
          for (int l = 0; l < L; ++l) {
            const int64_t i = s + int4_position(k, j, l);
            dst[s + (4 * k + j) * L + l] = i < K ? src[i] : 0.0f;
          }
        }
      }
    }
    for (int64_t g = 0; g < K / group; ++g) {
      float sum = 0.0f;
      for (int64_t i = 0; i < group; ++i) sum += src[g * group + i];
      xsum[m * (K / group) + g] = sum;
    }
  }
}

// The groups of the 32-code chunks of a step (lanes 4c..4c+3 hold chunk c), stepped along without divisions.
struct Int4Chunks {
  int64_t group[L / 4], at[L / 4], per;  // chunk c's group and its place in it (in chunks); chunks per group
  WO_INLINE explicit Int4Chunks(int64_t group_size) : per(group_size / 32) {
    for (int c = 0; c < L / 4; ++c) group[c] = c / per, at[c] = c % per;
  }
  WO_INLINE void next() {
    for (int c = 0; c < L / 4; ++c) {
      for (at[c] += L / 4; at[c] >= per; at[c] -= per) ++group[c];
    }
  }
  // Row n's scale-and-zero words of the chunks' groups, each in its chunk's 4 lanes (0 past K: the padding's
  // codes meet zeros in x).
  WO_INLINE uv words(const WoInt4Job& job, int64_t groups, int64_t n) const {
    uint32_t word[L / 4];
    for (int c = 0; c < L / 4; ++c) word[c] = group[c] < groups ? job.sz[group[c] * job.sz_ld + n] : 0u;
    uv u;
    for (int l = 0; l < L; ++l) u[l] = word[l / 4];
    return u;
  }
  // x's sum over each group in lane 4c of the group's first chunk c, else 0.
  WO_INLINE fv sums(const float* xsum, int64_t groups) const {
    fv v = fv{};
    for (int c = 0; c < L / 4; ++c) v[4 * c] = at[c] == 0 && group[c] < groups ? xsum[group[c]] : 0.0f;
    return v;
  }
};

// The half k (vector a or b of int4_lanes) of a step: codes j = 0..3 of every lane against x's vectors j.
template <int k, int MB, int NR>
WO_INLINE void int4_half(const uint8_t* const* w, const float* x, int64_t ldx, fv (&t)[MB][NR][2]) {
  uv lanes[NR];
  for (int r = 0; r < NR; ++r) lanes[r] = int4_lanes<k>(w[r]);
  const auto code = [&](auto j) {
    fv xv[MB];
    for (int m = 0; m < MB; ++m) xv[m] = load<fv>(x + m * ldx + decltype(j)::value * L);
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const fv d = int4_code<decltype(j)::value>(lanes[r]);
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) t[m][r][decltype(j)::value % 2] = madd(xv[m], d, t[m][r][decltype(j)::value % 2]);
    }
  };
  code(std::integral_constant<int, 0>{});
  code(std::integral_constant<int, 1>{});
  code(std::integral_constant<int, 2>{});
  code(std::integral_constant<int, 3>{});
}

// t[m][r][j % 2] += x * (q - 8) over the step at k0 of rows w (the step's bytes; x at x + k0 of each row): two
// sums per row, so that enough independent multiply-adds are in flight; each x vector loaded once for all rows.
template <int MB, int NR>
WO_INLINE void int4_step(const uint8_t* const* w, const float* x, int64_t ldx, int64_t k0, fv (&t)[MB][NR][2]) {
  for (int r = 0; r < NR; ++r) prefetch(w[r]);
  int4_half<0>(w, x + k0, ldx, t);
  int4_half<1>(w, x + k0 + 4 * L, ldx, t);
}

template <int MB, int NR>
void int4_tile(const WoInt4Job& job, int64_t m0, int64_t n0) {
  const int64_t K = job.K, kb = K / 2, ldx = job.ldx, groups = K / job.group;
  const int64_t full = K / kInt4Step * kInt4Step;
  const uint8_t* w[NR];
  for (int r = 0; r < NR; ++r) w[r] = job.w + (n0 + r) * kb;
  const float* x = job.x + m0 * ldx;
  fv acc[MB][NR], t[MB][NR][2];
  for (int m = 0; m < MB; ++m) {
    for (int r = 0; r < NR; ++r) acc[m][r] = fv{};
  }
  const uint8_t* at[NR];
  if (job.group % kInt4Step == 0) {  // whole steps per group: the scale applied once per group
    const int64_t steps = job.group / kInt4Step;
    for (int64_t g = 0; g < groups; ++g) {
      for (int m = 0; m < MB; ++m) {
        for (int r = 0; r < NR; ++r) t[m][r][0] = t[m][r][1] = fv{};
      }
      for (int64_t c = 0; c < steps; ++c) {
        const int64_t k0 = (g * steps + c) * kInt4Step;
        for (int r = 0; r < NR; ++r) at[r] = w[r] + k0 / 2;
        int4_step<MB, NR>(at, x, ldx, k0, t);
      }
      for (int r = 0; r < NR; ++r) {
        const fv s = splat(bf16_value(job.sz[g * job.sz_ld + n0 + r] & 0xFFFFu));
        for (int m = 0; m < MB; ++m) acc[m][r] = madd(t[m][r][0] + t[m][r][1], s, acc[m][r]);
      }
    }
  } else {  // groups within a step: the scales per lane, applied per step
    Int4Chunks chunks(job.group);
    const auto step = [&](int64_t k0, const uint8_t* const* rows) __attribute__((always_inline)) {
      for (int m = 0; m < MB; ++m) {
        for (int r = 0; r < NR; ++r) t[m][r][0] = t[m][r][1] = fv{};
      }
      int4_step<MB, NR>(rows, x, ldx, k0, t);
      fv xs[MB];
      for (int m = 0; m < MB; ++m) xs[m] = chunks.sums(job.xsum + (m0 + m) * groups, groups);
      for (int r = 0; r < NR; ++r) {
        const uv u = chunks.words(job, groups, n0 + r);
        const uv su = u << 16, zu = u & 0xFFFF0000u;
        const fv s = reinterpret_cast<const fv&>(su), z = reinterpret_cast<const fv&>(zu);
        for (int m = 0; m < MB; ++m) acc[m][r] = madd(z, xs[m], madd(t[m][r][0] + t[m][r][1], s, acc[m][r]));
      }
      chunks.next();
    };
    for (int64_t k0 = 0; k0 < full; k0 += kInt4Step) {
      for (int r = 0; r < NR; ++r) at[r] = w[r] + k0 / 2;
      step(k0, at);
    }
    if (full < K) {  // the last, partial step: zero bytes past K (zeros in x too)
      uint8_t tail[NR][kInt4Step / 2] = {};
      for (int r = 0; r < NR; ++r) {
        std::memcpy(tail[r], w[r] + full / 2, static_cast<size_t>((K - full) / 2));
        at[r] = tail[r];
      }
      step(full, at);
    }
  }
  for (int m = 0; m < MB; ++m) {
    const float* xs = job.xsum + (m0 + m) * groups;
    for (int r = 0; r < NR; ++r) {
      float zsum = 0.0f;  // sum over groups of zero * the group's x sum (whole steps per group; else in acc)
      if (job.group % kInt4Step == 0) {
        for (int64_t g = 0; g < groups; ++g) zsum += bf16_value(job.sz[g * job.sz_ld + n0 + r] >> 16) * xs[g];
      }
      job.y[(m0 + m) * job.ldy + n0 + r] = reduce_add(acc[m][r]) + zsum;
    }
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

// Every m for the NR rows at n0: blocks of MAX_MB, then 4, 2, 1 rows of x (the weight rows stay in L1 meanwhile).
template <int NR, int MAX_MB = kMaxMB, typename Job, typename Tile>
WO_INLINE void all_m(const Job& job, int64_t n0, Tile tile) {
  int64_t m = 0;
  for (; m + MAX_MB <= job.M; m += MAX_MB) tile(std::integral_constant<int, MAX_MB>{}, job, m, n0);
  if (MAX_MB > 4 && m + 4 <= job.M) { tile(std::integral_constant<int, (MAX_MB > 4 ? 4 : 1)>{}, job, m, n0); m += 4; }
  if (MAX_MB > 2 && m + 2 <= job.M) { tile(std::integral_constant<int, (MAX_MB > 2 ? 2 : 1)>{}, job, m, n0); m += 2; }
  for (; m < job.M; ++m) tile(std::integral_constant<int, 1>{}, job, m, n0);
}

WO_INLINE const float* x_rows(const WoInt8Job& job, int64_t m0) { return job.x + m0 * job.ldx; }
WO_INLINE const float* x_rows(const WoInt4Job& job, int64_t m0) { return job.x ? job.x + m0 * job.ldx : nullptr; }
WO_INLINE void advance(WoInt8Job&, int64_t, int64_t) {}
WO_INLINE void advance(WoInt4Job& job, int64_t m0, int64_t groups) {
  if (job.xb) job.xb += m0 * job.K;
  job.xsum += m0 * groups;
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

// Rows per tile: 4 for a single row of x (more independent sums), else 2 (the sums of a group and of all of K
// for MB x 2: a quarter of the registers at MB = kMaxMB / 2).
constexpr int kInt4MaxMB = kMaxMB / 2;
void int4_panel(const WoInt4Job& job, int64_t n0, int64_t n1) {
  const auto tile2 = [](auto mb, const WoInt4Job& j, int64_t m, int64_t n) { int4_tile<decltype(mb)::value, 2>(j, m, n); };
  const auto tile1 = [](auto mb, const WoInt4Job& j, int64_t m, int64_t n) { int4_tile<decltype(mb)::value, 1>(j, m, n); };
  int64_t n = n0;
  if (job.M == 1) {
    for (; n + 4 <= n1; n += 4) int4_tile<1, 4>(job, 0, n);
  } else {
    for (; n + 2 <= n1; n += 2) all_m<2, kInt4MaxMB>(job, n, tile2);
  }
  for (; n < n1; ++n) all_m<1, kInt4MaxMB>(job, n, tile1);
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
  by_panels(job, n0, n1, job.ldx * 4, job.K / job.group, int4_panel);
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

#include "inference/wo_block_kernels.h"
#ifdef ENGINE_WO_BF16
#include "inference/wo_gemm_bf16_kernels.h"
#endif

namespace engine_native {
namespace ENGINE_ISA_NS {

const WoKernels& wo_kernels() {
  static const WoKernels table = [] {
    WoKernels t{};
    t.int4_block = kInt4Step;
    t.int4_pack_x = int4_pack_x;
    t.int4_rows = int4_rows;
    t.int8_block = kInt8Block;
    t.int8_pack_x = int8_pack_x;
    t.int8_rows = int8_rows;
    t.block_vector_k = block_vector_k;
    t.block_pack_x = block_pack_x;
    t.block_rows = block_rows;
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
