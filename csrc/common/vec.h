// The portable vector layer the kernels are written against: GCC / clang vector extensions, which
// each variant's target options lower to SSE2, AVX2, AVX-512 or NEON. A vector is 64 bytes (16 fp32
// lanes, 32 16-bit lanes, 64 bytes): one AVX-512 register, two AVX2 ones, four SSE2 / NEON ones.
//
// Include only from a `*_kernels.cpp` (after isa_begin.h): everything here is in the variant's namespace.
// Arithmetic is the operators (+ - * / & | ^ << >> == < ...), lane-wise, in IEEE fp32 with round to
// nearest; comparisons give all-ones / all-zero lanes of the same-width signed integer type.
#pragma once

#ifndef ENGINE_ISA_NS
#error "common/vec.h is for *_kernels.cpp sources (compiled per instruction set)"
#endif

namespace engine_native {
namespace ENGINE_ISA_NS {
namespace vec {

// Hot helpers must be inlined: a call would pass the vectors through memory.
#define ENGINE_VEC_INLINE inline __attribute__((always_inline))

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x32 __attribute__((vector_size(64)));
typedef int16_t i16x32 __attribute__((vector_size(64)));
typedef uint8_t u8x64 __attribute__((vector_size(64)));
typedef int8_t i8x64 __attribute__((vector_size(64)));
// narrower ones, for conversions between lane widths
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef int16_t i16x16 __attribute__((vector_size(32)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

// The level's own register width in fp32 lanes (x86-64: 4 SSE2, 8 AVX2, 16 AVX-512; elsewhere 4, NEON), and
// vectors of that width. GCC 12 splits the 64-byte vectors above into native ones well for arithmetic but not
// for shuffles, narrowing conversions or widening loads (those go through the stack below AVX-512): kernels
// that need them work in these.
#if defined(__x86_64__) && ENGINE_ISA_LEVEL >= 2
constexpr int kNativeLanes = 16;
#elif defined(__x86_64__) && ENGINE_ISA_LEVEL == 1
constexpr int kNativeLanes = 8;
#else
constexpr int kNativeLanes = 4;
#endif
typedef float f32n __attribute__((vector_size(4 * kNativeLanes)));
typedef uint32_t u32n __attribute__((vector_size(4 * kNativeLanes)));
typedef int32_t i32n __attribute__((vector_size(4 * kNativeLanes)));

typedef uint16_t u16n __attribute__((vector_size(4 * kNativeLanes)));  // 2 * kNativeLanes lanes
typedef uint8_t u8n __attribute__((vector_size(4 * kNativeLanes)));    // 4 * kNativeLanes lanes
typedef int8_t i8n __attribute__((vector_size(4 * kNativeLanes)));

template <typename V>
constexpr int lanes() {
  return static_cast<int>(sizeof(V) / sizeof(V{}[0]));
}

template <typename V>
using lane_t = std::remove_cv_t<std::remove_reference_t<decltype(V{}[0])>>;

// Every lane = s.
template <typename V>
ENGINE_VEC_INLINE V splat(lane_t<V> s) {
  return s - V{};  // not V{} + s: 0 + -0 is +0
}

// Lanes 0, 1, 2, ... as the lane type.
template <typename V>
ENGINE_VEC_INLINE V iota() {
  V v{};
  for (int i = 0; i < lanes<V>(); ++i) v[i] = static_cast<lane_t<V>>(i);
  return v;
}

template <typename V>
ENGINE_VEC_INLINE V load(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename V>
ENGINE_VEC_INLINE void store(void* p, V v) {
  std::memcpy(p, &v, sizeof v);
}

// The first n lanes from p (n <= 0: none, n >= lanes: all), the others 0.
template <typename V>
ENGINE_VEC_INLINE V load_first(const void* p, int64_t n) {
  if (n >= lanes<V>()) return load<V>(p);
  V v{};
  if (n > 0) std::memcpy(&v, p, static_cast<size_t>(n) * sizeof(lane_t<V>));
  return v;
}

// Writes the first n lanes of v to p.
template <typename V>
ENGINE_VEC_INLINE void store_first(void* p, V v, int64_t n) {
  if (n >= lanes<V>()) {
    store(p, v);
  } else if (n > 0) {
    std::memcpy(p, &v, static_cast<size_t>(n) * sizeof(lane_t<V>));
  }
}

// Stores v to p around the caches where the level has such a store (x86-64: movntdq, 16 bytes at a time; p
// 16-byte aligned), a plain store elsewhere. Stream stores that fill a whole 64-byte line one after another skip
// reading the line first (no read for ownership) and leave the caches to the data still to be read: for large
// outputs only. stream_fence() orders them before the stores that follow (call it before returning to the glue).
template <typename V>
ENGINE_VEC_INLINE void store_stream(void* p, V v) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  typedef long long q2 __attribute__((vector_size(16)));
  static_assert(sizeof(V) % 16 == 0, "store_stream: whole 16-byte pieces");
  for (size_t o = 0; o < sizeof(V); o += 16) {
    q2 q;
    std::memcpy(&q, reinterpret_cast<const char*>(&v) + o, 16);
    q2* d = reinterpret_cast<q2*>(static_cast<char*>(p) + o);
#if defined(__clang__)
    __builtin_nontemporal_store(q, d);
#else
    __builtin_ia32_movntdq(d, q);
#endif
  }
#else
  store(p, v);
#endif
}

ENGINE_VEC_INLINE void stream_fence() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_ia32_sfence();
#endif
}

// Same-size reinterpretation of the bits.
template <typename To, typename From>
ENGINE_VEC_INLINE To bits(From v) {
  static_assert(sizeof(To) == sizeof(From), "bits: sizes differ");
  return (To)v;
}

// Lane-wise value conversion (C++ conversion rules per lane: float -> int truncates; int -> narrower
// int keeps the low bits).
template <typename To, typename From>
ENGINE_VEC_INLINE To convert(From v) {
  return __builtin_convertvector(v, To);
}

// m ? a : b per lane, m a comparison result (all-ones or zero lanes of a's width).
template <typename V, typename M>
ENGINE_VEC_INLINE V select(M m, V a, V b) {
  using U = decltype(m);
  static_assert(sizeof(U) == sizeof(V), "select: mask and values differ in width");
  return bits<V>((bits<U>(a) & m) | (bits<U>(b) & ~m));
}

// Unsigned / signed integer min and max (lane-wise).
template <typename V>
ENGINE_VEC_INLINE V min(V a, V b) {
  return a < b ? a : b;
}
template <typename V>
ENGINE_VEC_INLINE V max(V a, V b) {
  return a > b ? a : b;
}

// The x86 minps / maxps rule: b unless a < b (min) / a > b (max), so a NaN in either gives b.
ENGINE_VEC_INLINE f32x16 fmin_b(f32x16 a, f32x16 b) { return select(a < b, a, b); }
ENGINE_VEC_INLINE f32x16 fmax_b(f32x16 a, f32x16 b) { return select(a > b, a, b); }

ENGINE_VEC_INLINE i32x16 is_nan(f32x16 v) { return v != v; }
ENGINE_VEC_INLINE f32x16 abs(f32x16 v) { return bits<f32x16>(bits<u32x16>(v) & 0x7FFFFFFFu); }

// The low halves of the lanes of a, then of b, as one native vector of half-width lanes (a's lanes first): the
// narrowing of two native vectors into one, written as an even-lane shuffle, which GCC lowers to packs (AVX2, SSE2),
// vpermt2w / vpmovwb (AVX-512) or uzp1 (NEON); a narrowing __builtin_convertvector goes through memory below AVX-512.
#define ENGINE_VEC_EVEN8 0, 2, 4, 6, 8, 10, 12, 14
#define ENGINE_VEC_EVEN16 ENGINE_VEC_EVEN8, 16, 18, 20, 22, 24, 26, 28, 30
#define ENGINE_VEC_EVEN32 ENGINE_VEC_EVEN16, 32, 34, 36, 38, 40, 42, 44, 46, 48, 50, 52, 54, 56, 58, 60, 62
#define ENGINE_VEC_EVEN64                                                                                        \
  ENGINE_VEC_EVEN32, 64, 66, 68, 70, 72, 74, 76, 78, 80, 82, 84, 86, 88, 90, 92, 94, 96, 98, 100, 102, 104, 106, \
      108, 110, 112, 114, 116, 118, 120, 122, 124, 126
#if ENGINE_ISA_LEVEL >= 2 && defined(__x86_64__)
#define ENGINE_VEC_EVEN_HALF ENGINE_VEC_EVEN32
#define ENGINE_VEC_EVEN_BYTE ENGINE_VEC_EVEN64
#elif ENGINE_ISA_LEVEL == 1 && defined(__x86_64__)
#define ENGINE_VEC_EVEN_HALF ENGINE_VEC_EVEN16
#define ENGINE_VEC_EVEN_BYTE ENGINE_VEC_EVEN32
#else
#define ENGINE_VEC_EVEN_HALF ENGINE_VEC_EVEN8
#define ENGINE_VEC_EVEN_BYTE ENGINE_VEC_EVEN16
#endif
ENGINE_VEC_INLINE u16n narrow_lo(u32n a, u32n b) {
  return __builtin_shufflevector(bits<u16n>(a), bits<u16n>(b), ENGINE_VEC_EVEN_HALF);
}
ENGINE_VEC_INLINE u8n narrow_lo(u16n a, u16n b) {
  return __builtin_shufflevector(bits<u8n>(a), bits<u8n>(b), ENGINE_VEC_EVEN_BYTE);
}

// The x86 minps rule on native vectors: a unless b < a, so a NaN b gives b (min_keep_nan(max, p): NaN p stays).
// (GCC lowers the select to a compare and a blend: the x86 levels call minps.)
ENGINE_VEC_INLINE f32n min_keep_nan(f32n a, f32n b) {
#if defined(__x86_64__) && ENGINE_ISA_LEVEL == 1 && defined(__GNUC__) && !defined(__clang__)
  return __builtin_ia32_minps256(a, b);
#elif defined(__x86_64__) && ENGINE_ISA_LEVEL == 0 && defined(__GNUC__) && !defined(__clang__)
  return __builtin_ia32_minps(a, b);
#else
  return select(a < b, a, b);
#endif
}

// Whether narrow_sat below keeps each 128-bit half apart (x86 AVX2, GCC: packs / packus) rather than giving the
// lanes in order.
#if defined(__x86_64__) && ENGINE_ISA_LEVEL == 1 && defined(__GNUC__) && !defined(__clang__)
#define ENGINE_VEC_NARROW_SAT_BY_HALVES 1
#else
#define ENGINE_VEC_NARROW_SAT_BY_HALVES 0
#endif

// Four native vectors of 32-bit lanes (each < 2^31) narrowed to bytes with unsigned saturation (min(lane, 255)).
// In order (a's lanes, then b's, c's, d's) except where ENGINE_VEC_NARROW_SAT_BY_HALVES: there byte 16h + 4i + l
// is lane 4h + l of the i-th vector (a, b, c, d), for the halves h = 0, 1 (two packs and a packus, 3 instructions
// against about 12 for the in-order form); a caller shuffles once, after merging, into the order it needs.
ENGINE_VEC_INLINE u8n narrow_sat(u32n a, u32n b, u32n c, u32n d) {
#if ENGINE_VEC_NARROW_SAT_BY_HALVES
  typedef int i32x8_ __attribute__((vector_size(32)));
  typedef short i16x16_ __attribute__((vector_size(32)));
  const i16x16_ ab = __builtin_ia32_packssdw256(bits<i32x8_>(a), bits<i32x8_>(b));
  const i16x16_ cd = __builtin_ia32_packssdw256(bits<i32x8_>(c), bits<i32x8_>(d));
  return bits<u8n>(__builtin_ia32_packuswb256(ab, cd));
#else
  const u32n m = splat<u32n>(255u);
  return narrow_lo(narrow_lo(min(a, m), min(b, m)), narrow_lo(min(c, m), min(d, m)));
#endif
}

// The kNativeLanes bytes at p, zero-extended to 32-bit lanes: one vpmovzxbd on x86 AVX2 / AVX-512 (GCC lowers the
// generic widening of a byte vector lane by lane there when it can see where the bytes came from).
ENGINE_VEC_INLINE u32n widen_bytes(const void* p) {
#if defined(__x86_64__) && ENGINE_ISA_LEVEL >= 2 && defined(__GNUC__) && !defined(__clang__)
  typedef char v16qi_ __attribute__((vector_size(16)));
  typedef int v16si_ __attribute__((vector_size(64)));
  v16qi_ b;
  std::memcpy(&b, p, 16);
  return bits<u32n>(__builtin_ia32_pmovzxbd512_mask(b, v16si_{}, static_cast<unsigned short>(0xFFFF)));
#elif defined(__x86_64__) && ENGINE_ISA_LEVEL == 1 && defined(__GNUC__) && !defined(__clang__)
  typedef char v16qi_ __attribute__((vector_size(16)));
  typedef long long v2di_ __attribute__((vector_size(16)));
  v2di_ q = {0, 0};
  std::memcpy(&q, p, 8);
  return bits<u32n>(__builtin_ia32_pmovzxbd256(bits<v16qi_>(q)));
#else
  typedef uint8_t u8q_ __attribute__((vector_size(kNativeLanes)));
  return __builtin_convertvector(load<u8q_>(p), u32n);
#endif
}

// Horizontal max / min / sum of the lanes (a tree of halvings; integer or float lanes).
template <typename V>
ENGINE_VEC_INLINE lane_t<V> reduce_max(V v) {
  lane_t<V> m = v[0];
  for (int i = 1; i < lanes<V>(); ++i) m = v[i] > m ? v[i] : m;
  return m;
}
template <typename V>
ENGINE_VEC_INLINE lane_t<V> reduce_min(V v) {
  lane_t<V> m = v[0];
  for (int i = 1; i < lanes<V>(); ++i) m = v[i] < m ? v[i] : m;
  return m;
}

// bf16 words (low 16 bits of each u32 lane, or a u16x16) -> fp32: the word is the top half.
ENGINE_VEC_INLINE f32x16 bf16_to_f32(u16x16 w) { return bits<f32x16>(convert<u32x16>(w) << 16); }

// fp32 -> bf16 round to nearest even (NaN -> quiet NaN with the sign kept).
ENGINE_VEC_INLINE u16x16 f32_to_bf16(f32x16 v) {
  const u32x16 u = bits<u32x16>(v);
  const u32x16 rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const u32x16 nan = (u >> 16) | 0x40u;
  return convert<u16x16>(select(is_nan(v), nan, rounded));
}

// The kNativeLanes 16-bit words at p, zero-extended to 32-bit lanes: one vpmovzxwd on x86 AVX2 / AVX-512 (GCC 12
// splits the generic widening of a 16-bit vector into halves there: 3 instructions on AVX-512, 5 on AVX2).
ENGINE_VEC_INLINE u32n widen_u16(const void* p) {
#if defined(__x86_64__) && ENGINE_ISA_LEVEL >= 2 && defined(__GNUC__) && !defined(__clang__)
  typedef short v16hi_ __attribute__((vector_size(32)));
  typedef int v16si_ __attribute__((vector_size(64)));
  v16hi_ h;
  std::memcpy(&h, p, 32);
  return bits<u32n>(__builtin_ia32_pmovzxwd512_mask(h, v16si_{}, static_cast<unsigned short>(0xFFFF)));
#elif defined(__x86_64__) && ENGINE_ISA_LEVEL == 1 && defined(__GNUC__) && !defined(__clang__)
  typedef short v8hi_ __attribute__((vector_size(16)));
  v8hi_ h;
  std::memcpy(&h, p, 16);
  return bits<u32n>(__builtin_ia32_pmovzxwd256(h));
#else
  typedef uint16_t u16q_ __attribute__((vector_size(2 * kNativeLanes)));
  return __builtin_convertvector(load<u16q_>(p), u32n);
#endif
}

}  // namespace vec
}  // namespace ENGINE_ISA_NS
}  // namespace engine_native
