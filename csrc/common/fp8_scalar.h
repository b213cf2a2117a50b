// Scalar, portable versions of every numeric rule in engine/ops/reference.py.
//
// These are the definitions the vector kernels must agree with bit for bit; the portable
// kernels (kernels_generic.cpp) use them directly. Everything here is `static inline` so
// that each translation unit gets its own copy compiled for its own instruction set (the
// AVX-512 file must never donate its copies to the portable one through the linker).
#pragma once

#include <cstdint>
#include <cstring>

namespace engine_native {

enum class InType : int { F32 = 0, BF16 = 1, F16 = 2 };
enum class Fp8Kind : int { E4M3 = 0, E5M2 = 1 };

static inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

static inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

static inline bool is_nan_f32(float f) { return (f32_bits(f) & 0x7FFFFFFFu) > 0x7F800000u; }
static inline bool is_inf_f32(float f) { return (f32_bits(f) & 0x7FFFFFFFu) == 0x7F800000u; }

// ------------------------------------------------------------------ inputs to fp32 (exact)
static inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

// IEEE half to float, exact, keeping NaN payloads (shifted up) and signs.
static inline float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  uint32_t out;
  if (exp == 0x1Fu) {
    out = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    out = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    out = sign;
  } else {  // subnormal half: normalise
    int shift = 0;
    while ((man & 0x400u) == 0) {
      man <<= 1;
      ++shift;
    }
    out = sign | ((113u - shift) << 23) | ((man & 0x3FFu) << 13);
  }
  return bits_f32(out);
}

template <InType T>
static inline float load_f32(const void* base, int64_t i) {
  if constexpr (T == InType::F32) {
    return static_cast<const float*>(base)[i];
  } else if constexpr (T == InType::BF16) {
    return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
  } else {
    return f16_to_f32(static_cast<const uint16_t*>(base)[i]);
  }
}

// |x| as ordered integer bits: comparing these compares magnitudes, and a NaN compares
// above every number (its exponent field is all ones with a non-zero mantissa).
template <InType T>
static inline uint32_t abs_key(const void* base, int64_t i) {
  return f32_bits(load_f32<T>(base, i)) & 0x7FFFFFFFu;
}

// The fp32 value of an amax key: NaN keys become the canonical quiet NaN.
static inline float key_to_amax(uint32_t key) {
  return key > 0x7F800000u ? bits_f32(0x7FC00000u) : bits_f32(key);
}

// ------------------------------------------------------------------- FP8 format constants
struct Fp8Format {
  float max;                  // largest finite value
  uint32_t min_normal_exp;    // fp32 exponent field of the smallest normal
  int mantissa_bits;          // 3 (E4M3) or 2 (E5M2)
  int bias;                   // 7 or 15
  int max_exponent;           // "emax" of the OCP MX spec: 8 or 15
};

static inline Fp8Format fp8_format(Fp8Kind kind) {
  if (kind == Fp8Kind::E4M3) return {448.0f, 121u, 3, 7, 8};
  return {57344.0f, 113u, 2, 15, 15};
}

// Saturating round-to-nearest-even fp32 -> FP8 code, as `reference.cast_to_fp8`: every NaN
// (either sign, any payload) becomes the canonical code 0x7F, infinities become +-max,
// -0.0 keeps its sign, fp8 subnormals are produced.
static inline uint8_t fp32_to_fp8(float x, Fp8Kind kind) {
  const Fp8Format f = fp8_format(kind);
  const uint32_t bits = f32_bits(x);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  uint32_t mag = bits & 0x7FFFFFFFu;
  if (mag > 0x7F800000u) return 0x7Fu;
  if (mag > f32_bits(f.max)) mag = f32_bits(f.max);  // saturate (also inf)
  const int drop = 23 - f.mantissa_bits;               // fp32 mantissa bits to drop
  const uint32_t exp = mag >> 23;
  uint32_t code;
  if (exp >= f.min_normal_exp) {
    // normal: round the fp32 bits at `drop`, ties to even, then rebias the exponent
    const uint32_t lsb = (mag >> drop) & 1u;
    const uint32_t rounded = mag + ((1u << (drop - 1)) - 1u) + lsb;
    code = (rounded >> drop) - ((127u - f.bias) << f.mantissa_bits);
  } else {
    // below the smallest normal: count units of the smallest subnormal 2^(1-bias-mbits).
    // mag = significand * 2^(e - 150) with e >= 1 (an fp32 subnormal has e = 1 and no
    // implicit bit), so the count is significand >> (min_normal_exp - e + drop), rounded.
    const uint32_t e = exp == 0 ? 1u : exp;
    const uint32_t significand = exp == 0 ? (mag & 0x7FFFFFu) : ((mag & 0x7FFFFFu) | 0x800000u);
    const int total = static_cast<int>(f.min_normal_exp - e) + drop;
    if (total >= 32) return sign;  // below a quarter unit
    const uint32_t q = significand >> total;
    const uint32_t rem = significand & ((1u << total) - 1u);
    const uint32_t half = 1u << (total - 1);
    code = q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
  }
  return sign | static_cast<uint8_t>(code);
}

// ------------------------------------------------------------- scales (reference.compute_scale)
struct ScaleRule {
  float fp8_max;
  bool pow2;
  float epsilon;        // float(amax_epsilon)
  float value_for_inf;  // float(value_for_inf)
};

// scale = fp8_max / max(amax, eps); 0/inf/NaN amax -> 1; inf scale -> value_for_inf;
// power-of-2 scales keep only the sign and exponent bits.
static inline float compute_scale(float amax, const ScaleRule& r) {
  float a = amax;
  if (a < r.epsilon) a = r.epsilon;
  float scale = r.fp8_max / a;
  if (is_inf_f32(scale)) scale = r.value_for_inf;
  if (a == 0.0f || is_inf_f32(a) || is_nan_f32(a)) scale = 1.0f;
  if (r.pow2) scale = bits_f32(f32_bits(scale) & 0xFF800000u);
  return scale;
}

// ---------------------------------------------------------------- E8M0 (reference.e8m0_*)
static constexpr uint8_t kE8M0NaN = 0xFF;

// RCEIL: d = amax * fp32(1/fp8_max); the code is d's biased exponent, plus one when the
// mantissa is non-zero (not past 254; a subnormal d up to 2^-127 stays code 0).
static inline uint8_t e8m0_rceil(float amax, float rcp_fp8_max) {
  const float d = amax * rcp_fp8_max;
  const uint32_t bits = f32_bits(d) & 0x7FFFFFFFu;
  if (bits > 0x7F800000u) return kE8M0NaN;
  if (bits == 0x7F800000u) return 0xFE;
  const uint32_t exponent = bits >> 23;
  const uint32_t mantissa = bits & 0x7FFFFFu;
  const bool round_up = mantissa > 0 && exponent != 0xFE && !(exponent == 0 && mantissa <= 0x400000u);
  return static_cast<uint8_t>(exponent + (round_up ? 1u : 0u));
}

// FLOOR (OCP MX v1.0): floor(log2(amax)) - emax, clamped to [-127, 127], biased by 127.
static inline uint8_t e8m0_floor(float amax, int max_exponent) {
  const uint32_t bits = f32_bits(amax);
  if ((bits & 0x7F800000u) == 0x7F800000u) return kE8M0NaN;  // inf or NaN
  int shared = static_cast<int>((bits >> 23) & 0xFFu) - 127 - max_exponent;
  if (shared < -127) shared = -127;
  if (shared > 127) shared = 127;
  return static_cast<uint8_t>(shared + 127);
}

// The scale_inv an E8M0 code stands for: 2^(code - 127) exactly (code 0 gives the subnormal
// 2^-127); code 255 gives NaN.
// e8m0_to_f32's bits, without branches (loops over codes vectorise).
static inline uint32_t e8m0_f32_bits(uint8_t code) {
  const uint32_t normal = static_cast<uint32_t>(code) << 23;
  return code == 0 ? 0x00400000u : code == kE8M0NaN ? 0x7FC00000u : normal;
}

static inline float e8m0_to_f32(uint8_t code) {
  if (code == kE8M0NaN) return bits_f32(0x7FC00000u);
  if (code == 0) return bits_f32(0x00400000u);
  return bits_f32(static_cast<uint32_t>(code) << 23);
}

// The multiplier applied to the elements of a block: 2^(127 - code) exactly (code 254
// gives the subnormal 2^-127); code 255 gives NaN.
static inline float e8m0_element_scale(uint8_t code) {
  if (code == kE8M0NaN) return bits_f32(0x7FC00000u);
  if (code == 254) return bits_f32(0x00400000u);
  return bits_f32(static_cast<uint32_t>(254 - code) << 23);
}

// ------------------------------------------------------------ bf16 times a power of two
// x[i] = bf16(x[i] * s[i]) for bf16 bits x: the product in fp32, rounded to nearest even, every
// NaN 0x7FC0 (torch's own bf16 multiply gives other NaN bits in its vector loop). Branch-free,
// so each kernel file's compiler vectorises it for its instruction set.
static inline uint16_t scaled_bf16(uint16_t x, float s) {
  const uint32_t u = f32_bits(bits_f32(static_cast<uint32_t>(x) << 16) * s);
  const uint16_t rounded = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? static_cast<uint16_t>(0x7FC0u) : rounded;
}

static inline void scale_bf16_loop(uint16_t* x, const float* s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = scaled_bf16(x[i], s[i]);
}

// The same with runs of `run` elements sharing one scale: x[i] = bf16(x[i] * s[i / run]).
static inline void scale_bf16_runs_loop(uint16_t* x, const float* s, int64_t n, int64_t run) {
  for (int64_t i = 0, t = 0; i < n; i += run, ++t) {
    const float st = s[t];
    const int64_t len = n - i < run ? n - i : run;
    for (int64_t j = 0; j < len; ++j) x[i + j] = scaled_bf16(x[i + j], st);
  }
}

// ------------------------------------------------------------------------- FP8 -> bf16
// Every E4M3/E5M2 value is a bf16 value. Every NaN code gives the positive quiet NaN 0x7FC0,
// as torch's .to(bfloat16) does; E5M2 infinities give bf16 infinities.
static inline uint16_t fp8_to_bf16_bits(uint8_t code, Fp8Kind kind) {
  const uint16_t sign = static_cast<uint16_t>((code & 0x80u) << 8);
  const uint32_t mag = code & 0x7Fu;
  const int mbits = kind == Fp8Kind::E4M3 ? 3 : 2;
  const int bias = kind == Fp8Kind::E4M3 ? 7 : 15;
  const uint32_t exp = mag >> mbits;
  const uint32_t man = mag & ((1u << mbits) - 1u);
  if (kind == Fp8Kind::E4M3 && mag == 0x7Fu) return 0x7FC0u;
  if (kind == Fp8Kind::E5M2 && exp == 0x1Fu) return man ? 0x7FC0u : static_cast<uint16_t>(sign | 0x7F80u);
  float value;
  if (exp == 0) {
    value = static_cast<float>(man) * bits_f32(static_cast<uint32_t>(127 + 1 - bias - mbits) << 23);
  } else {
    value = bits_f32(((exp - bias + 127u) << 23) | (man << (23 - mbits)));
  }
  return sign | static_cast<uint16_t>(f32_bits(value) >> 16);
}

// The smallest magnitude code (code & 0x7F) that is not a finite number: E4M3's NaN 0x7F, E5M2's infinity 0x7C.
static inline uint8_t first_special_magnitude(Fp8Kind kind) { return kind == Fp8Kind::E4M3 ? 0x7F : 0x7C; }

// log2(s) when s is a positive normal power of two, else kNoShift.
constexpr int kNoShift = 1000;

static inline int pow2_shift(float s) {
  uint32_t b;
  std::memcpy(&b, &s, sizeof b);
  const int biased = static_cast<int>((b >> 23) & 0xFF);
  return (b & 0x807FFFFFu) == 0 && biased >= 1 && biased <= 254 ? biased - 127 : kNoShift;
}

// Whether every finite nonzero value of `kind` times 2^shift is a normal number: then scaling by 2^shift is an add
// of shift * 128 to the bf16 word of each finite nonzero value, exactly. (Smallest magnitudes: E4M3 2^-9, E5M2
// 2^-16; largest below 2^9 and 2^16.)
static inline int min_normal_shift(Fp8Kind kind) { return kind == Fp8Kind::E4M3 ? -117 : -110; }
static inline int max_normal_shift(Fp8Kind kind) { return kind == Fp8Kind::E4M3 ? 119 : 112; }
static inline bool shift_stays_normal(Fp8Kind kind, int shift) {
  return shift != kNoShift && shift >= min_normal_shift(kind) && shift <= max_normal_shift(kind);
}

}  // namespace engine_native
