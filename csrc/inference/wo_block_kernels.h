// Weight-only GEMMs of block-scaled float weights (WoKernels::block_rows): MX (E2M1, E2M3, E3M2, E4M3 elements,
// 1x32 blocks, E8M0 scales) and NVFP4 (E2M1, 1x16 blocks, E4M3 scales times amax * fp32(1 / (6 * 448))). Part of
// every variant of wo_gemm_kernels.cpp (included from there only): one source for every level.
//
// Each weight element is decoded in registers to the reference's fp32 value, element * block scale, one IEEE
// fp32 multiplication (NVFP4: q * ((s_b * amax) * factor), engine/ops/nvfp4.py; MX: element * 2^(e - 127),
// engine/ops/reference.py), and multiply-added into fp32 sums: the plain fp32 formula up to the order of the
// fp32 additions (wo_gemm.h). NaN and inf follow IEEE (0 * inf is a NaN, as in the reference).
//   E2M1: a vector is L codes of one block (L <= 16 <= the block), from L/2 bytes: lanes [0, L/2) the low
//         nibbles, [L/2, L) the high ones (x is packed in that order). Per block and row a 16-entry table holds
//         fp32(value(c) * scale) for every code c (one vector multiplication: the products the reference makes),
//         and a variable shuffle looks the codes up (one vpermps at AVX-512; at AVX2 one vpermps of the 8
//         magnitudes and the sign by an XOR).
//   E2M3 / E3M2 / E4M3 (a byte per element): the int8 kernel's blocks and x order, each code decoded
//         arithmetically (its bits placed under an fp32 exponent, times 2^(127 - bias): exact), times the block's
//         scale (a power of two: exact, as in the reference).
// Elements past the last whole vector (K not a multiple of L, or of 4L for bytes) are summed by scalar code.
#pragma once

namespace engine_native {
namespace ENGINE_ISA_NS {
namespace {

constexpr float kE2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                             -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// Every lane = s, one broadcast (wo_gemm_kernels.cpp's splat, a loop over lanes, became 16 masked broadcasts
// at AVX-512); s - 0 keeps -0.
WO_INLINE fv bcast(float s) { return s - fv{}; }

WO_INLINE float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// E4M3 code -> its value (NaN for S.1111.111), as e4m3_value.
WO_INLINE float e4m3_scalar(uint32_t code) {
  const uint32_t mag = code & 0x7Fu;
  if (mag == 0x7Fu) return bits_float(0x7FC00000u);
  return bits_float(((code & 0x80u) << 24) | (mag << 20)) * 1.329227995784916e36f;  // 2^120
}

// A block's fp32 scale: E8M0 2^(e - 127) (e = 0: the subnormal 2^-127; 255: NaN), or NVFP4's (s_b * amax) * factor.
WO_INLINE float block_scale(const WoBlockJob& job, uint8_t code) {
  if (job.nvfp4) return (e4m3_scalar(code) * job.amax) * job.factor;
  if (code == 255) return bits_float(0x7FC00000u);
  return bits_float(code == 0 ? 0x00400000u : static_cast<uint32_t>(code) << 23);
}

// Element codes (one per lane, bits above the code's ignored) -> their exact values.
template <int KIND>
WO_INLINE fv element_value(uv code) {
  if (KIND == kWoE4M3) return e4m3_value(code & 0xFFu);
  constexpr int shift = KIND == kWoE2M3 ? 20 : 21;                             // mantissa bits 3 / 2
  constexpr float bias = KIND == kWoE2M3 ? 8.507059173023462e37f : 2.126764793255866e37f;  // 2^126 / 2^124
  const uv bits = ((code & 0x20u) << 26) | ((code & 0x1Fu) << shift);
  return reinterpret_cast<const fv&>(bits) * bcast(bias);
}

WO_INLINE float element_scalar(int kind, uint32_t code) {
  switch (kind) {
    case kWoE2M1: return kE2M1[code & 15u];
    case kWoE4M3: return e4m3_scalar(code & 0xFFu);
    case kWoE2M3: return bits_float(((code & 0x20u) << 26) | ((code & 0x1Fu) << 20)) * 8.507059173023462e37f;
    default: return bits_float(((code & 0x20u) << 26) | ((code & 0x1Fu) << 21)) * 2.126764793255866e37f;
  }
}

// The elements past the vector part (k >= job.kv) of row n against x row m: fp32 sums in k order.
WO_INLINE float block_tail(const WoBlockJob& job, int64_t m, int64_t n, float sum) {
  const uint8_t* w = job.w + n * job.w_ld;
  const uint8_t* sc = job.scale + n * job.scale_ld;
  const float* x = job.xraw + m * job.K;
  for (int64_t k = job.kv; k < job.K; ++k) {
    const uint32_t code = job.kind == kWoE2M1 ? (w[k / 2] >> (4 * (k % 2))) & 15u : w[k];
    sum += x[k] * (element_scalar(job.kind, code) * block_scale(job, sc[k / job.block]));
  }
  return sum;
}

// ------------------------------------------------------------------------------ E2M1
// The 16-entry table of a block: fp32(value(c) * s) for the codes c, in 16 / L vectors.
struct Fp4Table {
  fv t[16 / L];
};

WO_INLINE Fp4Table fp4_table(float s) {
  Fp4Table t;
  const fv sv = bcast(s);
  for (int i = 0; i < 16 / L; ++i) t.t[i] = load<fv>(kE2M1 + i * L) * sv;
  return t;
}

// The codes of the L/2 bytes at p: lane l < L/2 holds byte l, lane l >= L/2 byte l - L/2 shifted right by 4 (the
// lookup reads the low 4 bits). The widening by hand (vpmovzxbd, as widen_u8: GCC 12 goes byte by byte).
WO_INLINE uv fp4_indices(const uint8_t* p) {
  uv v;
#if ENGINE_ISA_LEVEL == 2 && defined(__x86_64__)
  int64_t bytes;
  std::memcpy(&bytes, p, 8);
  v = reinterpret_cast<uv>(_mm512_cvtepu8_epi32(_mm_set1_epi64x(bytes)));
#elif ENGINE_ISA_LEVEL == 1 && defined(__x86_64__)
  int32_t bytes;
  std::memcpy(&bytes, p, 4);
  v = reinterpret_cast<uv>(_mm256_cvtepu8_epi32(_mm_set1_epi32(bytes)));
#else
  for (int l = 0; l < L; ++l) v[l] = p[l % (L / 2)];
#endif
  uv shift;
  for (int l = 0; l < L; ++l) shift[l] = l < L / 2 ? 0u : 4u;
  return v >> shift;
}

WO_INLINE fv fp4_lookup(const Fp4Table& t, uv idx) {
#if ENGINE_ISA_LEVEL == 2 && defined(__x86_64__)
  return __builtin_shuffle(t.t[0], idx);  // vpermps: the low 4 bits of each index
#elif ENGINE_ISA_LEVEL == 1 && defined(__x86_64__)
  // the magnitude from the table's first 8 entries (one vpermps), the sign (the code's bit 3) put back by an
  // XOR: fp32(-q * s) = -fp32(q * s) exactly (the 16-entry lookup, two vpermps and a blend, was slower)
  const fv mag = __builtin_shuffle(t.t[0], idx & 7u);
  const uv bits = reinterpret_cast<const uv&>(mag) ^ ((idx << 28) & 0x80000000u);
  return reinterpret_cast<const fv&>(bits);
#else
  const float* f = reinterpret_cast<const float*>(t.t);
  fv r;
  for (int l = 0; l < L; ++l) r[l] = f[idx[l] & 15u];
  return r;
#endif
}

// x [M, K] -> out [M, ldx] (ldx = kv, a multiple of L): per L k's, the even ones, then the odd ones.
void fp4_pack_x(const float* x, int64_t M, int64_t K, float* out, int64_t ldx) {
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k0 = 0; k0 < ldx; k0 += L) {
      for (int l = 0; l < L; ++l) {
        out[m * ldx + k0 + l] = x[m * K + k0 + (l < L / 2 ? 2 * l : 2 * (l - L / 2) + 1)];
      }
    }
  }
}

template <int BS, int MB, int NR>
void fp4_tile(const WoBlockJob& job, int64_t m0, int64_t n0) {
  static_assert(BS % L == 0, "a vector within one block");
  const int64_t kv = job.kv, ldx = job.ldx;
  const uint8_t* w[NR];
  const uint8_t* sc[NR];
  for (int r = 0; r < NR; ++r) {
    w[r] = job.w + (n0 + r) * job.w_ld;
    sc[r] = job.scale + (n0 + r) * job.scale_ld;
  }
  const float* x = job.x + m0 * ldx;
  fv acc[MB][NR];
  for (int m = 0; m < MB; ++m) {
    for (int r = 0; r < NR; ++r) acc[m][r] = fv{};
  }
  const auto step = [&](int64_t k0, const Fp4Table* t) __attribute__((always_inline)) {
    fv wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = fp4_lookup(t[r], fp4_indices(w[r] + k0 / 2));
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const fv xv = load<fv>(x + m * ldx + k0);
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) acc[m][r] = madd(xv, wv[r], acc[m][r]);
    }
  };
  int64_t b0 = 0;
  for (; b0 + BS <= kv; b0 += BS) {  // whole blocks
    Fp4Table t[NR];
    for (int r = 0; r < NR; ++r) {
      if (b0 % 128 == 0) prefetch(w[r] + b0 / 2);
      t[r] = fp4_table(block_scale(job, sc[r][b0 / BS]));
    }
#pragma GCC unroll 4
    for (int i = 0; i < BS / L; ++i) step(b0 + i * L, t);
  }
  if (b0 < kv) {  // the vectors of a last, partial block
    Fp4Table t[NR];
    for (int r = 0; r < NR; ++r) t[r] = fp4_table(block_scale(job, sc[r][b0 / BS]));
    for (int64_t k0 = b0; k0 < kv; k0 += L) step(k0, t);
  }
  for (int m = 0; m < MB; ++m) {
    for (int r = 0; r < NR; ++r) {
      job.y[(m0 + m) * job.ldy + n0 + r] = block_tail(job, m0 + m, n0 + r, reduce_add(acc[m][r]));
    }
  }
}

// ------------------------------------------------------------------------------ a byte per element (block 32)
template <int KIND, int MB, int NR>
void byte_elem_tile(const WoBlockJob& job, int64_t m0, int64_t n0) {
  constexpr int kBlocks = (kInt8Block + 31) / 32;  // blocks a step of 4L bytes touches (2 at AVX-512)
  const int64_t kv = job.kv, ldx = job.ldx;
  const uint8_t* w[NR];
  const uint8_t* sc[NR];
  for (int r = 0; r < NR; ++r) {
    w[r] = job.w + (n0 + r) * job.w_ld;
    sc[r] = job.scale + (n0 + r) * job.scale_ld;
  }
  const float* x = job.x + m0 * ldx;
  fv acc[MB][NR];
  for (int m = 0; m < MB; ++m) {
    for (int r = 0; r < NR; ++r) acc[m][r] = fv{};
  }
  for (int64_t k = 0; k < kv; k += kInt8Block) {
    fv s[NR][kBlocks];
    for (int r = 0; r < NR; ++r) {
      if (k % 64 == 0) prefetch(w[r] + k);
      for (int b = 0; b < kBlocks; ++b) s[r][b] = bcast(block_scale(job, sc[r][k / 32 + b]));
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      fv wv[NR];
      for (int r = 0; r < NR; ++r) {
#ifdef WO_INT8_WIDEN
        const uv code = widen_u8(reinterpret_cast<const int8_t*>(w[r] + k + j * L));
        const int b = j * L / 32;  // x in natural order: vector j holds bytes jL..jL+L-1
#else
        const uv code = (load<uv>(w[r] + k) << (24 - 8 * j)) >> 24;
        const int b = 0;  // vector j holds byte j of each word: 4L = 16 bytes, within one block
#endif
        wv[r] = element_value<KIND>(code) * s[r][b];
      }
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        const fv xv = load<fv>(x + m * ldx + k + j * L);
#pragma GCC unroll 4
        for (int r = 0; r < NR; ++r) acc[m][r] = madd(xv, wv[r], acc[m][r]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int r = 0; r < NR; ++r) {
      job.y[(m0 + m) * job.ldy + n0 + r] = block_tail(job, m0 + m, n0 + r, reduce_add(acc[m][r]));
    }
  }
}

// ------------------------------------------------------------------------------ tiling
template <int BS>
struct Fp4Tile {
  template <int MB, int NR>
  static void run(const WoBlockJob& job, int64_t m0, int64_t n0) { fp4_tile<BS, MB, NR>(job, m0, n0); }
};
template <int KIND>
struct ByteTile {
  template <int MB, int NR>
  static void run(const WoBlockJob& job, int64_t m0, int64_t n0) { byte_elem_tile<KIND, MB, NR>(job, m0, n0); }
};

// Rows [n0, n1) for the rows of x in `job`: 4 weight rows per tile at M = 1, else 2 over blocks of x rows.
template <typename T>
void block_panel(const WoBlockJob& job, int64_t n0, int64_t n1) {
  const auto two = [](auto mb, const WoBlockJob& j, int64_t m, int64_t n) { T::template run<decltype(mb)::value, 2>(j, m, n); };
  const auto one = [](auto mb, const WoBlockJob& j, int64_t m, int64_t n) { T::template run<decltype(mb)::value, 1>(j, m, n); };
  int64_t n = n0;
  if (job.M == 1) {
    for (; n + 4 <= n1; n += 4) T::template run<1, 4>(job, 0, n);
  } else {
    for (; n + 2 <= n1; n += 2) all_m<2>(job, n, two);
  }
  for (; n < n1; ++n) all_m<1>(job, n, one);
}

// Panels of the rows of x that fit in ~256 KiB, each over all of [n0, n1) (as by_panels).
template <typename T>
void block_panels(const WoBlockJob& job, int64_t n0, int64_t n1) {
  const int64_t panel = std::max<int64_t>(4, (int64_t{256} << 10) / std::max<int64_t>(1, job.ldx * 4) / 4 * 4);
  for (int64_t m0 = 0; m0 < job.M; m0 += panel) {
    WoBlockJob part = job;
    part.M = std::min(panel, job.M - m0);
    part.x = job.x + m0 * job.ldx;
    part.xraw = job.xraw + m0 * job.K;
    part.y = job.y + m0 * job.ldy;
    block_panel<T>(part, n0, n1);
  }
}

void block_rows(const WoBlockJob& job, int64_t n0, int64_t n1) {
  switch (job.kind) {
    case kWoE2M1: return job.block == 16 ? block_panels<Fp4Tile<16>>(job, n0, n1) : block_panels<Fp4Tile<32>>(job, n0, n1);
    case kWoE2M3: return block_panels<ByteTile<kWoE2M3>>(job, n0, n1);
    case kWoE3M2: return block_panels<ByteTile<kWoE3M2>>(job, n0, n1);
    default: return block_panels<ByteTile<kWoE4M3>>(job, n0, n1);
  }
}

// The vector part of K (job.kv, = ldx) for an element kind, and x packed for it.
int64_t block_vector_k(int kind, int64_t K) {
  const int64_t step = kind == kWoE2M1 ? L : kInt8Block;
  return K / step * step;
}

void block_pack_x(int kind, const float* x, int64_t M, int64_t K, float* out, int64_t ldx) {
  if (kind == kWoE2M1) return fp4_pack_x(x, M, K, out, ldx);
  for (int64_t m = 0; m < M; ++m) {  // int8_pack_x's order over the vector part
    for (int64_t b = 0; b < ldx; b += kInt8Block) {
      for (int64_t i = 0; i < kInt8Block; ++i) out[m * ldx + b + int8_position(i)] = x[m * K + b + i];
    }
  }
}

}  // namespace
}  // namespace ENGINE_ISA_NS
}  // namespace engine_native
