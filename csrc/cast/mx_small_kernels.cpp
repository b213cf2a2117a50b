// MXFP4 / MXFP6 quantize and decode, one source compiled per instruction-set level (common/isa_begin.h) against
// the portable vector layer (common/vec.h), in vectors of the level's native width (kLanes fp32 lanes: 16 for
// AVX-512, 8 for AVX2, 4 for SSE2 / NEON).
//
// Bit for bit the rules of engine/ops/mx_elements.py and reference.e8m0_rceil / e8m0_floor:
//   scale code  RCEIL: d = amax * fp32(1/max_elem), rounded up to a power of two (0..254; inf amax 254)
//               FLOOR: floor(log2 amax) - emax_elem, clamped to [-127, 127] (inf amax 255)
//               a NaN amax gives 255 under both
//   element     x * 2^(127 - code) in fp32 (NaN for code 255), rounded to nearest even onto the grid,
//               saturating at +-max, NaN -> code 0, the sign bit kept (-0 has a code)
//   storage     E2M1: two codes per byte along the last dim, element 0 in the low nibble (an odd last dim
//               ends in a byte whose high nibble is 0); E2M3 / E3M2: one code per byte
// Every rule is branch-free lane-wise integer and fp32 arithmetic (`encode`); a segment whose scale codes are
// all below 254 (no inf or NaN in x, the usual case) takes the shorter `encode_finite`, and for bf16 x on
// AVX2 / AVX-512 its magic number comes from a table lookup by x's exponent field (`encode_lookup`).
//
// Work goes in segments: 32 rows (one columnwise block) x up to 4096 bf16 / 2048 fp32 columns (a run of the
// glue's tiles in one strip; a whole strip of a 4096-wide bf16 x is one contiguous read), each read twice:
//   pass 1, from memory, in order: |x| keys -> the column amaxes (a running max per column) and the amax of
//            each 1x32 block (a transposing max-reduction, kLanes blocks at a time) -> both usages' E8M0 codes
//            and multipliers 2^(127 - code);
//   pass 2, from L2: each row cast with its blocks' and with the columns' multipliers, elements in pair order
//            (a bf16 pair splits with a shift and a mask; two E2M1 codes make a byte), while the next
//            segment's rows are prefetched.
#include "cast/mx_small.h"
#include "common/vec.h"

namespace engine_native {
namespace ENGINE_ISA_NS {
namespace {

using namespace vec;

// The kernels work in vectors of the level's native width (vec.h: shuffles and narrowing conversions).
constexpr int kLanes = kNativeLanes;
using f32v = f32n;
using u32v = u32n;
using i32v = i32n;
typedef uint16_t u16v __attribute__((vector_size(4 * kLanes)));  // 2 * kLanes lanes
typedef uint16_t u16x4 __attribute__((vector_size(8)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint8_t u8x32 __attribute__((vector_size(32)));
typedef uint64_t u64v __attribute__((vector_size(4 * kLanes)));

constexpr int64_t kBlock = kMxSmallBlock;
constexpr int64_t kTileCols = kMxSmallTileCols;
constexpr int kChunks = kBlock / (2 * kLanes);  // chunks (2 * kLanes elements: a u32v of bf16) per block

// The facts of one element format, as compile-time constants.
template <int EB, int MB, int BIAS>
struct Format {
  static constexpr int kBits = 1 + EB + MB;
  static constexpr int kMant = MB;
  static constexpr int kEmax = (1 << EB) - 1 - BIAS;  // no inf/NaN: the top exponent holds normals
  static constexpr uint32_t kMinField = static_cast<uint32_t>(1 - BIAS + 127);  // fp32 exponent field of emin
  static constexpr uint32_t kMaxBits = (static_cast<uint32_t>(kEmax + 127) << 23) | (((1u << MB) - 1u) << (23 - MB));
};
using E2M1 = Format<2, 1, 1>;
using E2M3 = Format<2, 3, 1>;
using E3M2 = Format<3, 2, 3>;

ENGINE_VEC_INLINE float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ------------------------------------------------------------------------------------ lane-wise rules
// Saturating round-to-nearest-even fp32 -> element code (mx_elements.encode). With c = min(|y|, max) and
// E' = max(exponent of c, the smallest normal exponent), M = 2^(E' + 23 - mbits) + j ulp(M) has the element's
// step at c as its ulp, and j = (E' - emin) << mbits counts the codes below binade E'. The fp32 sum c + M rounds
// c to that step, ties to even (j is even, so the tie parity is c's own), and its low mantissa bits are
// j + round(c / step): the code of |y|, subnormals included, with no fp32 subnormal arithmetic.
template <typename F>
ENGINE_VEC_INLINE u32v encode(f32v y) {
  const u32v b = bits<u32v>(y);
  const u32v mag = b & 0x7FFFFFFFu;
  const u32v c = min(mag, splat<u32v>(F::kMaxBits));  // +-inf saturate (NaN too, zeroed below)
  const u32v field = max(c >> 23, splat<u32v>(F::kMinField));
  const u32v magic = ((field + (23u - F::kMant)) << 23) + ((field - F::kMinField) << F::kMant);
  const u32v sum = bits<u32v>(bits<f32v>(c) + bits<f32v>(magic));
  const u32v code = (sum & 0x7FFFFFu) | ((b >> (32 - F::kBits)) & (1u << (F::kBits - 1)));
  return select(mag > 0x7F800000u, splat<u32v>(0), code);
}

// The same code for |y| = |x| * s when no scale code of the segment is 254 or 255 (so x holds no inf or NaN and
// |x| * s is finite): the code in the low bits, the bits above it zero up to bit 22 (bits 23 and above hold
// the sum's exponent), no sign. E' = max(c's exponent bits, emin's) as bits e, M = e + 2^23 (23 - mbits) +
// (e - emin's bits) >> (23 - mbits). RCEIL scales never need the saturation (SAT): |x| * s is below max (1 +
// 2^-23), which rounds to max; FLOOR's may round one code above it.
template <typename F, bool SAT>
ENGINE_VEC_INLINE u32v encode_finite(f32v abs_x, f32v s) {
  constexpr uint32_t kShift = 23 - F::kMant;
  constexpr uint32_t kMinNormalBits = F::kMinField << 23;
  constexpr uint32_t kC = ((23u - F::kMant) << 23) - (kMinNormalBits >> kShift);
  const u32v y = bits<u32v>(abs_x * s);
  const u32v c = SAT ? min(y, splat<u32v>(F::kMaxBits)) : y;
  const u32v e = max(c & 0x7F800000u, splat<u32v>(kMinNormalBits));
  const u32v magic = e + (e >> kShift) + kC;
  return bits<u32v>(bits<f32v>(c) + bits<f32v>(magic));
}

// The magic-number table lookup (one variable permute per vector) where the compiler has one: GCC, AVX2 and up.
#if ENGINE_ISA_LEVEL >= 1 && defined(__GNUC__) && !defined(__clang__)
constexpr bool kLookup = true;
#else
constexpr bool kLookup = false;
#endif

// The M of encode_finite by g = max(the exponent field of |x| * s - emin's field, 0): lane g (at most 7 < kLanes
// in the lookup builds).
template <typename F>
ENGINE_VEC_INLINE u32v magic_table() {
  u32v m{};
  for (int g = 0; g < kLanes; ++g) {
    m[g] = ((static_cast<uint32_t>(g) + F::kMinField + 23u - F::kMant) << 23) + (static_cast<uint32_t>(g) << F::kMant);
  }
  return m;
}

// encode_finite with M looked up in `table` by g (lanes g mod kLanes): |x| * s + M. |x| * s is exact, or below
// fp32's normals far below half an element step, where the sum rounds to M either way.
template <typename F, bool SAT>
ENGINE_VEC_INLINE u32v encode_lookup(f32v abs_x, f32v s, u32v table, u32v g) {
#if ENGINE_ISA_LEVEL >= 1 && defined(__GNUC__) && !defined(__clang__)
  const u32v magic = __builtin_shuffle(table, g);
#else
  const u32v magic = table + g;  // never used (kLookup is false)
#endif
  f32v y = abs_x * s;
  if constexpr (SAT) y = bits<f32v>(min(bits<u32v>(y), splat<u32v>(F::kMaxBits)));
  return bits<u32v>(y + bits<f32v>(magic));
}

// E8M0 codes of blocks from their amax keys (|x| bits; a NaN is above every number).
template <typename F, bool RCEIL>
ENGINE_VEC_INLINE u32v scale_codes(u32v key) {
  if constexpr (RCEIL) {
    const float rcp_max = static_cast<float>(1.0 / static_cast<double>(float_of(F::kMaxBits)));
    const u32v amax = select(key > 0x7F800000u, splat<u32v>(0x7FC00000u), key);
    const u32v d = bits<u32v>(bits<f32v>(amax) * rcp_max) & 0x7FFFFFFFu;
    const u32v exponent = d >> 23, mantissa = d & 0x7FFFFFu;
    const i32v up = (mantissa != 0u) & (exponent != 0xFEu) & ~((exponent == 0u) & (mantissa <= 0x400000u));
    const u32v code = exponent + (bits<u32v>(up) & 1u);
    return select(d > 0x7F800000u, splat<u32v>(0xFFu), select(d == 0x7F800000u, splat<u32v>(0xFEu), code));
  }
  const i32v biased = bits<i32v>(key >> 23);  // 0xFF for inf and NaN
  const i32v shared = min(max(biased - (127 + F::kEmax), splat<i32v>(-127)), splat<i32v>(127));
  return select(biased == 0xFF, splat<u32v>(0xFFu), bits<u32v>(shared + 127));
}

// The multipliers of blocks' elements: 2^(127 - code) (254: the subnormal 2^-127), NaN for 255.
ENGINE_VEC_INLINE f32v element_scales(u32v code) {
  const u32v normal = (254u - min(code, splat<u32v>(254u))) << 23;
  return bits<f32v>(select(code == 0xFFu, splat<u32v>(0x7FC00000u),
                           select(code == 254u, splat<u32v>(0x00400000u), normal)));
}

// ------------------------------------------------------------------------------------ shuffles
// Lane i of the pair fold of a and b (N lanes each, N / C blocks of C lanes in order): block k of the result
// (2N / C blocks of C / 2 lanes) is the first (H = 0) or second (H = 1) half of block k of a:b.
template <int N, int C, int H>
constexpr int half_lane(int i) {
  return (i / (C / 2) < N / C ? (i / (C / 2)) * C : N + (i / (C / 2) - N / C) * C) + i % (C / 2) + H * (C / 2);
}

template <int C, int H, typename V, size_t... I>
ENGINE_VEC_INLINE V half_blocks(V a, V b, std::index_sequence<I...>) {
  return __builtin_shufflevector(a, b, half_lane<lanes<V>(), C, H>(I)...);
}

// The H half of each block of a:b (half_lane), shuffled as the widest lanes that hold whole half blocks: 64 or 32
// bits where a half block of 16-bit keys is at least 4 or 2 keys (GCC gives vpermt2w for 16-bit lanes, which
// Zen 4 runs slower than the qword and dword permutes).
template <int C, int H, typename V>
ENGINE_VEC_INLINE V half_blocks(V a, V b) {
  constexpr int kLaneBytes = static_cast<int>(sizeof(lane_t<V>));
  constexpr int kHalfBytes = (C / 2) * kLaneBytes;
  constexpr int kWide = kHalfBytes % 8 == 0 ? 8 : kHalfBytes % 4 == 0 ? 4 : kLaneBytes;
  if constexpr (kWide > kLaneBytes) {
    using W = std::conditional_t<kWide == 8, u64v, u32v>;
    static_assert(sizeof(W) == sizeof(V), "native-width keys");
    return bits<V>(half_blocks<C / (kWide / kLaneBytes), H>(bits<W>(a), bits<W>(b),
                                                            std::make_index_sequence<lanes<W>()>{}));
  } else {
    return half_blocks<C, H>(a, b, std::make_index_sequence<lanes<V>()>{});
  }
}

template <int C, typename V, size_t... I>
ENGINE_VEC_INLINE V fold_pair(V a, V b, std::index_sequence<I...>) {
  return max(half_blocks<C, 0>(a, b), half_blocks<C, 1>(a, b));
}

constexpr int log2_of(int n) { return n <= 1 ? 0 : 1 + log2_of(n / 2); }

// The last fold of a group (lane q: block q's max, as fp32 bits).
template <typename V>
ENGINE_VEC_INLINE u32v finish_blocks(V last) {
  if constexpr (lanes<V>() == 2 * kLanes) {  // two 16-bit keys per block
    const u32v w = bits<u32v>(last);
    return max(w & 0xFFFFu, w >> 16) << 16;
  } else {
    return bits<u32v>(last);
  }
}

// The keys (|x| bits) of block b of the row at px, w elements (FULL: block b is whole), max'ed into the column maxima
// col_key (COL).
template <bool FULL, bool COL, bool BF16, typename Key, typename Elem>
ENGINE_VEC_INLINE Key block_keys(const Elem* __restrict px, int64_t b, int64_t w, Key* __restrict col_key) {
  constexpr int kPerBlock = kBlock / lanes<Key>();
  Key m{};
  for (int v = 0; v < kPerBlock; ++v) {
    const int64_t e = kBlock * b + lanes<Key>() * v;
    const Key key = (FULL ? load<Key>(px + e) : load_first<Key>(px + e, w - e)) & (BF16 ? 0x7FFFu : 0x7FFFFFFFu);
    if constexpr (COL) col_key[e / lanes<Key>()] = max(col_key[e / lanes<Key>()], key);
    m = max(m, key);
  }
  return m;
}

// The fold of blocks [b0 + Q0, b0 + Q0 + N) of a group (fold_tree's tree, as values: the blocks' keys and the folds
// stay in registers; the tree over an array of the group's block keys went through the stack, 0.4 of 1.9 ms per
// 4096^2 of the scale pass at avx512, 1 thread, x in L1). Blocks at or past `blocks` are +0.
template <int Q0, int N, bool FULL, bool COL, bool BF16, typename Key, typename Elem>
ENGINE_VEC_INLINE Key fold_blocks(const Elem* __restrict px, int64_t b0, int64_t blocks, int64_t w,
                                  Key* __restrict col_key) {
  if constexpr (N == 1) {
    if (!FULL && b0 + Q0 >= blocks) return Key{};
    return block_keys<FULL, COL, BF16, Key>(px, b0 + Q0, w, col_key);
  } else {
    constexpr int C = lanes<Key>() / (N / 2);  // lanes per block of each half's fold
    const Key a = fold_blocks<Q0, N / 2, FULL, COL, BF16, Key>(px, b0, blocks, w, col_key);
    const Key b = fold_blocks<Q0 + N / 2, N / 2, FULL, COL, BF16, Key>(px, b0, blocks, w, col_key);
    return fold_pair<C>(a, b, std::make_index_sequence<lanes<Key>()>{});
  }
}

// The fold of group g's kLanes blocks of the row at px.
template <bool FULL, bool COL, bool BF16, typename Key, typename Elem>
ENGINE_VEC_INLINE Key group_fold(const Elem* __restrict px, int64_t g, int64_t blocks, int64_t w,
                                 Key* __restrict col_key) {
  return fold_blocks<0, kLanes, FULL, COL, BF16, Key>(px, kLanes * g, blocks, w, col_key);
}

// The even (H = 0) or odd (H = 1) lanes of a:b.
template <int H, typename V, size_t... I>
ENGINE_VEC_INLINE V deinterleave(V a, V b, std::index_sequence<I...>) {
  return __builtin_shufflevector(a, b, (2 * static_cast<int>(I) + H)...);
}
template <int H, typename V>
ENGINE_VEC_INLINE V deinterleave(V a, V b) {
  return deinterleave<H>(a, b, std::make_index_sequence<lanes<V>()>{});
}

// 16 u32 lanes (kChunks vectors) -> 16 u16 lanes (the low halves).
ENGINE_VEC_INLINE u16x16 narrow16(const u32v* q) {
#if ENGINE_ISA_LEVEL >= 2
  return convert<u16x16>(q[0]);
#elif ENGINE_ISA_LEVEL == 1
  const u16x8 a = convert<u16x8>(q[0]), b = convert<u16x8>(q[1]);
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const u16x4 a = convert<u16x4>(q[0]), b = convert<u16x4>(q[1]), c = convert<u16x4>(q[2]), d = convert<u16x4>(q[3]);
  const u16x8 ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7);
  const u16x8 cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7);
  return __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
}

// ------------------------------------------------------------------------------------ loads and stores
// A chunk: the 2 * kLanes elements [i, i + n) of x (the rest read as +0) as fp32 in pair order, even (lane j:
// element 2j) and odd (element 2j + 1): a bf16 pair splits with a shift and a mask, and a pair of E2M1 codes
// is a byte.
template <bool BF16>
ENGINE_VEC_INLINE void load_chunk(const void* x, int64_t i, int64_t n, f32v& even, f32v& odd) {
  if constexpr (BF16) {
    const u32v w = bits<u32v>(load_first<u16v>(static_cast<const uint16_t*>(x) + i, n));
    even = bits<f32v>(w << 16);
    odd = bits<f32v>(w & 0xFFFF0000u);
  } else {
    const float* p = static_cast<const float*>(x) + i;
    const f32v a = load_first<f32v>(p, n), b = load_first<f32v>(p + kLanes, n - kLanes);
    even = deinterleave<0>(a, b);
    odd = deinterleave<1>(a, b);
  }
}

// The codes of a pair (lane j: elements 2j, 2j + 1) in the low 8 (E2M1) or 16 (FP6) bits of a lane.
template <typename F>
constexpr int kPairShift = F::kBits == 4 ? 4 : 8;
template <typename F>
ENGINE_VEC_INLINE u32v pair_codes(u32v even, u32v odd) {
  return even | (odd << kPairShift<F>);
}

// One block's pair codes (kChunks vectors) -> dst, the bytes of its first n elements. At AVX2 the bytes are
// gathered with one two-input byte shuffle (GCC: two vpshufb, an or and a vpermq) and a whole block is one plain
// store: narrow16's two narrowing conversions and store_first's copy through the stack took 40% of the E2M1 cast
// pass (avx2, 1 thread, bf16 x in L2, ms per 4096^2: E2M1 rowwise 4.35 -> 3.84, both usages 6.28 -> 5.81).
template <typename F>
ENGINE_VEC_INLINE void store_block(uint8_t* dst, const u32v* q, int64_t n) {
  if constexpr (F::kBits == 4) {
#if ENGINE_ISA_LEVEL >= 2
    const u8x16 b = convert<u8x16>(q[0]);  // one narrowing, not two
    if (n >= kBlock) {
      store(dst, b);  // (store_first's copy through the stack stays off the path of whole blocks)
    } else {
      store_first(dst, b, (n + 1) / 2);
    }
#elif ENGINE_ISA_LEVEL == 1
    const u8x16 b = __builtin_shufflevector(bits<u8x32>(q[0]), bits<u8x32>(q[1]), 0, 4, 8, 12, 16, 20, 24, 28, 32,
                                            36, 40, 44, 48, 52, 56, 60);  // byte 0 of each lane
    if (n >= kBlock) {
      store(dst, b);
    } else {
      store_first(dst, b, (n + 1) / 2);
    }
#else
    store_first(dst, convert<u8x16>(narrow16(q)), (n + 1) / 2);
#endif
  } else {
#if ENGINE_ISA_LEVEL == 1
    const u8x32 b = __builtin_shufflevector(bits<u8x32>(q[0]), bits<u8x32>(q[1]), 0, 1, 4, 5, 8, 9, 12, 13, 16, 17,
                                            20, 21, 24, 25, 28, 29, 32, 33, 36, 37, 40, 41, 44, 45, 48, 49, 52, 53,
                                            56, 57, 60, 61);  // bytes 0 and 1 of each lane
    if (n >= kBlock) {
      store(dst, b);
    } else {
      store_first(dst, b, n);
    }
#else
    const u8x32 b = bits<u8x32>(narrow16(q));
    if (n >= kBlock) {
      store(dst, b);
    } else {
      store_first(dst, b, n);
    }
#endif
  }
}

// ------------------------------------------------------------------------------------ a segment
constexpr int64_t kSegCols = 16 * kTileCols;  // bf16: 256 KiB of x per segment (fp32 takes half as many columns)

template <bool BF16>
constexpr int64_t seg_cols() {
  return BF16 ? kSegCols : kSegCols / 2;
}

// Scratch of one segment, on the stack of the thread that runs it.
struct Segment {
  alignas(64) uint8_t col_key[2 * kSegCols];               // running column maxima: bf16 or fp32 keys
  alignas(64) float col_even[kSegCols / 2];                // column multipliers in pair order: chunk k's
  alignas(64) float col_odd[kSegCols / 2];                 //   at [kLanes k, kLanes (k + 1))
  alignas(64) float row_scale[kBlock][kSegCols / kBlock];  // [row][block] multipliers
  // kneg of each multiplier, for the lookup: g = max(x's exponent field - kneg, 0) (see field_offsets)
  alignas(64) uint32_t col_kneg[kSegCols / 2];                // pair order: even column low half, odd high half
  alignas(64) uint32_t row_kneg[kBlock][kSegCols / kBlock];   // in both halves
};

// kneg = code - 127 + emin's field: with |x| * 2^(127 - code) normal, its exponent field minus emin's is
// x's field minus kneg. Valid (the fast path's lookup) where code >= 127 - emin's field, or the block is all
// zeros: a zero or subnormal x (field 0) then gives g = 0, right for |x| * s below 2^(emin + 1).
template <typename F>
ENGINE_VEC_INLINE i32v field_offsets(u32v code) {
  return max(bits<i32v>(code) - static_cast<int32_t>(127 - F::kMinField), splat<i32v>(0));
}

// Pass 1: rows [r0, r1) x w columns from c0 -> both usages' scale codes (written) and multipliers (in seg).
// Returns whether a scale code is 254 or 255 (an inf or NaN amax, or RCEIL's of one at or above 2^127 max);
// *lookup: whether the fast path may look M up (field_offsets).
template <typename F, bool BF16, bool RCEIL>
bool scale_pass(const MxSmallJob& job, Segment& seg, int64_t r0, int64_t r1, int64_t c0, int64_t w, bool* lookup) {
  using Key = std::conditional_t<BF16, u16v, u32v>;  // one vector of keys (bf16: 16-bit)
  constexpr int kPerBlock = kBlock / lanes<Key>();    // key vectors per block
  const int64_t K = job.K, ld = job.ld, nb = (K + kBlock - 1) / kBlock;
  const int64_t blocks = (w + kBlock - 1) / kBlock, groups = (blocks + kLanes - 1) / kLanes;
  const bool row = job.row_data != nullptr, col = job.col_data != nullptr;
  Key* col_key = reinterpret_cast<Key*>(seg.col_key);
  u32v top{};  // the largest scale code per lane
  i32v low{};  // lanes with a nonzero block whose code is below 127 - emin's field (no lookup: see field_offsets)
  constexpr uint32_t kLowest = 127 - F::kMinField;
  if (col) {
    for (int64_t j = 0; j < blocks * kPerBlock; ++j) col_key[j] = Key{};
  }
  using Elem = std::conditional_t<BF16, uint16_t, uint32_t>;
  const int64_t full_groups = w / (kLanes * kBlock);
  for (int64_t r = r0; r < r1; ++r) {
    const Elem* px = static_cast<const Elem*>(job.x) + r * ld + c0;
    for (int64_t g = 0; g < groups; ++g) {
      Key last;
      if (g < full_groups) {
        last = col ? group_fold<true, true, BF16>(px, g, blocks, w, col_key)
                   : group_fold<true, false, BF16>(px, g, blocks, w, col_key);
      } else {
        last = col ? group_fold<false, true, BF16>(px, g, blocks, w, col_key)
                   : group_fold<false, false, BF16>(px, g, blocks, w, col_key);
      }
      if (row) {
        const u32v key = finish_blocks<Key>(last), code = scale_codes<F, RCEIL>(key);
        top = max(top, code);
        if constexpr (kLowest > 0) low |= (code < kLowest) & (key != 0u);
        store(&seg.row_scale[r - r0][kLanes * g], element_scales(code));
        const u32v kneg = bits<u32v>(field_offsets<F>(code));
        store(&seg.row_kneg[r - r0][kLanes * g], kneg | (kneg << 16));
        uint8_t* codes = job.row_codes + r * nb + c0 / kBlock + kLanes * g;
        for (int q = 0; q < kLanes && kLanes * g + q < blocks; ++q) codes[q] = static_cast<uint8_t>(code[q]);
      }
    }
  }
  if (col) {
    uint8_t* codes = job.col_codes + (r0 / kBlock) * K + c0;
    for (int64_t k = 0; 2 * kLanes * k < w; ++k) {  // chunks of 2 * kLanes columns
      u32v key[2];
      if constexpr (BF16) {
        const u32v pairs = bits<u32v>(col_key[k]);
        key[0] = pairs << 16;
        key[1] = pairs & 0xFFFF0000u;
      } else {
        key[0] = deinterleave<0>(col_key[2 * k], col_key[2 * k + 1]);
        key[1] = deinterleave<1>(col_key[2 * k], col_key[2 * k + 1]);
      }
      const u32v even = scale_codes<F, RCEIL>(key[0]), odd = scale_codes<F, RCEIL>(key[1]);
      top = max(top, max(even, odd));
      if constexpr (kLowest > 0) low |= ((even < kLowest) & (key[0] != 0u)) | ((odd < kLowest) & (key[1] != 0u));
      store(&seg.col_even[kLanes * k], element_scales(even));
      store(&seg.col_odd[kLanes * k], element_scales(odd));
      store(&seg.col_kneg[kLanes * k], bits<u32v>(field_offsets<F>(even)) | (bits<u32v>(field_offsets<F>(odd)) << 16));
      const int64_t c = 2 * kLanes * k;
      for (int j = 0; j < kLanes && c + 2 * j < w; ++j) {
        codes[c + 2 * j] = static_cast<uint8_t>(even[j]);
        if (c + 2 * j + 1 < w) codes[c + 2 * j + 1] = static_cast<uint8_t>(odd[j]);
      }
    }
  }
  *lookup = kLookup && reduce_max(bits<u32v>(low)) == 0;
  return reduce_max(top) >= 254u;
}

// Pass 2: rows [r0, r1) x w columns from c0 cast with the multipliers of seg, for the usages asked for (ROW,
// COL); `next` (nonzero): the element offset of the next segment, whose rows are prefetched. FAST: no scale code
// of the segment is 254 or 255 (encode_finite; SAT: FLOOR scales).
template <typename F, bool BF16, bool ROW, bool COL, bool FAST, bool SAT, bool LOOKUP>
void cast_pass(const MxSmallJob& job, const Segment& seg, int64_t r0, int64_t r1, int64_t c0, int64_t w,
               int64_t next) {
  constexpr bool kPacked = F::kBits == 4;
  constexpr int64_t kOut = kPacked ? kBlock / 2 : kBlock;  // bytes of one block's codes
  constexpr uint32_t kSign = 1u << (F::kBits - 1);
  const int64_t K = job.K, ld = job.ld, kp = kPacked ? (K + 1) / 2 : K, blocks = (w + kBlock - 1) / kBlock;
  const int64_t data_col = kPacked ? c0 / 2 : c0;
  const u32v table = magic_table<F>();
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t base = r * ld + c0, out = r * kp + data_col;
    const float* row_scale = seg.row_scale[r - r0];
    const uint32_t* row_kneg = seg.row_kneg[r - r0];
    for (int64_t b = 0; b < blocks; ++b) {
      if (next) {
        const char* p = static_cast<const char*>(job.x) + (base + next + kBlock * b) * (BF16 ? 2 : 4);
        for (int l = 0; l < (BF16 ? 64 : 128); l += 64) __builtin_prefetch(p + l, 0, 2);
      }
      u32v row_q[kChunks], col_q[kChunks];
      const f32v s = splat<f32v>(row_scale[b]);
      for (int k = 0; k < kChunks; ++k) {
        const int64_t e = kBlock * b + 2 * kLanes * k;
        const f32v se = load<f32v>(&seg.col_even[e / 2]), so = load<f32v>(&seg.col_odd[e / 2]);
        f32v even, odd;
        if constexpr (FAST) {
          u32v signs;  // x's sign bits at the code's sign bit in the lane of pair_codes
          if constexpr (BF16) {  // split |x| and the sign bits once for the pair
            const u32v raw = bits<u32v>(load_first<u16v>(static_cast<const uint16_t*>(job.x) + base + e, w - e));
            const u32v t = raw & 0x80008000u, abs_pair = raw & 0x7FFF7FFFu;
            even = bits<f32v>(abs_pair << 16);
            odd = bits<f32v>(abs_pair & 0xFFFF0000u);
            signs = (t >> (16 - F::kBits)) | (t >> (32 - F::kBits - kPairShift<F>));  // others drop in store_block
            if constexpr (LOOKUP) {  // g of 2 * kLanes elements at once, in 16-bit lanes
              const u16v field = bits<u16v>(abs_pair) >> 7;
              if constexpr (ROW) {
                const u16v kneg = bits<u16v>(splat<u32v>(row_kneg[b])), g = field - min(field, kneg);
                const u32v g32 = bits<u32v>(g);
                row_q[k] = pair_codes<F>(encode_lookup<F, SAT>(even, s, table, g32),
                                         encode_lookup<F, SAT>(odd, s, table, g32 >> 16)) | signs;
              }
              if constexpr (COL) {
                const u16v kneg = load<u16v>(&seg.col_kneg[e / 2]), g = field - min(field, kneg);
                const u32v g32 = bits<u32v>(g);
                col_q[k] = pair_codes<F>(encode_lookup<F, SAT>(even, se, table, g32),
                                         encode_lookup<F, SAT>(odd, so, table, g32 >> 16)) | signs;
              }
              continue;
            }
          } else {
            load_chunk<BF16>(job.x, base + e, w - e, even, odd);
            signs = pair_codes<F>((bits<u32v>(even) >> (32 - F::kBits)) & kSign,
                                  (bits<u32v>(odd) >> (32 - F::kBits)) & kSign);
            even = bits<f32v>(bits<u32v>(even) & 0x7FFFFFFFu);
            odd = bits<f32v>(bits<u32v>(odd) & 0x7FFFFFFFu);
          }
          if constexpr (ROW) {
            row_q[k] = pair_codes<F>(encode_finite<F, SAT>(even, s), encode_finite<F, SAT>(odd, s)) | signs;
          }
          if constexpr (COL) {
            col_q[k] = pair_codes<F>(encode_finite<F, SAT>(even, se), encode_finite<F, SAT>(odd, so)) | signs;
          }
        } else {
          load_chunk<BF16>(job.x, base + e, w - e, even, odd);
          if constexpr (ROW) row_q[k] = pair_codes<F>(encode<F>(even * s), encode<F>(odd * s));
          if constexpr (COL) col_q[k] = pair_codes<F>(encode<F>(even * se), encode<F>(odd * so));
        }
      }
      const int64_t n = w - kBlock * b;
      if constexpr (ROW) store_block<F>(job.row_data + out + kOut * b, row_q, n);
      if constexpr (COL) store_block<F>(job.col_data + out + kOut * b, col_q, n);
    }
  }
}

template <typename F, bool BF16, bool FAST, bool SAT, bool LOOKUP>
void cast_usages(const MxSmallJob& job, const Segment& seg, int64_t r0, int64_t r1, int64_t c0, int64_t w,
                 int64_t next) {
  if (job.row_data && job.col_data) {
    cast_pass<F, BF16, true, true, FAST, SAT, LOOKUP>(job, seg, r0, r1, c0, w, next);
  } else if (job.row_data) {
    cast_pass<F, BF16, true, false, FAST, SAT, LOOKUP>(job, seg, r0, r1, c0, w, next);
  } else {
    cast_pass<F, BF16, false, true, FAST, SAT, LOOKUP>(job, seg, r0, r1, c0, w, next);
  }
}

template <typename F, bool BF16, bool RCEIL>
void segment(const MxSmallJob& job, Segment& seg, int64_t r0, int64_t r1, int64_t c0, int64_t c1, int64_t next) {
  bool lookup = false;
  const bool special = scale_pass<F, BF16, RCEIL>(job, seg, r0, r1, c0, c1 - c0, &lookup);
  if (special) {
    cast_usages<F, BF16, false, false, false>(job, seg, r0, r1, c0, c1 - c0, next);
  } else if (BF16 && kLookup && lookup) {
    cast_usages<F, BF16, true, !RCEIL, true>(job, seg, r0, r1, c0, c1 - c0, next);
  } else {
    cast_usages<F, BF16, true, !RCEIL, false>(job, seg, r0, r1, c0, c1 - c0, next);
  }
}

// Tile u of the job's grid of ceil(M/32) x ceil(K/256) tiles: rows [r0, r1), columns [c0, c1).
struct TileBounds {
  int64_t r0, r1, c0, c1;
};

TileBounds tile_bounds(const MxSmallJob& job, int64_t u) {
  const int64_t col_tiles = (job.K + kTileCols - 1) / kTileCols;
  const int64_t r0 = (u / col_tiles) * kBlock, c0 = (u % col_tiles) * kTileCols;
  return {r0, std::min(r0 + kBlock, job.M), c0, std::min(c0 + kTileCols, job.K)};
}

// Tiles [u0, u1) as segments: runs of tiles of one strip, at most seg_cols wide.
template <typename F, bool BF16, bool RCEIL>
void tiles(const MxSmallJob& job, int64_t u0, int64_t u1) {
  constexpr int64_t kTilesPerSeg = seg_cols<BF16>() / kTileCols;
  Segment seg;
  for (int64_t u = u0; u < u1;) {
    const TileBounds first = tile_bounds(job, u);
    int64_t v = u + 1;
    TileBounds last = first;
    while (v < u1 && v - u < kTilesPerSeg) {
      const TileBounds t = tile_bounds(job, v);
      if (t.r0 != first.r0) break;
      last = t;
      ++v;
    }
    // element offset of the next segment's start when this thread has one of as many rows (its lines are
    // prefetched at this segment's offsets: past a narrower one's end, harmlessly)
    int64_t next = 0;
    if (v < u1) {
      const TileBounds t = tile_bounds(job, v);
      if (t.r1 - t.r0 == first.r1 - first.r0) next = (t.r0 - first.r0) * job.ld + (t.c0 - first.c0);
    }
    segment<F, BF16, RCEIL>(job, seg, first.r0, first.r1, first.c0, last.c1, next);
    u = v;
  }
}

template <typename F>
void tiles_for(const MxSmallJob& job, int64_t u0, int64_t u1) {
  if (job.bf16) {
    return job.rceil ? tiles<F, true, true>(job, u0, u1) : tiles<F, true, false>(job, u0, u1);
  }
  return job.rceil ? tiles<F, false, true>(job, u0, u1) : tiles<F, false, false>(job, u0, u1);
}

void quantize_tiles(const MxSmallJob& job, int64_t u0, int64_t u1) {
  switch (job.kind) {
    case 0: return tiles_for<E2M1>(job, u0, u1);
    case 1: return tiles_for<E2M3>(job, u0, u1);
    default: return tiles_for<E3M2>(job, u0, u1);
  }
}

// ------------------------------------------------------------------------------------ decode
// bf16 bits of an element code: exact (at most 4 significant bits), the sign kept on zero.
uint16_t bf16_of_code(uint32_t code, int eb, int mb, int bias) {
  const uint32_t sign = (code >> (eb + mb)) & 1u;
  const uint32_t exponent = (code >> mb) & ((1u << eb) - 1u), mantissa = code & ((1u << mb) - 1u);
  const float value = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), 1 - bias - mb)
                                    : std::ldexp(static_cast<float>((1u << mb) | mantissa),
                                                 static_cast<int>(exponent) - bias - mb);
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  return static_cast<uint16_t>((bits >> 16) | (sign << 15));
}

void decode_rows(const uint8_t* in, int64_t in_stride, uint16_t* out, int64_t cols, int kind, int64_t r0,
                 int64_t r1) {
  static constexpr int kFormat[3][3] = {{2, 1, 1}, {2, 3, 1}, {3, 2, 3}};  // exponent bits, mantissa bits, bias
  const int* f = kFormat[kind];
  const uint32_t code_mask = (1u << (1 + f[0] + f[1])) - 1u;
  uint16_t table[256];
  for (uint32_t c = 0; c < 256; ++c) table[c] = bf16_of_code(c & code_mask, f[0], f[1], f[2]);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* i = in + r * in_stride;
    uint16_t* o = out + r * cols;
    if (kind == 0) {
      const int64_t pairs = cols / 2;
      for (int64_t p = 0; p < pairs; ++p) {
        o[2 * p] = table[i[p] & 15];
        o[2 * p + 1] = table[i[p] >> 4];
      }
      if (cols % 2) o[cols - 1] = table[i[pairs] & 15];
    } else {
      for (int64_t c = 0; c < cols; ++c) o[c] = table[i[c]];
    }
  }
}

}  // namespace

const MxSmallKernels& mx_small_kernels() {
  static const MxSmallKernels table{&quantize_tiles, &decode_rows};
  return table;
}

}  // namespace ENGINE_ISA_NS
}  // namespace engine_native
