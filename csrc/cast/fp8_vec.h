// The per-element rules of the FP8 cast kernels (fp8_kernels.cpp), branch-free so that the loops over
// them vectorise at every instruction-set level: the compiler widens bf16 / fp16 to fp32 lanes and narrows
// the 32-bit codes to bytes with each level's own instructions (GCC 12 lowers such width changes well in
// loops, poorly on generic vectors wider than the registers). They give the bits of fp8_scalar.h's
// reference rules: fp32_to_fp8, the exact input conversions, fp8_to_bf16_bits.
//
// Include only from a `*_kernels.cpp` (after isa_begin.h): everything is in the variant's namespace.
#pragma once

#ifndef ENGINE_ISA_NS
#error "cast/fp8_vec.h is for *_kernels.cpp sources (compiled per instruction set)"
#endif

#include "common/fp8_scalar.h"
#include "common/vec.h"

namespace engine_native {
namespace ENGINE_ISA_NS {
namespace fp8v {

// Hot helpers must be inlined into the loops that use them (the loops are what vectorises).
#define FP8_LANE inline __attribute__((always_inline))

// m ? a : b with masks (a `?:` on values of this width is sometimes kept as a branch, which stops the
// vectoriser: "control flow in loop").
FP8_LANE uint32_t pick(bool m, uint32_t a, uint32_t b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(m);
  return (a & mask) | (b & ~mask);
}

FP8_LANE uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
FP8_LANE float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ------------------------------------------------------------------------- fp32 -> FP8
// The FP8 code of p, saturating, ties to even, as fp32_to_fp8: NaN (any sign) -> 0x7F, +-inf -> +-max.
// With c = min(|p|, max) and E' = max(exponent field of c, kMinExpField) (the smallest normal's):
//   M = 2^(E' - 127 + 23 - kMant) + j ulp(M),  j = (E' - kMinExpField) << kMant   (M's bits below)
//   s = c + M      the fp32 add rounds c to a multiple of ulp(M) = the FP8 ulp at c, ties to even (j is
//                  even, so the tie parity is c's own)
//   code = the low 23 bits of s = j + round(c / ulp(M))
// The low bits count FP8 ulps from the binade's start and j adds the binade's exponent field, so FP8
// subnormals (E' = kMinExpField, j = 0) come out right and no fp32 subnormal is ever produced. M's bits are
// two shifts and adds of E' (no table). Needs round to nearest (the glue's DefaultFpEnv).
template <Fp8Kind K>
struct Fp8Lane {
  static constexpr uint32_t kMant = K == Fp8Kind::E4M3 ? 3 : 2;
  static constexpr uint32_t kMaxBits = K == Fp8Kind::E4M3 ? 0x43E00000u : 0x47600000u;  // 448, 57344
  static constexpr uint32_t kMinExpField = K == Fp8Kind::E4M3 ? 121 : 113;              // 2^(1 - bias)
};

template <Fp8Kind K>
FP8_LANE uint32_t fp8_code(float p) {
  using C = Fp8Lane<K>;
  const uint32_t u = bits_of(p);
  const uint32_t mag = u & 0x7FFFFFFFu;
  const uint32_t c = mag < C::kMaxBits ? mag : C::kMaxBits;  // integer order is |value| order; NaN: below
  uint32_t field = c >> 23;
  field = field < C::kMinExpField ? C::kMinExpField : field;
  const uint32_t m = ((field + 23u - C::kMant) << 23) + ((field - C::kMinExpField) << C::kMant);
  const uint32_t code = (bits_of(float_of(c) + float_of(m)) & 0x7FFFFFu) | ((u >> 24) & 0x80u);
  return pick(mag > 0x7F800000u, 0x7Fu, code);
}

// ---------------------------------------------------------------------------- inputs
// The raw element of an input type: fp32 bits, or the 16-bit word of bf16 / fp16.
template <InType T>
using raw_t = std::conditional_t<T == InType::F32, uint32_t, uint16_t>;

// |x| bits: ordered like the magnitudes, NaN above everything (the amax "key", in the input's width).
template <InType T>
FP8_LANE raw_t<T> key_of(raw_t<T> r) {
  return static_cast<raw_t<T>>(r & (T == InType::F32 ? 0x7FFFFFFFu : 0x7FFFu));
}

// IEEE half -> fp32, exact (f16_to_f32): normal and special values rebias the exponent field (+112, and
// +112 again for inf / NaN, keeping the payload), subnormals are their integer mantissa times 2^-24.
FP8_LANE float f16_value(uint16_t h) {
  const uint32_t w = h;
  const uint32_t em = w & 0x7FFFu;
  const uint32_t normal = (em << 13) + (112u << 23);
  const uint32_t special = normal + (112u << 23);
  const uint32_t sub = bits_of(static_cast<float>(static_cast<int32_t>(em)) * 5.9604644775390625e-08f);  // 2^-24
  const uint32_t r = pick(em >= 0x7C00u, special, pick(em < 0x400u, sub, normal));
  return float_of(r | ((w & 0x8000u) << 16));
}

template <InType T>
FP8_LANE float value_of(raw_t<T> r) {
  if constexpr (T == InType::F32) {
    return float_of(r);
  } else if constexpr (T == InType::BF16) {
    return float_of(static_cast<uint32_t>(r) << 16);
  } else {
    return f16_value(r);
  }
}

// The fp32 amax key (abs_key's) of a key in the input's width.
template <InType T>
FP8_LANE uint32_t f32_key(raw_t<T> k) {
  return bits_of(value_of<T>(k)) & 0x7FFFFFFFu;
}

template <InType T>
FP8_LANE const raw_t<T>* at(const void* base, int64_t i) {
  return static_cast<const raw_t<T>*>(base) + i;
}

// ------------------------------------------------------------------------------ loops
// max key of x[0, n).
template <InType T>
FP8_LANE raw_t<T> max_key(const raw_t<T>* __restrict x, int64_t n) {
  raw_t<T> key = 0;
  for (int64_t i = 0; i < n; ++i) {
    const raw_t<T> k = key_of<T>(x[i]);
    key = key > k ? key : k;
  }
  return key;
}

// acc[i] = max(acc[i], key of x[i]) for i < n: column maxima, one row at a time.
template <InType T>
FP8_LANE void max_keys_into(const raw_t<T>* __restrict x, int64_t n, raw_t<T>* __restrict acc) {
  for (int64_t i = 0; i < n; ++i) {
    const raw_t<T> k = key_of<T>(x[i]);
    acc[i] = acc[i] > k ? acc[i] : k;
  }
}

// out[i] = fp8(x[i] * s) for i < n; returns the max key of x[0, n).
template <InType T, Fp8Kind K>
FP8_LANE raw_t<T> cast_keyed(const raw_t<T>* __restrict x, int64_t n, float s, uint8_t* __restrict out) {
  raw_t<T> key = 0;
  for (int64_t i = 0; i < n; ++i) {
    const raw_t<T> r = x[i];
    const raw_t<T> k = key_of<T>(r);
    key = key > k ? key : k;
    out[i] = static_cast<uint8_t>(fp8_code<K>(value_of<T>(r) * s));
  }
  return key;
}

// out[i] = fp8(x[i] * s) for i < n.
template <InType T, Fp8Kind K>
FP8_LANE void cast_run(const raw_t<T>* __restrict x, int64_t n, float s, uint8_t* __restrict out) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(fp8_code<K>(value_of<T>(x[i]) * s));
}

// out[i] = fp8(x[i] * s[i]) for i < n (per-column scales).
template <InType T, Fp8Kind K>
FP8_LANE void cast_scaled(const raw_t<T>* __restrict x, int64_t n, const float* __restrict s,
                          uint8_t* __restrict out) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(fp8_code<K>(value_of<T>(x[i]) * s[i]));
}

// ------------------------------------------------------------ explicit native-width groups
// The casts of whole groups of kGroup = 4 * kNativeLanes elements in explicit native-width vectors (common/vec.h):
// the loops above leave the vectoriser free to narrow every term of fp8_code to bytes on its own (three pack
// chains per group at avx2, constants rematerialised for lack of registers), which measured 2-3x slower than
// one narrowing of the finished codes. A group is four fp32 vectors v[0..3]: for fp32 input elements
// [j kL, (j + 1) kL) in v[j]; for 16-bit input each 32-bit lane of a load holds a pair, split with a shift and a
// mask, so v[2h] / v[2h + 1] hold the even / odd elements of [2h kL, (2h + 2) kL) (kL = kNativeLanes). The codes
// go back to element order when they are narrowed (pack_group). Tails shorter than a group use the loops above.
constexpr int kL = vec::kNativeLanes;
constexpr int64_t kGroup = 4 * kL;

template <InType T>
using keyv = std::conditional_t<T == InType::F32, vec::u32n, vec::u16n>;
template <InType T>
constexpr int kKeyVecs = T == InType::F32 ? 4 : 1;

// The first element of v[j] within its group (v[j] then covers elements of [that, that + 2 kL) at most).
template <InType T>
constexpr int64_t lane_first(int j) {
  return T == InType::F32 ? j * kL : (j / 2) * 2 * kL;
}

// The code of p without its sign, for p = |x| * |s| (sign bit clear, or NaN of either sign): fp8_code's rule on
// magnitudes, below 0x80, or at least 0x400000 for NaN (a quiet NaN's bit 22, which the saturating narrowing turns
// into 0xFF). c = min(max, p) keeps a NaN p (vminps); E' << 23 = max(c's exponent bits, the smallest normal's);
// M = (E' << 23) + (E' << kMant) + const, fp8_code's M. The sign goes on separately: 9 operations a vector
// against 16 for fp8_code's form with the sign and the NaN select inside.
template <Fp8Kind K>
FP8_LANE vec::u32n magnitude_codes(vec::f32n p) {
  using C = Fp8Lane<K>;
  using vec::u32n;
  constexpr uint32_t kC = ((23u - C::kMant) << 23) - (C::kMinExpField << C::kMant);
  const vec::f32n c = vec::min_keep_nan(vec::splat<vec::f32n>(K == Fp8Kind::E4M3 ? 448.0f : 57344.0f), p);
  const u32n e = vec::max(vec::bits<u32n>(c) & 0x7F800000u, vec::splat<u32n>(C::kMinExpField << 23));
  const u32n m = e + (e >> (23 - C::kMant)) + kC;
  return vec::bits<u32n>(c + vec::bits<vec::f32n>(m)) & 0x7FFFFFu;
}

// f16_value lane-wise (h in the low 16 bits of each lane).
FP8_LANE vec::f32n f16_values(vec::u32n h) {
  using vec::u32n;
  const u32n em = h & 0x7FFFu;
  const u32n normal = (em << 13) + (112u << 23);
  const u32n special = normal + (112u << 23);
  const u32n sub = vec::bits<u32n>(vec::convert<vec::f32n>(vec::bits<vec::i32n>(em)) * 5.9604644775390625e-08f);
  const u32n r = vec::select(vec::bits<vec::i32n>(em) >= 0x7C00, special,
                             vec::select(vec::bits<vec::i32n>(em) < 0x400, sub, normal));
  return vec::bits<vec::f32n>(r | ((h & 0x8000u) << 16));
}

// The magnitudes |x| of the group at x into v, and max(k, their keys) into k; the sign of each, flipped where
// flip = 0x80, as 0x80 / 0: for fp32 x into sg (v's lanes; `signs` zero), for 16-bit x into `signs` (bytes in
// element order: the words' high bytes narrowed, 4 operations a group against 12 for the 32-bit lanes of sg and
// their merge; sg zero). At avx2, 1 thread, bf16 in L2, ms per 4096^2: flat cast 3.05 -> 2.97, 1x128 rowwise
// 3.66 -> 3.57, mx_both 7.40 -> 7.17.
template <InType T>
FP8_LANE void load_group(const raw_t<T>* x, uint32_t flip, vec::f32n v[4], vec::u32n sg[4], vec::u8n& signs,
                         keyv<T> k[]) {
  using vec::u32n;
  if constexpr (T == InType::F32) {
    for (int j = 0; j < 4; ++j) {
      const u32n u = vec::load<u32n>(x + j * kL);
      const u32n mag = u & 0x7FFFFFFFu;
      k[j] = vec::max(k[j], mag);
      v[j] = vec::bits<vec::f32n>(mag);
      sg[j] = ((u ^ (flip << 24)) >> 24) & 0x80u;
    }
    signs = vec::u8n{};
  } else {
    u32n w[2], m[2];
    for (int h = 0; h < 2; ++h) {
      w[h] = vec::load<u32n>(x + h * 2 * kL) ^ (flip * 0x01000100u);  // the flip on both words' signs
      m[h] = w[h] & 0x7FFF7FFFu;
      if constexpr (T == InType::BF16) {
        v[2 * h] = vec::bits<vec::f32n>(m[h] << 16);
        v[2 * h + 1] = vec::bits<vec::f32n>(m[h] & 0xFFFF0000u);
      } else {
        v[2 * h] = f16_values(m[h] & 0xFFFFu);
        v[2 * h + 1] = f16_values(m[h] >> 16);
      }
      sg[2 * h] = u32n{};
      sg[2 * h + 1] = u32n{};
    }
    signs = vec::narrow_lo(vec::bits<vec::u16n>(w[0]) >> 8, vec::bits<vec::u16n>(w[1]) >> 8) & 0x80;
    k[0] = vec::max(k[0], vec::bits<vec::u16n>(vec::max(vec::bits<vec::u16n>(m[0]), vec::bits<vec::u16n>(m[1]))));
  }
}

// The group's lane values q[0..3] (each < 2^31) as bytes min(q, 255) in element order.
template <InType T>
FP8_LANE vec::u8n pack_group(const vec::u32n q[4]) {
#if ENGINE_VEC_NARROW_SAT_BY_HALVES
  // byte 16h + 4i + l of narrow_sat is lane 4h + l of q[i]; these masks pick element e's byte
  static_assert(kL == 8, "AVX2 halves");
  const vec::u8n b = vec::narrow_sat(q[0], q[1], q[2], q[3]);
  if constexpr (T == InType::F32) {  // q[i] lane L = element 8i + L
    const vec::u8n order = {0,  1,  2,  3,  16, 17, 18, 19, 4,  5,  6,  7,  20, 21, 22, 23,
                            8,  9,  10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
    return __builtin_shuffle(b, order);
  } else {  // q[i] lane L = element 16 (i / 2) + 2L + i % 2
    const vec::u8n order = {0, 4,  1, 5,  2, 6,  3, 7,  16, 20, 17, 21, 18, 22, 19, 23,
                            8, 12, 9, 13, 10, 14, 11, 15, 24, 28, 25, 29, 26, 30, 27, 31};
    return __builtin_shuffle(b, order);
  }
#else
  if constexpr (T == InType::F32) {
    return vec::narrow_sat(q[0], q[1], q[2], q[3]);
  } else {
    const vec::u32n m = vec::splat<vec::u32n>(255u);
    return vec::narrow_lo(vec::bits<vec::u16n>(vec::min(q[0], m) | (vec::min(q[1], m) << 16)),
                          vec::bits<vec::u16n>(vec::min(q[2], m) | (vec::min(q[3], m) << 16)));
  }
#endif
}

// out[0, kGroup) = the codes of the group at x times s[j] (lane-wise, v[j]'s scales, each with its sign bit clear:
// a NaN of either sign, or +0 .. +inf) with the signs flipped where flip = 0x80 (a negative scale); keys into k.
// The codes' magnitudes and signs merge in 32-bit lanes; every NaN saturates to 0xFF and becomes 0x7F (no
// finite or infinite product has the 7-bit code 0x7F: 0xFF can only be a NaN).
template <InType T, Fp8Kind K>
FP8_LANE void cast_group(const raw_t<T>* x, const vec::f32n s[4], uint32_t flip, uint8_t* out, keyv<T> k[]) {
  vec::f32n v[4];
  vec::u32n sg[4];
  vec::u8n signs;
  load_group<T>(x, flip, v, sg, signs, k);
  vec::u32n q[4];
  for (int j = 0; j < 4; ++j) q[j] = magnitude_codes<K>(v[j] * s[j]) | sg[j];
  const vec::u8n b = pack_group<T>(q) | signs;
  vec::store(out, b ^ (vec::bits<vec::u8n>(b == 0xFF) & 0x80));
}

// A scale as (|s|, 0x80 where s's sign bit is set): x * s = +-(|x| * |s|), the sign x's flipped.
FP8_LANE float abs_scale(float s) { return float_of(bits_of(s) & 0x7FFFFFFFu); }
FP8_LANE uint32_t scale_flip(float s) { return (bits_of(s) >> 24) & 0x80u; }

// The max key of the key vectors k and the scalar key `key`.
template <InType T>
FP8_LANE raw_t<T> fold_keys(const keyv<T> k[], raw_t<T> key) {
  keyv<T> m = k[0];
  for (int j = 1; j < kKeyVecs<T>; ++j) m = vec::max(m, k[j]);
  const raw_t<T> r = vec::reduce_max(m);
  return r > key ? r : key;
}

// The prefetches of one group's worth of elements at pf (nullptr: none): the casts below spread the fetch of the
// next unit over their groups, one line at a time, instead of asking for all its lines at once (a burst of
// prefetches stalls once the core's miss buffers are full: 22% of block_transposed's time at avx2, 1 thread).
// LOCALITY: __builtin_prefetch's (2: prefetcht1, 3: prefetcht0; see cast_run_g).
template <InType T, int LOCALITY = 2>
FP8_LANE void prefetch_group(const raw_t<T>* pf) {
  if (pf == nullptr) return;
  const char* p = reinterpret_cast<const char*>(pf);
  for (int64_t b = 0; b < kGroup * static_cast<int64_t>(sizeof(raw_t<T>)); b += 64) {
    __builtin_prefetch(p + b, 0, LOCALITY);
  }
}

// The prefetches of the elements [i, n) at pf that prefetch_group did not cover (nullptr: none).
template <InType T, int LOCALITY = 2>
FP8_LANE void prefetch_tail(const raw_t<T>* pf, int64_t i, int64_t n) {
  if (pf == nullptr || i >= n) return;
  const char* p = reinterpret_cast<const char*>(pf + i);
  for (int64_t b = 0; b < (n - i) * static_cast<int64_t>(sizeof(raw_t<T>)); b += 64) {
    __builtin_prefetch(p + b, 0, LOCALITY);
  }
}

// cast_keyed in groups: out[i] = fp8(x[i] * s) for i < n; returns max(key, the max key of x[0, n)).
template <InType T, Fp8Kind K>
FP8_LANE raw_t<T> cast_keyed_g(const raw_t<T>* __restrict x, int64_t n, float s, uint8_t* __restrict out,
                               raw_t<T> key = 0, const raw_t<T>* pf = nullptr) {
  keyv<T> k[4] = {};
  const vec::f32n sv = vec::splat<vec::f32n>(abs_scale(s));
  const vec::f32n sc[4] = {sv, sv, sv, sv};
  const uint32_t flip = scale_flip(s);
  int64_t i = 0;
  for (; i + kGroup <= n; i += kGroup) {
    prefetch_group<T>(pf ? pf + i : nullptr);
    cast_group<T, K>(x + i, sc, flip, out + i, k);
  }
  prefetch_tail<T>(pf, i, n);
  if (i < n) {
    const raw_t<T> t = cast_keyed<T, K>(x + i, n - i, s, out + i);
    key = t > key ? t : key;
  }
  return i > 0 ? fold_keys<T>(k, key) : key;
}

// cast_run in groups. The next unit's lines at pf are asked for with prefetcht0 (block_tiles, the only caller that
// passes pf, then reads them for its amax pass: at avx2, 1 thread, 4096^2 bf16 from memory, 128x128 tiles, ms per
// call 7.0-7.9 -> 5.7-5.8 against prefetcht1).
template <InType T, Fp8Kind K>
FP8_LANE void cast_run_g(const raw_t<T>* __restrict x, int64_t n, float s, uint8_t* __restrict out,
                         const raw_t<T>* pf = nullptr) {
  keyv<T> k[4] = {};
  const vec::f32n sv = vec::splat<vec::f32n>(abs_scale(s));
  const vec::f32n sc[4] = {sv, sv, sv, sv};
  const uint32_t flip = scale_flip(s);
  int64_t i = 0;
  for (; i + kGroup <= n; i += kGroup) {
    prefetch_group<T, 3>(pf ? pf + i : nullptr);
    cast_group<T, K>(x + i, sc, flip, out + i, k);
  }
  prefetch_tail<T, 3>(pf, i, n);
  if (i < n) cast_run<T, K>(x + i, n - i, s, out + i);
}

// s[0, n) in group lane order (arranged[g + j kL + l] = the scale of v[j] lane l of the group at g) for the
// whole groups; the tail as is. Returns whether cast_scaled_g may use them: no scale below zero (-0 included; a NaN
// of either sign is fine, its magnitude is arranged).
template <InType T>
FP8_LANE bool arrange_scales(const float* __restrict s, int64_t n, float* __restrict arranged) {
  uint32_t negative = 0;
  for (int64_t i = 0; i < n; ++i) negative |= static_cast<uint32_t>(bits_of(s[i]) >= 0x80000000u && s[i] == s[i]);
  if (negative) return false;
  int64_t g = 0;
  for (; g + kGroup <= n; g += kGroup) {
    for (int j = 0; j < 4; ++j) {
      for (int l = 0; l < kL; ++l) {
        arranged[g + j * kL + l] = T == InType::F32 ? s[g + j * kL + l] : s[g + lane_first<T>(j) + 2 * l + (j & 1)];
      }
    }
  }
  for (; g < n; ++g) arranged[g] = s[g];
  for (int64_t i = 0; i < n; ++i) arranged[i] = abs_scale(arranged[i]);
  return true;
}

// cast_scaled in groups, the scales of the whole groups from `arranged` (arrange_scales of s; nullptr where it
// returned false: then all one by one).
template <InType T, Fp8Kind K>
FP8_LANE void cast_scaled_g(const raw_t<T>* __restrict x, int64_t n, const float* __restrict s,
                            const float* __restrict arranged, uint8_t* __restrict out, const raw_t<T>* pf = nullptr) {
  keyv<T> k[4] = {};
  int64_t i = 0;
  for (; arranged && i + kGroup <= n; i += kGroup) {
    prefetch_group<T>(pf ? pf + i : nullptr);
    vec::f32n sc[4];
    for (int j = 0; j < 4; ++j) sc[j] = vec::load<vec::f32n>(arranged + i + j * kL);
    cast_group<T, K>(x + i, sc, 0, out + i, k);
  }
  prefetch_tail<T>(pf, i, n);
  if (i < n) cast_scaled<T, K>(x + i, n - i, s + i, out + i);
}

// Asks for the cache lines of x[0, n) (into L2): the kernels fetch their next work unit while they cast
// the current one (strided walks over 64-row regions have too many streams for the hardware prefetchers).
template <InType T>
FP8_LANE void prefetch(const raw_t<T>* x, int64_t n) {
  const char* p = reinterpret_cast<const char*>(x);
  for (int64_t b = 0; b < n * static_cast<int64_t>(sizeof(raw_t<T>)); b += 64) __builtin_prefetch(p + b, 0, 2);
}

// ------------------------------------------------------------------------- FP8 -> bf16
// fp8_to_bf16_bits, branch-free: normal codes rebias the exponent field; subnormals are their integer
// mantissa times the smallest subnormal (an exact fp32 product, whose top half is the bf16 word).
template <Fp8Kind K>
FP8_LANE uint16_t bf16_word(uint8_t code) {
  constexpr uint32_t kMant = K == Fp8Kind::E4M3 ? 3 : 2;
  constexpr uint32_t kBias = K == Fp8Kind::E4M3 ? 7 : 15;
  constexpr float kUnit = K == Fp8Kind::E4M3 ? 0.001953125f : 1.52587890625e-05f;  // 2^-9, 2^-16
  const uint32_t mag = code & 0x7Fu;
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 8;
  const uint32_t normal = (mag << (7 - kMant)) + ((127u - kBias) << 7);
  const uint32_t sub = bits_of(static_cast<float>(static_cast<int32_t>(mag)) * kUnit) >> 16;
  uint32_t w = sign | pick(mag < (1u << kMant), sub, normal);
  if constexpr (K == Fp8Kind::E4M3) {
    w = pick(mag == 0x7Fu, 0x7FC0u, w);
  } else {
    w = pick(mag >= 0x7Cu, pick(mag == 0x7Cu, sign | 0x7F80u, 0x7FC0u), w);
  }
  return static_cast<uint16_t>(w);
}

}  // namespace fp8v
}  // namespace ENGINE_ISA_NS
}  // namespace engine_native
