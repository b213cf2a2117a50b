// NVFP4 quantize kernels, one source compiled once per instruction-set level (common/isa_begin.h): the
// per-element rules and the tile loops, written against the portable vector layer (common/vec.h), which each
// level lowers to SSE2, AVX2 or AVX-512 (NEON elsewhere). The glue (nvfp4_glue.cpp) calls the table of the
// active level. No torch here.
//
// Bit for bit engine/ops/nvfp4.py (TE's order of fp32 operations) and engine/ops/nvfp4_sr.py:
//   S_enc = fmin(2688 / amax, FLT_MAX), 1 if amax is 0 or that is 0; S_dec = 1 / S_enc
//   s_b   = e4m3_rne_satfinite(block_amax * (S_enc * fp32(1/6))), NaN -> 0x7F
//   enc_b = fmin(1 / (float(s_b) * S_dec), FLT_MAX);  q = e2m1(x * enc_b), RNE or stochastic
//   RHT   hadamard/rht16.h, on the 16 tokens of each column
// 4over6 (Nvfp4Job::four_over_six: two candidates per block, the lower-error one kept) is
// nvfp4_4over6_kernels.h, included below, on the same tiles.
// A tile is 16 rows x kNvfp4TileCols columns of x, converted to fp32 once: its rows hold the rowwise 1x16
// blocks, its columns the columnwise 16x1 blocks (of x, or of the RHT of the 16 tokens), its 16x16 squares
// the 2D tiles. The rules are branch-free fp32 / integer operations on vectors of the level's native width
// (vec::f32n / u32n: 4, 8 or 16 lanes), so that the compiler splits nothing: shuffles and narrowing of wider
// generic vectors are lowered lane by lane below AVX-512; bytes are packed by plain loops, which GCC vectorises
// with the level's pack instructions. The threads run with
// round-to-nearest and without flush-to-zero or denormals-are-zero (the glue sets MXCSR).

// No FP-exception semantics to keep (nothing reads the flags): lets the compiler if-convert (and vectorise)
// the fp32 compares and selects. Values are unchanged: rounding, signed zeros, NaN and inf are as written.
// Before the includes, so that the vector layer's inline helpers get the same options.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")
#endif

#include <cstdlib>  // malloc, free

#include "cast/nvfp4.h"
#include "common/vec.h"
#include "hadamard/rht16.h"

namespace engine_native {
namespace ENGINE_ISA_NS {
namespace {

constexpr int64_t kB = kNvfp4Block;
constexpr int64_t kT = kNvfp4TileCols;
constexpr float kFltMax = 3.4028234663852886e38f;

constexpr int kN = vec::kNativeLanes;  // lanes per vector
static_assert(kB % kN == 0 && kT % 16 == 0, "blocks of whole vectors");

using vec::f32x16;
using vec::i32x16;
using vec::u32x16;
using vec::f32n;
using vec::i32n;
using vec::u32n;
typedef int16_t i16n __attribute__((vector_size(4 * kN)));

// Lanes (a[0], b[0], a[1], b[1], ...) of the first (H = 0) or second (H = 1) halves of a and b: as 64-bit words,
// a's lane in the low half (little endian).
template <int H, int... I>
ENGINE_VEC_INLINE u32n interleave_half(u32n a, u32n b, std::integer_sequence<int, I...>) {
  return __builtin_shufflevector(a, b, (H * kN / 2 + I / 2 + (I % 2) * kN)...);
}
ENGINE_VEC_INLINE u32n interleave_lo(u32n a, u32n b) {
  return interleave_half<0>(a, b, std::make_integer_sequence<int, kN>{});
}
ENGINE_VEC_INLINE u32n interleave_hi(u32n a, u32n b) {
  return interleave_half<1>(a, b, std::make_integer_sequence<int, kN>{});
}

// ------------------------------------------------------------------------------ element rules
// The E2M1 code of |a| (a >= 0, bits mag) rounded to nearest even, saturating at 6. With c = min(mag, 6) and
// e = max(c's exponent field, 127 = that of 1.0, E2M1's smallest normal), the fp32 sum c + M with
// M = 2^(e - 105) + ((e - 127) << 1) ulps has E2M1's step at c as its ulp: it rounds c to that step, ties to
// even (the added ulps are even), and its low mantissa bits are the code (the subnormal 0.5 included). e takes
// three values (c in [0, 2), [2, 4), [4, 6]): M is picked by two compares (fewer operations than computing it).
constexpr uint32_t e2m1_magic(uint32_t e) { return ((e + 22u) << 23) + ((e - 127u) << 1); }

template <typename F, typename U, typename I>
ENGINE_VEC_INLINE U e2m1_magnitude(U mag) {
  const U c = vec::min(mag, vec::splat<U>(0x40C00000u));
  const I ci = (I)c;  // below 2^31: a signed compare orders it
  const U magic = vec::select(ci >= 0x40800000, vec::splat<U>(e2m1_magic(129)),
                              vec::select(ci >= 0x40000000, vec::splat<U>(e2m1_magic(128)),
                                          vec::splat<U>(e2m1_magic(127))));
  return (U)((F)c + (F)magic) & 0x7FFFFFu;
}

// mx_elements.encode(y, E2M1): RNE, +-inf -> +-6, NaN -> 0, the sign kept (-0 -> 8). NANS false: the caller
// knows y holds no NaN (its tile none), and the NaN lanes' masking is left out.
template <typename F, typename U, typename I, bool NANS = true>
ENGINE_VEC_INLINE U e2m1_rne(F y) {
  const U b = (U)y, mag = b & 0x7FFFFFFFu;
  const U code = e2m1_magnitude<F, U, I>(mag) | ((b >> 28) & 8u);
  if (!NANS) return code;
  return code & ~(U)(mag > 0x7F800000u);
}

// nvfp4_sr.encode_e2m1_stochastic with random bytes r: a = min(|y|, 6), step the grid step at a, lo = floor(a / step)
// * step; up one step iff (a - lo) / step * 256 >= 256 - r. In fixed point: n = floor(a / step * 256) (exact: a
// scaled by a power of 2, truncated), whose low 8 bits are floor((a - lo) / step * 256), so "up" is the carry of
// n + r out of them, and N = n + 256 * (E2M1's code of lo's binade start: 0, 4 or 6 for steps 0.5, 1, 2) gives the
// code as (N + r) >> 8. N is the fixed-point "log" of a: for a = 2^(e - 127) * (1 + f) >= 1 it is
// 512 * (e - 126) + floor(512 f), a's bits shifted right by 14 less 126 << 9 (a = 6: N = 1792, no carry past
// code 7); below 1 (step 0.5, code 0 at 0) it is floor(a * 512), a product by a power of 2 (exact), truncated.
// (Integer operations in place of the per-binade selects of the step and the code offset: 13 operations on
// AVX2 against about 20.)
template <typename F, typename U, typename I, bool NANS = true>
ENGINE_VEC_INLINE U e2m1_stochastic(F y, U r) {
  const U b = (U)y, magu = b & 0x7FFFFFFFu;
  const U a = vec::min(magu, vec::splat<U>(0x40C00000u));  // min(|y|, 6) as bits (NaN lanes: 6, zeroed at the end)
  const U below_one = (U)__builtin_convertvector((F)a * 512.0f, I);
  const U from_one = (a >> 14) - (126u << 9);
  const U n = vec::select((I)a < 0x3F800000, below_one, from_one);  // a below 2^31: a signed compare orders it
  const U code = ((n + r) >> 8) | ((b >> 28) & 8u);
  if (!NANS) return code;
  return code & ~(U)(magu > 0x7F800000u);
}

// ------------------------------------------------------------------------------ the random bits
template <typename U>
ENGINE_VEC_INLINE U hash32(U v) {  // "lowbias32"
  v ^= v >> 16;
  v *= 0x7FEB352Du;
  v ^= v >> 15;
  v *= 0x846CA68Bu;
  return v ^ (v >> 16);
}

inline uint32_t seed_key(uint64_t seed) {
  return hash32(static_cast<uint32_t>(seed)) ^ static_cast<uint32_t>(seed >> 32);
}

// The random byte of counter index j (nvfp4_sr.random_bits): byte j & 3 of the mix of the word w = j >> 2 =
// (hi << 32) + lo, from lo and the part of the mix that depends on hi alone (hi_key, of hi_key()): shared by
// the lanes of a run that carries into no new hi. One mix serves 4 consecutive indices.
template <typename U>
ENGINE_VEC_INLINE U hi_key(U hi, uint32_t key) {
  return key ^ (hi * 0x9E3779B9u);
}

template <typename U>
ENGINE_VEC_INLINE U word_mix(U lo, U hi_key) {
  return hash32(hash32(lo) ^ hi_key);
}

template <typename U>
ENGINE_VEC_INLINE U random_byte(U mix, U j_mod4) {
  return (mix >> (j_mod4 * 8u)) & 0xFFu;
}


// ------------------------------------------------------------------------------ scales
// E4M3 code of v, RNE, saturating at 448, NaN -> 0x7F, the sign kept (reference.cast_to_fp8). With c = min(|v|,
// 448) and e = max(c's exponent field, 121 = that of 2^-6, E4M3's smallest normal), the fp32 sum c + M with
// M = 2^(e - 107) + ((e - 121) << 3) ulps has E4M3's step at c as its ulp: it rounds c to that step, ties to
// even, and its low mantissa bits are the code (subnormals included).
template <typename F, typename U>
ENGINE_VEC_INLINE U e4m3_code(F v) {
  const U b = (U)v, mag = b & 0x7FFFFFFFu, zero = {};
  const U c = vec::select(mag < 0x43E00000u, mag, zero + 0x43E00000u);
  const U field = vec::max(c >> 23, zero + 121u);
  const U magic = ((field + 20u) << 23) + ((field - 121u) << 3);
  const U code = ((U)((F)c + (F)magic) & 0x7FFFFFu) | ((b >> 24) & 0x80u);
  return vec::select(mag > 0x7F800000u, zero + 0x7Fu, code);
}

// The fp32 value of E4M3 codes: the bits placed as an fp32 with the exponent 120 too small, times 2^120
// (exact, subnormal codes included: needs no denormals-are-zero); 0x7F / 0xFF are NaN.
template <typename F, typename U>
ENGINE_VEC_INLINE F e4m3_value(U code) {
  const F m = (F)((code & 0x7Fu) << 20) * 0x1p120f;
  const U v = (U)m | ((code & 0x80u) << 24);
  return (F)vec::select((code & 0x7Fu) == 0x7Fu, U{} + 0x7FC00000u, v);
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

// E4M3 scale codes of blocks from their amax keys (|x| bits), and the factors of their elements
// (fmin(1 / (float(s_b) * S_dec), FLT_MAX): NaN and inf give FLT_MAX).
template <typename F, typename U>
ENGINE_VEC_INLINE U block_code(U key, const TensorScale& ts) {
  return e4m3_code<F, U>((F)key * ts.mult);
}

template <typename F, typename U>
ENGINE_VEC_INLINE F block_encode(U code, const TensorScale& ts) {
  const F e = 1.0f / (e4m3_value<F, U>(code) * ts.s_dec);
  const F flt_max = F{} + kFltMax;
  return vec::select(e < kFltMax, e, flt_max);
}

// Codes and factors of n block keys (n a multiple of 16), in place of the keys.
inline void block_scales(uint32_t* __restrict keys, float* __restrict enc, int64_t n, const TensorScale& ts) {
  for (int64_t i = 0; i < n; i += kN) {
    const u32n code = block_code<f32n, u32n>(vec::load<u32n>(keys + i), ts);
    vec::store(keys + i, code);
    vec::store(enc + i, block_encode<f32n, u32n>(code, ts));
  }
}

// ------------------------------------------------------------------------------ outputs
// Outputs of at least this many bytes are written around the caches (vec::store_stream) where whole 64-byte lines
// leave at once (a tile's 64 bytes of each row; a band's 64 bytes of each column): they will not stay cached
// anyway, and stream stores skip reading each line first (4096x4096 bf16, both usages, 1 thread CPU time, medians
// of 3 processes: avx512 16.6 -> 13.4 ms, avx2 16.5 -> 16.0 ms).
constexpr int64_t kStreamBytes = int64_t{1} << 22;

// Whether lines at p + i * ld (p + multiples of 64 along them) can be streamed: 16-byte aligned, large.
inline bool streamable(const uint8_t* p, int64_t ld, int64_t rows) {
  return p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 == 0 && ld % 16 == 0 && ld * rows >= kStreamBytes;
}

// ------------------------------------------------------------------------------ tiles
template <bool BF16>
inline float load(const void* x, int64_t i) {
  if (BF16) {
    const uint32_t u = static_cast<uint32_t>(static_cast<const uint16_t*>(x)[i]) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  return static_cast<const float*>(x)[i];
}

struct TileBox {
  int64_t r0, rows, c0, w;
};

inline TileBox box_of(const Nvfp4Job& job, int64_t strip, int64_t col_tile) {
  const int64_t r0 = strip * kB, c0 = col_tile * kT;
  return {r0, (r0 + kB < job.M ? r0 + kB : job.M) - r0, c0, (c0 + kT < job.K ? c0 + kT : job.K) - c0};
}

// Tile u of the row-major grid ceil(M/16) x ceil(K/kT).
inline TileBox tile_box(const Nvfp4Job& job, int64_t u) {
  const int64_t col_tiles = (job.K + kT - 1) / kT;
  return box_of(job, u / col_tiles, u % col_tiles);
}

// Tiles ahead of the one being loaded whose rows load_tile asks the caches for: the 16 rows of a tile are 16
// separate streams of 256 (bf16) or 512 bytes, more than the hardware prefetchers follow ahead of the loads.
constexpr int64_t kPrefetchTiles = 2;

// x[r0 + i, c0 + c] as fp32 into t[i][c], zero-padded to 16 x kT (zeros change no amax and get code 0). Returns
// the max |value| bits of the tile (above 0x7F800000: a NaN in it; all ones for a partial tile), so that the
// element loops can leave out the NaN lanes' masking where there is none. Full tiles convert kN lanes at a time
// and prefetch the rows of the tile kPrefetchTiles ahead along them.
template <bool BF16>
inline uint32_t load_tile(const Nvfp4Job& job, const TileBox& b, float (*__restrict t)[kT]) {
  if (b.w == kT) {
    constexpr int64_t kEsize = BF16 ? 2 : 4;
    u32n m = {};
    for (int64_t i = 0; i < kB; ++i) {
      if (i >= b.rows) {
        for (int64_t c = 0; c < kT; ++c) t[i][c] = 0.0f;
        continue;
      }
      const char* row = static_cast<const char*>(job.x) + ((b.r0 + i) * job.ld + b.c0) * kEsize;
#pragma GCC unroll 8
      for (int64_t o = 0; o < kT * kEsize; o += 64) __builtin_prefetch(row + kPrefetchTiles * kT * kEsize + o);
#pragma GCC unroll 8
      for (int64_t c = 0; c < kT; c += kN) {
        u32n v;
        if (BF16) {
          v = vec::widen_u16(row + c * 2) << 16;
        } else {
          v = vec::load<u32n>(row + c * 4);
        }
        m = vec::max(m, v & 0x7FFFFFFFu);
        vec::store(t[i] + c, v);
      }
    }
    return vec::reduce_max(m);
  }
  for (int64_t i = 0; i < kB; ++i) {
    if (i < b.rows) {
      const int64_t base = (b.r0 + i) * job.ld + b.c0;
      for (int64_t c = 0; c < b.w; ++c) t[i][c] = load<BF16>(job.x, base + c);
      for (int64_t c = b.w; c < kT; ++c) t[i][c] = 0.0f;
    } else {
      for (int64_t c = 0; c < kT; ++c) t[i][c] = 0.0f;
    }
  }
  return 0xFFFFFFFFu;  // (not looked at: taken as holding NaNs)
}

// Max |value| bits over 16 rows x `cols` of t (16 at a time).
inline uint32_t tile_key(const float (*__restrict t)[kT], int64_t c0 = 0, int64_t cols = kT) {
  u32n m = {};
  for (int64_t i = 0; i < kB; ++i) {
    for (int64_t c = c0; c < c0 + cols; c += kN) m = vec::max(m, vec::load<u32n>(t[i] + c) & 0x7FFFFFFFu);
  }
  return vec::reduce_max(m);
}

// Max |x| bits over rows [r0, r1) x cols [c0, c0 + w) of x, read in place (no fp32 tile): |bf16| bits order
// as |fp32| bits do.
template <bool BF16>
inline uint32_t source_key(const Nvfp4Job& job, int64_t r0, int64_t r1, int64_t c0, int64_t w) {
  uint32_t key = 0;
  if (BF16) {  // |bf16| bits are below 0x8000: a signed 16-bit max (SSE2 has it) orders them
    constexpr int kH = 2 * kN;  // 16-bit lanes per vector
    const int16_t* x = static_cast<const int16_t*>(job.x);
    i16n m0 = {}, m1 = {};
    for (int64_t r = r0; r < r1; ++r) {
      const int16_t* row = x + r * job.ld + c0;
      int64_t c = 0;
      for (; c + 2 * kH <= w; c += 2 * kH) {
        m0 = vec::max(m0, vec::load<i16n>(row + c) & static_cast<int16_t>(0x7FFF));
        m1 = vec::max(m1, vec::load<i16n>(row + c + kH) & static_cast<int16_t>(0x7FFF));
      }
      for (; c < w; ++c) {
        const uint32_t k = static_cast<uint32_t>(row[c] & 0x7FFF) << 16;
        key = key > k ? key : k;
      }
    }
    const uint32_t k = static_cast<uint32_t>(vec::reduce_max(vec::max(m0, m1))) << 16;
    key = key > k ? key : k;
  } else {
    const float* x = static_cast<const float*>(job.x);
    u32n m = {};
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = x + r * job.ld + c0;
      int64_t c = 0;
      for (; c + kN <= w; c += kN) m = vec::max(m, vec::load<u32n>(row + c) & 0x7FFFFFFFu);
      for (; c < w; ++c) {
        uint32_t k;
        std::memcpy(&k, row + c, 4);
        k &= 0x7FFFFFFFu;
        key = key > k ? key : k;
      }
    }
    const uint32_t k = vec::reduce_max(m);
    key = key > k ? key : k;
  }
  return key;
}

// Raises m (lane-wise |RHT output| bits before the bf16 rounding, which is monotonic: the caller rounds the max)
// with the columns of tile t. A group of 16 columns whose bound (hadamard::abs_bound) is below the max so far
// cannot raise the tensor's max: its transform is skipped (inf and NaN give no bound).
inline u32n rht_tile_max(const float (*__restrict t)[kT], u32n m) {
  for (int64_t c = 0; c < kT; c += kN) {
    f32n v[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) v[i] = vec::load<f32n>(t[i] + c);
    if (vec::reduce_max(vec::bits<u32n>(hadamard::abs_bound(v))) < vec::reduce_max(m)) continue;
    hadamard::rht16(v);
#pragma GCC unroll 16
    for (int k = 0; k < 16; ++k) m = vec::max(m, vec::bits<u32n>(v[k]) & 0x7FFFFFFFu);
  }
  return m;
}

template <bool BF16>
void amax_tiles(const Nvfp4Job& job, int64_t u0, int64_t u1, uint32_t* x_key, uint32_t* rht_key) {
  alignas(64) float t[kB][kT];
  uint32_t xk = 0;
  u32n ym = {};
  for (int64_t u = u0; u < u1; ++u) {
    const TileBox b = tile_box(job, u);
    if (rht_key) {  // x's amax too (when asked) from the same tile: x read once
      load_tile<BF16>(job, b, t);
      ym = rht_tile_max(t, ym);
      if (x_key) {
        const uint32_t k = tile_key(t);
        xk = xk > k ? xk : k;
      }
    } else if (x_key) {
      const uint32_t k = source_key<BF16>(job, b.r0, b.r0 + b.rows, b.c0, b.w);
      xk = xk > k ? xk : k;
    }
  }
  if (x_key) *x_key = xk;
  if (rht_key) {  // the bf16 rounding of the max (hadamard::bf16_round: a NaN is the canonical one)
    const uint32_t k = vec::reduce_max(ym);
    *rht_key = k > 0x7F800000u ? 0x7FC00000u : (k + 0x7FFFu + ((k >> 16) & 1u)) & 0xFFFF0000u;
  }
}

// n codes (n even, each below 16) -> n / 2 bytes, element 2i in the low nibble of byte i. A plain loop: GCC
// vectorises it with the level's pack instructions (a narrowing vector conversion would be split lane by lane).
#if ENGINE_VEC_NARROW_SAT_BY_HALVES
// AVX2 (where GCC vectorises the plain loop with a vpermd per 4 codes): 64 codes at a time through two saturating
// narrowings of 4 vectors each (vec::narrow_sat, by 128-bit halves: byte 16h + 4i + l holds code 8i + 4h + l of
// its 32), a code pair (e, e + 1) then in adjacent bytes, read as one 16-bit lane e | (e + 1) << 8 whose low byte
// after | >> 4 is the packed byte, and one byte shuffle from those low bytes to the packed order: the pair
// 16s + 4i + 2h + l2 (s: which narrowing) sits in the 16-bit lane 8h + 2i + l2 of narrowing s.
// (4096x4096 bf16, rowwise alone with the amax given, 1 thread CPU time, medians of 3 processes: 8.9 -> 7.4 ms.)
template <int... P>
ENGINE_VEC_INLINE vec::u8n pack_pairs(vec::u16n a, vec::u16n b, std::integer_sequence<int, P...>) {
  return __builtin_shufflevector(vec::bits<vec::u8n>(a), vec::bits<vec::u8n>(b),
                                 (2 * (16 * (P >> 4) + 8 * ((P >> 1) & 1) + 2 * ((P >> 2) & 3) + (P & 1)))...);
}

ENGINE_VEC_INLINE void pack_codes(const uint32_t* __restrict codes, uint8_t* __restrict out, int64_t n) {
  static_assert(kN == 8, "the AVX2 form");
  for (int64_t i = 0; i < n; i += 64) {
    const uint32_t* c = codes + i;
    const vec::u16n a = vec::bits<vec::u16n>(vec::narrow_sat(vec::load<u32n>(c), vec::load<u32n>(c + 8),
                                                             vec::load<u32n>(c + 16), vec::load<u32n>(c + 24)));
    const vec::u16n b = vec::bits<vec::u16n>(vec::narrow_sat(vec::load<u32n>(c + 32), vec::load<u32n>(c + 40),
                                                             vec::load<u32n>(c + 48), vec::load<u32n>(c + 56)));
    vec::store(out + i / 2, pack_pairs(a | (a >> 4), b | (b >> 4), std::make_integer_sequence<int, 32>{}));
  }
}
#else
ENGINE_VEC_INLINE void pack_codes(const uint32_t* __restrict codes, uint8_t* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n / 2; ++i) out[i] = static_cast<uint8_t>(codes[2 * i] | (codes[2 * i + 1] << 4));
}
#endif

// One level of block_maxima's tree: a and b hold blocks of L lanes each (a's first); the result the maxima of
// each block's two halves, L / 2 lanes per block, the blocks in order.
constexpr int half_lane(int L, int i) { return (i / (L / 2)) * L + i % (L / 2); }

template <int L, int... I>
ENGINE_VEC_INLINE u32n halve_blocks(u32n a, u32n b, std::integer_sequence<int, I...>) {
  return vec::max(__builtin_shufflevector(a, b, half_lane(L, I)...),
                  __builtin_shufflevector(a, b, (half_lane(L, I) + L / 2)...));
}

// The level with L lanes per block: a[0..L) -> a[0..L/2) (L vectors hold L blocks of L lanes).
template <int L>
ENGINE_VEC_INLINE void halve_level(u32n* a) {
  if constexpr (L >= 2 && L <= kN) {
#pragma GCC unroll 16
    for (int j = 0; j < L / 2; ++j) a[j] = halve_blocks<L>(a[2 * j], a[2 * j + 1], std::make_integer_sequence<int, kN>{});
  }
}

// Max |value| bits of each of the 16 consecutive blocks of 16 values at v, into keys[0..15]: kN blocks at a time,
// each block's values max'd to one vector, then a tree of lane shuffles (each level halves the lanes per block
// and doubles the blocks per vector) leaves lane j with block j.
ENGINE_VEC_INLINE void block_maxima(const float* __restrict v, uint32_t* __restrict keys) {
#pragma GCC unroll 4
  for (int g = 0; g < 16; g += kN) {
    u32n a[kN];
#pragma GCC unroll 16
    for (int j = 0; j < kN; ++j) {
      const float* block = v + 16 * (g + j);
      u32n m = vec::load<u32n>(block) & 0x7FFFFFFFu;
#pragma GCC unroll 4
      for (int p = kN; p < 16; p += kN) m = vec::max(m, vec::load<u32n>(block + p) & 0x7FFFFFFFu);
      a[j] = m;
    }
    halve_level<16>(a);
    halve_level<8>(a);
    halve_level<4>(a);
    halve_level<2>(a);
    vec::store(keys + g, a[0]);
  }
}

// The keys (max |value| bits) a tile's usages need, from the one read of it that converts it into t: of each
// rowwise 1x16 block (row_keys[j * kB + i]: block j of row i) and of each column (col_keys[c], over the 16 rows).
// Returns the max over the tile (above 0x7F800000: a NaN in it; all ones for a partial tile). A full tile is read
// by block columns: the 16 rows' vectors of each are converted, stored, and max'd both ways while in registers
// (the rows' blocks by block_maxima's tree), so that neither usage reads t for its maxima (both usages, amaxes given,
// bf16, 1 thread CPU time per 4096^2 elements from an L2-resident 256x1024 input, best of 200: avx512 10.12 -> 9.71
// ms, avx2 11.68 -> 11.00 ms, with vec::widen_u16).
template <bool BF16>
inline uint32_t load_tile_keys(const Nvfp4Job& job, const TileBox& b, float (*__restrict t)[kT],
                               uint32_t* __restrict row_keys, uint32_t* __restrict col_keys) {
  constexpr int64_t kBlocks = kT / kB;
  if (b.w != kT || b.rows != kB) {  // an edge tile: zero padded, then its keys from t
    load_tile<BF16>(job, b, t);
    alignas(64) uint32_t keys[kB * kBlocks];  // [row][block]
    for (int64_t n = 0; n < kB * kBlocks; n += 16) block_maxima(&t[0][0] + n * kB, keys + n);
    for (int64_t i = 0; i < kB; ++i) {
      for (int64_t j = 0; j < kBlocks; ++j) row_keys[j * kB + i] = keys[i * kBlocks + j];
    }
    for (int64_t c = 0; c < kT; c += kN) {
      u32n m = {};
      for (int64_t k = 0; k < kB; ++k) m = vec::max(m, vec::load<u32n>(t[k] + c) & 0x7FFFFFFFu);
      vec::store(col_keys + c, m);
    }
    return 0xFFFFFFFFu;  // (not looked at: taken as holding NaNs)
  }
  constexpr int64_t kEsize = BF16 ? 2 : 4;
  const char* rows[kB];
#pragma GCC unroll 16
  for (int64_t i = 0; i < kB; ++i) {
    rows[i] = static_cast<const char*>(job.x) + ((b.r0 + i) * job.ld + b.c0) * kEsize;
#pragma GCC unroll 8
    for (int64_t o = 0; o < kT * kEsize; o += 64) __builtin_prefetch(rows[i] + kPrefetchTiles * kT * kEsize + o);
  }
  u32n all = {};
  for (int64_t j = 0; j < kBlocks; ++j) {
    u32n cm[kB / kN] = {};  // the block column's kB / kN column vectors
#pragma GCC unroll 4
    for (int64_t g = 0; g < kB; g += kN) {
      u32n a[kN];  // rows g .. g + kN - 1 of block j, each max'd to one vector
#pragma GCC unroll 16
      for (int64_t r = 0; r < kN; ++r) {
#pragma GCC unroll 4
        for (int64_t p = 0; p < kB / kN; ++p) {
          const int64_t c = j * kB + p * kN;
          u32n v;
          if (BF16) {
            v = vec::widen_u16(rows[g + r] + c * 2) << 16;
          } else {
            v = vec::load<u32n>(rows[g + r] + c * 4);
          }
          vec::store(t[g + r] + c, v);
          const u32n m = v & 0x7FFFFFFFu;
          cm[p] = vec::max(cm[p], m);
          a[r] = p == 0 ? m : vec::max(a[r], m);
        }
      }
      halve_level<16>(a);
      halve_level<8>(a);
      halve_level<4>(a);
      halve_level<2>(a);
      vec::store(row_keys + j * kB + g, a[0]);
    }
#pragma GCC unroll 4
    for (int64_t p = 0; p < kB / kN; ++p) {
      vec::store(col_keys + j * kB + p * kN, cm[p]);
      all = vec::max(all, cm[p]);
    }
  }
  return vec::reduce_max(all);
}

// The rowwise usage of a tile: 1x16 blocks of each row, of keys row_keys (load_tile_keys' layout), or the 16x16
// tiles' codes when 2D.
template <bool SR, bool NANS>
void rowwise_tile(const Nvfp4Job& job, const TileBox& b, const float (*__restrict t)[kT],
                  const uint32_t* __restrict row_keys, const uint32_t* __restrict tile_keys, uint32_t rkey,
                  bool stream) {
  constexpr int64_t kBlocks = kT / kB;
  const TensorScale ts = tensor_scale(job.row_amax);
  const int64_t K = job.K, nbk = (K + kB - 1) / kB, kp = (K + 1) / 2, blocks = (b.w + kB - 1) / kB;
  uint8_t* const row_scales = job.row_scales;
  uint8_t* const row_data = job.row_data;
  const uint64_t row_offset = job.row_offset;
  const bool two_d = job.two_d;
  alignas(64) uint32_t codes[kB * kBlocks];  // [block][row], or [block] for 2D
  alignas(64) float enc[kB * kBlocks];
  alignas(64) uint8_t packed[kT / 2];
  if (two_d) {
    for (int64_t j = 0; j < kBlocks; ++j) codes[j] = tile_keys[j];
    for (int64_t j = kBlocks; j < 16; ++j) codes[j] = 0;
    block_scales(codes, enc, 16, ts);
  } else {
    for (int64_t n = 0; n < kB * kBlocks; n += kN) vec::store(codes + n, vec::load<u32n>(row_keys + n));
    block_scales(codes, enc, kB * kBlocks, ts);
  }
  const u32n iota = vec::iota<u32n>();
  alignas(64) uint32_t q[kT];  // one row's element codes
  for (int64_t i = 0; i < b.rows; ++i) {
    const int64_t r = b.r0 + i, at = two_d ? 0 : i, bs = two_d ? 1 : kB;  // block j's code: at + j * bs
    uint8_t* scales = row_scales + r * nbk + b.c0 / kB;
    for (int64_t j = 0; j < blocks; ++j) scales[j] = static_cast<uint8_t>(codes[at + j * bs]);
    const uint64_t base = row_offset + static_cast<uint64_t>(r) * static_cast<uint64_t>(K) +
                          static_cast<uint64_t>(b.c0);
    if (SR && (base & 3u) == 0) {  // each word's mix serves its 4 indices: one mix per 4 elements
      for (int64_t g = 0; g < kT; g += 4 * kN) {
        const uint64_t w0 = (base + static_cast<uint64_t>(g)) >> 2;
        const uint32_t lo_first = static_cast<uint32_t>(w0), hi_first = static_cast<uint32_t>(w0 >> 32);
        const u32n lo0 = vec::splat<u32n>(lo_first), lo = lo0 + iota;  // words w0 .. w0 + kN - 1
        const u32n hk = lo_first <= 0xFFFFFFFFu - kN ? vec::splat<u32n>(hi_key(hi_first, rkey))  // no carry into hi
                                                     : hi_key(hi_first + ((u32n)(lo < lo0) & 1u), rkey);
        // The mixes' bytes, in memory order, are the random bytes of the 4 kN elements in order (little endian:
        // byte j & 3 of word j >> 2): each vector's kN bytes widened by one load (no lane shuffles).
        alignas(64) uint8_t bytes[4 * kN + 16];  // (+16: widen_bytes reads 16 bytes)
        vec::store(bytes, word_mix(lo, hk));
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) {
          const int64_t e0 = g + k * kN;
          const f32n v = vec::load<f32n>(t[i] + e0) * enc[at + e0 / kB * bs];
          const u32n r = vec::widen_bytes(bytes + k * kN);
          vec::store(q + e0, e2m1_stochastic<f32n, u32n, i32n, NANS>(v, r));
        }
      }
    } else {
    for (int64_t j = 0; j < kBlocks; ++j) {
      const float e = enc[at + j * bs];
#pragma GCC unroll 4
      for (int64_t p = 0; p < kB; p += kN) {
        const f32n v = vec::load<f32n>(t[i] + j * kB + p) * e;
        u32n c;
        if (SR) {
          const uint64_t first = base + static_cast<uint64_t>(j * kB + p), w0 = first >> 2;
          const u32n rel = vec::splat<u32n>(static_cast<uint32_t>(first & 3u)) + iota;  // lane l: index - 4 * w0
          const uint32_t lo_first = static_cast<uint32_t>(w0), hi_first = static_cast<uint32_t>(w0 >> 32);
          const u32n lo0 = vec::splat<u32n>(lo_first);
          const u32n lo = lo0 + (rel >> 2u);
          const u32n hk = lo_first <= 0xFFFFFFFFu - 4u ? vec::splat<u32n>(hi_key(hi_first, rkey))  // no carry into hi
                                                       : hi_key(hi_first + ((u32n)(lo < lo0) & 1u), rkey);
          c = e2m1_stochastic<f32n, u32n, i32n, NANS>(v, random_byte(word_mix(lo, hk), rel & 3u));
        } else {
          c = e2m1_rne<f32n, u32n, i32n, NANS>(v);
        }
        vec::store(q + j * kB + p, c);
      }
    }
    }
    pack_codes(q, packed, kT);
    if (stream && b.w == kT) {
      vec::store_stream(row_data + r * kp + b.c0 / 2, vec::load<vec::u8x64>(packed));
    } else if (b.w == kT) {
      std::memcpy(row_data + r * kp + b.c0 / 2, packed, kT / 2);
    } else {
      std::memcpy(row_data + r * kp + b.c0 / 2, packed, static_cast<size_t>((b.w + 1) / 2));
    }
  }
}

// The columnwise outputs of the band of kNvfp4BandStrips strips in progress: per column and strip, 8 bytes of
// packed data (16 rows) and one scale. Flushed when the tiles move to the next band (or the thread's range ends):
// a column tile with all the band's strips leaves as one 64-byte line of data and one 8-byte run of scales per
// column (instead of 8 bytes and 1 byte per strip: each line of the column-major outputs written whole, once);
// strips missing from it (a thread's range starting or ending inside the band) are written one by one.
struct Band {
  int64_t first = -1;  // the band's first strip (-1: none)
  // Strip strides of `lines` (words) and `scales` (bytes): a cache line more than the columns (rounded up to
  // whole tiles), so that the 8 strips' entries of a column, read together by the flush, fall in different L1
  // sets (a power-of-2 stride would put them all in one).
  int64_t line_ld = 0, scale_ld = 0, col_tiles = 0;
  uint64_t* lines = nullptr;    // [strip][column]; read only where `filled`
  uint8_t* scales = nullptr;    // [strip][column]; read only where `filled`
  uint32_t* filled = nullptr;   // [column tile]: bit k set when strip k of the band is held
  void* store = nullptr;        // the allocation of the three (malloc: no C++ library code in a kernel source)

  explicit Band(const Nvfp4Job& job) {
    if (!job.col_data) return;
    col_tiles = (job.K + kT - 1) / kT;
    line_ld = col_tiles * kT + 8;
    scale_ld = col_tiles * kT + 64;
    const size_t line_bytes = static_cast<size_t>(line_ld * kNvfp4BandStrips) * 8;
    const size_t scale_bytes = static_cast<size_t>(scale_ld * kNvfp4BandStrips);
    store = std::malloc(line_bytes + scale_bytes + static_cast<size_t>(col_tiles) * 4 + 64);
    if (store == nullptr) return;  // quantize_tiles then writes every strip directly
    char* p = static_cast<char*>(store);
    p += (64 - (reinterpret_cast<uintptr_t>(p) & 63)) & 63;
    lines = reinterpret_cast<uint64_t*>(p);
    scales = reinterpret_cast<uint8_t*>(p + line_bytes);
    filled = reinterpret_cast<uint32_t*>(p + line_bytes + scale_bytes);
    for (int64_t t = 0; t < col_tiles; ++t) filled[t] = 0;
  }
  ~Band() { std::free(store); }
  Band(const Band&) = delete;
  Band& operator=(const Band&) = delete;

  void flush(const Nvfp4Job& job, bool stream) {
    if (first < 0) return;
    const int64_t M = job.M, mp = (M + 1) / 2, nbm = (M + kB - 1) / kB;
    const int64_t h = nbm - first < kNvfp4BandStrips ? nbm - first : kNvfp4BandStrips;
    const bool full_band = h == kNvfp4BandStrips && (first + h) * kB <= M;  // 8 strips of 16 rows
    for (int64_t ct = 0; ct < col_tiles; ++ct) {
      const uint32_t f = filled[ct];
      if (f == 0) continue;
      filled[ct] = 0;
      const TileBox b = box_of(job, first, ct);
      uint8_t* data = job.col_data + b.c0 * mp + first * (kB / 2);
      uint8_t* sc = job.col_scales + b.c0 * nbm + first;
      if (full_band && f == (1u << kNvfp4BandStrips) - 1) {
        for (int64_t c = 0; c < b.w; ++c) {
          uint64_t line[kNvfp4BandStrips];
          uint8_t run[kNvfp4BandStrips];
#pragma GCC unroll 8
          for (int k = 0; k < kNvfp4BandStrips; ++k) {
            line[k] = lines[k * line_ld + b.c0 + c];
            run[k] = scales[k * scale_ld + b.c0 + c];
          }
          if (stream) {
            vec::store_stream(data + c * mp, vec::load<vec::u8x64>(line));
          } else {
            std::memcpy(data + c * mp, line, sizeof line);
          }
          std::memcpy(sc + c * nbm, run, kNvfp4BandStrips);
        }
        continue;
      }
      for (int64_t k = 0; k < h; ++k) {
        if (!(f >> k & 1)) continue;
        const int64_t r0 = (first + k) * kB, rows = r0 + kB < M ? kB : M - r0;
        const size_t bytes = static_cast<size_t>((rows + 1) / 2);
        for (int64_t c = 0; c < b.w; ++c) {
          std::memcpy(data + c * mp + k * (kB / 2), lines + k * line_ld + b.c0 + c, bytes);
          sc[c * nbm + k] = scales[k * scale_ld + b.c0 + c];
        }
      }
    }
    first = -1;
  }
};

// The columnwise usage of a tile: the 16x1 blocks of its columns, of `src` (x, or the RHT output), kN columns at
// a time, each column's 16 codes gathered into a 64-bit word (element 2i in the low nibble of byte i): into the
// band buffer (its strip of the tile's b.r0) when `band` is set, else straight to the outputs.
template <bool SR, bool NANS>
void columnwise_tile(const Nvfp4Job& job, const TileBox& b, const float (*__restrict src)[kT],
                     const uint32_t* __restrict col_keys, const uint32_t* __restrict tile_keys, uint32_t rkey,
                     Band* band) {
  const TensorScale ts = tensor_scale(job.col_amax);
  const int64_t M = job.M, nbm = (M + kB - 1) / kB, mp = (M + 1) / 2;
  uint8_t* const col_scales = job.col_scales;
  const uint64_t col_offset = job.col_offset;
  const size_t bytes = static_cast<size_t>((b.rows + 1) / 2);
  const int64_t block_row = b.r0 / kB;
  alignas(64) uint32_t codes[kT];
  alignas(64) float enc[kT];
  if (job.two_d) {
    alignas(64) uint32_t tc[16] = {};
    alignas(64) float te[16];
    for (int64_t j = 0; j < kT / kB; ++j) tc[j] = tile_keys[j];
    block_scales(tc, te, 16, ts);
    for (int64_t c = 0; c < kT; ++c) {
      codes[c] = tc[c / kB];
      enc[c] = te[c / kB];
    }
  } else {
    for (int64_t c = 0; c < kT; c += kN) vec::store(codes + c, vec::load<u32n>(col_keys + c));
    block_scales(codes, enc, kT, ts);
  }
  const int64_t strip = block_row - (band ? band->first : 0);  // the strip within the band
  if (band) {
    uint8_t* __restrict dst = band->scales + strip * band->scale_ld + b.c0;
    for (int64_t c = 0; c < kT; ++c) dst[c] = static_cast<uint8_t>(codes[c]);  // vectorised by GCC
    band->filled[b.c0 / kT] |= 1u << strip;
  } else {
    for (int64_t c = 0; c < b.w; ++c) col_scales[(b.c0 + c) * nbm + block_row] = static_cast<uint8_t>(codes[c]);
  }
  uint8_t* out = job.col_data + b.c0 * mp + b.r0 / 2;
  // Every column's first index a multiple of 4 (b.r0 is): rows 4m .. 4m + 3 share a word, so one mix per 4 rows.
  const bool aligned = M % 4 == 0 && col_offset % 4 == 0;
  // Then column l's first word is that of column 0 plus l * M / 4: the kN columns' counters in vector lanes, where
  // the words of the kN columns span less than 2^32 (at most one carry into the high half): no per-lane scalar
  // 64-bit arithmetic.
  const bool lane_counters = aligned && static_cast<uint64_t>(M / 4) * static_cast<uint64_t>(kN - 1) < (uint64_t{1} << 32);
  const u32n word_steps = vec::iota<u32n>() * static_cast<uint32_t>(M / 4);
  for (int64_t c = 0; c < b.w; c += kN) {
    const f32n e = vec::load<f32n>(enc + c);
    u32n lo0, hk0, hk1, at;  // the column's first index j0: its word's low half, the hi keys of its high half and
                             // of one more, and j0 & 3
    if (SR && lane_counters) {
      const uint64_t w0 = (col_offset + static_cast<uint64_t>(b.c0 + c) * static_cast<uint64_t>(M) +
                           static_cast<uint64_t>(b.r0)) >> 2;
      const u32n lo_first = vec::splat<u32n>(static_cast<uint32_t>(w0));
      lo0 = lo_first + word_steps;
      at = u32n{};
      const u32n hi0 = vec::splat<u32n>(static_cast<uint32_t>(w0 >> 32)) + ((u32n)(lo0 < lo_first) & 1u);
      hk0 = hi_key(hi0, rkey);
      hk1 = hi_key(hi0 + 1u, rkey);
    } else if (SR) {
      alignas(64) uint32_t lo_l[kN], hi_l[kN], at_l[kN];
      for (int l = 0; l < kN; ++l) {
        const uint64_t first = col_offset + static_cast<uint64_t>(b.c0 + c + l) * static_cast<uint64_t>(M) +
                               static_cast<uint64_t>(b.r0);
        lo_l[l] = static_cast<uint32_t>(first >> 2);
        hi_l[l] = static_cast<uint32_t>(first >> 34);
        at_l[l] = static_cast<uint32_t>(first & 3u);
      }
      lo0 = vec::load<u32n>(lo_l);
      at = vec::load<u32n>(at_l);
      const u32n hi0 = vec::load<u32n>(hi_l);
      hk0 = hi_key(hi0, rkey);
      hk1 = hi_key(hi0 + 1u, rkey);
    }
    u32n words[2] = {};  // elements 0..7 and 8..15 of each column, 4 bits each
    if (SR && aligned) {
#pragma GCC unroll 4
      for (int m = 0; m < kB / 4; ++m) {
        const u32n lo = lo0 + static_cast<uint32_t>(m);
        const u32n mix = word_mix(lo, vec::select(lo < lo0, hk1, hk0));
#pragma GCC unroll 4
        for (int k = 4 * m; k < 4 * m + 4; ++k) {
          const f32n v = vec::load<f32n>(src[k] + c) * e;
          const u32n q = e2m1_stochastic<f32n, u32n, i32n, NANS>(v, (mix >> static_cast<uint32_t>(8 * (k & 3))) & 0xFFu);
          words[k >> 3] |= q << static_cast<uint32_t>(4 * (k & 7));
        }
      }
    } else {
#pragma GCC unroll 16
    for (int k = 0; k < kB; ++k) {
      const f32n v = vec::load<f32n>(src[k] + c) * e;
      u32n q;
      if (SR) {
        const u32n rel = at + static_cast<uint32_t>(k), lo = lo0 + (rel >> 2u);
        q = e2m1_stochastic<f32n, u32n, i32n, NANS>(v, random_byte(word_mix(lo, vec::select(lo < lo0, hk1, hk0)), rel & 3u));
      } else {
        q = e2m1_rne<f32n, u32n, i32n, NANS>(v);
      }
      words[k >> 3] |= q << static_cast<uint32_t>(4 * (k & 7));
    }
    }
    alignas(64) uint64_t column_words[kN];  // column l: rows 0..7 in the low half, 8..15 in the high half
    vec::store(column_words, interleave_lo(words[0], words[1]));
    vec::store(column_words + kN / 2, interleave_hi(words[0], words[1]));
    if (band) {
      std::memcpy(band->lines + strip * band->line_ld + b.c0 + c, column_words, sizeof column_words);
      continue;
    }
    const int64_t n = b.w - c < kN ? b.w - c : kN;
    if (bytes == 8) {  // little endian: byte i holds elements 2i, 2i + 1
      for (int64_t l = 0; l < n; ++l) std::memcpy(out + (c + l) * mp, column_words + l, 8);
    } else {
      for (int64_t l = 0; l < n; ++l) std::memcpy(out + (c + l) * mp, column_words + l, bytes);
    }
  }
}

// The asked usages of one tile, through the fp32 tile t (and y, for the RHT): any job, any tile.
template <bool BF16, bool SR>
void quantize_tile(const Nvfp4Job& job, const TileBox& b, float (*__restrict t)[kT], float (*__restrict y)[kT],
                   uint32_t rkey, Band* band, bool stream_rows) {
  alignas(64) uint32_t tile_keys[kT / kB];
  alignas(64) uint32_t row_keys[kT];  // (kB rows x kT / kB blocks)
  alignas(64) uint32_t col_keys[kT];
  alignas(64) uint32_t y_keys[kT];
  const uint32_t key = load_tile_keys<BF16>(job, b, t, row_keys, col_keys);
  if (job.two_d) {  // a 16x16 tile's max: its 16 columns'
    for (int64_t j = 0; j < kT / kB; ++j) {
      u32n m = vec::load<u32n>(col_keys + j * kB);
#pragma GCC unroll 4
      for (int64_t p = kN; p < kB; p += kN) m = vec::max(m, vec::load<u32n>(col_keys + j * kB + p));
      tile_keys[j] = vec::reduce_max(m);
    }
  }
  // A product x * enc_b (enc_b finite) is NaN only where x is; the RHT's sums of 16 x_i / 4 stay below FLT_MAX
  // (no inf - inf) while every |x_i| < 2^125.
  const bool x_nans = key > 0x7F800000u, y_nans = job.rht ? key >= 0x7E000000u : x_nans;
  if (job.row_data) {
    if (x_nans) {
      rowwise_tile<SR, true>(job, b, t, row_keys, tile_keys, rkey, stream_rows);
    } else {
      rowwise_tile<SR, false>(job, b, t, row_keys, tile_keys, rkey, stream_rows);
    }
  }
  if (job.col_data) {
    if (job.rht) hadamard::rht_rows_keys(&t[0][0], &y[0][0], kT, kT, y_keys);
    const uint32_t* keys = job.rht ? y_keys : col_keys;
    if (y_nans) {
      columnwise_tile<SR, true>(job, b, job.rht ? y : t, keys, tile_keys, rkey, band);
    } else {
      columnwise_tile<SR, false>(job, b, job.rht ? y : t, keys, tile_keys, rkey, band);
    }
  }
}

template <bool BF16, bool SR>
void quantize_tiles(const Nvfp4Job& job, int64_t u0, int64_t u1) {
  alignas(64) float t[kB][kT];
  alignas(64) float y[kB][kT];
  const uint32_t rkey = seed_key(job.seed);
  Band band(job);
  const bool banded = job.col_data && band.lines;
  const int64_t kp = (job.K + 1) / 2, mp = (job.M + 1) / 2;
  const bool stream_rows = streamable(job.row_data, kp, job.M), stream_cols = streamable(job.col_data, mp, job.K);
  for (int64_t u = u0; u < u1; ++u) {
    const TileBox b = tile_box(job, u);
    const int64_t strip = b.r0 / kB, first = strip - strip % kNvfp4BandStrips;
    if (banded && first != band.first) {
      band.flush(job, stream_cols);
      band.first = first;
    }
    quantize_tile<BF16, SR>(job, b, t, y, rkey, banded ? &band : nullptr, stream_rows);
  }
  if (banded) band.flush(job, stream_cols);
  if (stream_rows || stream_cols) vec::stream_fence();
}

#include "cast/nvfp4_4over6_kernels.h"  // 4over6 (quantize_tiles_46), in these namespaces

void amax_entry(const Nvfp4Job& job, int64_t u0, int64_t u1, uint32_t* x_key, uint32_t* rht_key) {
  if (job.bf16) return amax_tiles<true>(job, u0, u1, x_key, rht_key);
  return amax_tiles<false>(job, u0, u1, x_key, rht_key);
}

void quantize_entry(const Nvfp4Job& job, int64_t u0, int64_t u1) {
  if (job.four_over_six) return job.bf16 ? quantize_tiles_46<true>(job, u0, u1) : quantize_tiles_46<false>(job, u0, u1);
  if (job.bf16) return job.sr ? quantize_tiles<true, true>(job, u0, u1) : quantize_tiles<true, false>(job, u0, u1);
  return job.sr ? quantize_tiles<false, true>(job, u0, u1) : quantize_tiles<false, false>(job, u0, u1);
}

constexpr Nvfp4Kernels kKernels{&amax_entry, &quantize_entry};

}  // namespace

const Nvfp4Kernels& nvfp4_kernels() { return kKernels; }

}  // namespace ENGINE_ISA_NS
}  // namespace engine_native

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif
