// NVFP4 "4over6" tile kernels, bit for bit engine/ops/nvfp4_4over6.py (TE's reference order of fp32 operations):
//   S_enc = min((E * 6) / amax, FLT_MAX), a NaN staying NaN; 1 if that is 0; S_dec = 1 / S_enc
//   base  = (block_amax / 6) * S_enc;  s6 = e4m3(base), s4 = e4m3(base * 1.5)  (RNE, saturating at 448, NaN 0x7F)
//   enc_k = min(1 / (float(s_k) * S_dec), FLT_MAX), a NaN staying NaN;  q = e2m1(x * enc_k), the sign code iff < 0
//   err_k = (((0 + t_0) + t_1) + ...) + t_15 over the row of the block in order, t_i = |d_i| or d_i * d_i,
//           d_i = ((e2m1_value(q_i) * float(s_k)) * amax) / (6 * E) - x_i; 16x16 tiles: the 16 row errors by
//           the tree (r_i + r_{i+8}), (.. + .._{i+4}), (.. + .._{i+2}), c_0 + c_1
//   map-to-4 kept iff err_4 < err_6.
// Included by nvfp4_kernels.cpp inside its namespaces (it declares none): it uses that file's vectors, element
// rules and tiles. Blocks are processed kN (the native width) at a time, one per lane, their elements stored element-major
// (v[p * ld + lane]: element p of the block in lane `lane`, p in the order the errors are summed): a tile's
// columns are that already (the columnwise usage); the rowwise usage transposes each row's blocks first.

// A usage's per-tensor values.
struct Scale46 {
  float s_enc, s_dec, amax, denom;  // denom: 6 * E
};

inline Scale46 scale_46(float amax, float e4m3_max) {
  const float bound = e4m3_max * 6.0f;  // 2688 or 1536, exact
  float s = bound / amax;
  if (s == s) s = s < kFltMax ? s : kFltMax;  // torch.minimum: a NaN quotient stays NaN
  if (s == 0.0f) s = 1.0f;
  return {s, 1.0f / s, amax, bound};
}

// Both candidates of kN blocks, one per lane.
struct PairN {
  u32n s4, s6;      // E4M3 scale codes
  f32n err4, err6;  // errors (of the row of the block)
  u32n code4[16], code6[16];  // E2M1 codes of element p
};

// The code of element x under a candidate (factor enc, scale value sf), and its error term. The E2M1 rounding is
// e2m1_magnitude's sum c + M, whose low bits are the code and which minus M is the rounded magnitude (exact). The
// sign code is TE's reference rule: set iff x * enc < 0 (-0 and NaN give code 0). The error is taken on
// magnitudes, |((mag * sf) * amax) / (6E) - |x||: the same bits as with the signed value (round-to-nearest is
// symmetric; a product that underflows to -0 has magnitude 0, code 0, as TE's +0).
template <bool MSE>
ENGINE_VEC_INLINE f32n element46(f32n x, f32n ax, f32n enc, f32n sf, const Scale46& sc, u32n& code) {
  const f32n y = x * enc;
  const u32n mag = (u32n)y & 0x7FFFFFFFu;
  const u32n c = vec::select(mag < 0x40C00000u, mag, vec::splat<u32n>(0x40C00000u));  // min(|y|, 6); NaN: 6, code zeroed below
  const u32n field = vec::max(c >> 23, vec::splat<u32n>(127u));
  const f32n magic = (f32n)(((field + 22u) << 23) + ((field - 127u) << 1));
  const f32n rounded = (f32n)c + magic;
  code = (((u32n)rounded & 7u) | ((u32n)(y < 0.0f) & 8u)) & ~(u32n)(mag > 0x7F800000u);
  const f32n d = (((rounded - magic) * sf) * sc.amax) / sc.denom - ax;
  return MSE ? d * d : (f32n)((u32n)d & 0x7FFFFFFFu);
}

// Both candidates of kN blocks with amax keys `key` (|x| bits), their elements at v[p * ld] (p = 0..15): the errors
// summed in element order.
template <bool MSE>
ENGINE_VEC_INLINE void candidates(const float* __restrict v, int64_t ld, u32n key, const Scale46& sc, PairN& out) {
  const f32n base = ((f32n)key / 6.0f) * sc.s_enc;
  out.s4 = e4m3_code<f32n, u32n>(base * 1.5f);
  out.s6 = e4m3_code<f32n, u32n>(base);
  const f32n sf4 = e4m3_value<f32n, u32n>(out.s4), sf6 = e4m3_value<f32n, u32n>(out.s6);
  const f32n flt_max = vec::splat<f32n>(kFltMax);
  f32n enc4 = 1.0f / (sf4 * sc.s_dec), enc6 = 1.0f / (sf6 * sc.s_dec);
  enc4 = vec::select(enc4 > kFltMax, flt_max, enc4);  // a NaN stays NaN
  enc6 = vec::select(enc6 > kFltMax, flt_max, enc6);
  f32n err4 = {}, err6 = {};
#pragma GCC unroll 16
  for (int p = 0; p < 16; ++p) {
    const f32n x = vec::load<f32n>(v + p * ld);
    const f32n ax = (f32n)((u32n)x & 0x7FFFFFFFu);
    err4 = err4 + element46<MSE>(x, ax, enc4, sf4, sc, out.code4[p]);
    err6 = err6 + element46<MSE>(x, ax, enc6, sf6, sc, out.code6[p]);
  }
  out.err4 = err4;
  out.err6 = err6;
}

// TE's warp tree over 16 values: (r_i + r_{i+8}), then + 4, + 2, + 1 apart.
inline float tree16(const float* r, int64_t stride) {
  float a[8];
  for (int i = 0; i < 8; ++i) a[i] = r[i * stride] + r[(i + 8) * stride];
  for (int i = 0; i < 4; ++i) a[i] = a[i] + a[i + 4];
  for (int i = 0; i < 2; ++i) a[i] = a[i] + a[i + 2];
  return a[0] + a[1];
}

// The kept candidate of each lane (pick4: all-ones lanes keep map-to-4): scale codes, and the codes packed
// 8 bytes per lane (element 2i in the low nibble of byte i).
ENGINE_VEC_INLINE u32n keep(const PairN& c, u32n pick4, uint64_t* __restrict words) {
  u32n lo = {}, hi = {};
#pragma GCC unroll 8
  for (int p = 0; p < 8; ++p) {
    lo |= vec::select(pick4, c.code4[p], c.code6[p]) << static_cast<uint32_t>(4 * p);
    hi |= vec::select(pick4, c.code4[p + 8], c.code6[p + 8]) << static_cast<uint32_t>(4 * p);
  }
  vec::store(words, interleave_lo(lo, hi));  // little endian: lo[l] the low half of words[l]
  vec::store(words + kN / 2, interleave_hi(lo, hi));
  return vec::select(pick4, c.s4, c.s6);
}

// The rowwise usage of a tile: 1x16 blocks (or the 16x16 tiles' rows) of each row. Lane 8i + j: block j of row i.
template <bool MSE>
void rowwise_tile_46(const Nvfp4Job& job, const TileBox& b, const float (*__restrict t)[kT],
                     const uint32_t* __restrict tile_keys) {
  constexpr int64_t kBlocks = kT / kB, kLanes = kB * kBlocks;
  const Scale46 sc = scale_46(job.row_amax, job.e4m3_max);
  const int64_t K = job.K, nbk = (K + kB - 1) / kB, kp = (K + 1) / 2, blocks = (b.w + kB - 1) / kB;
  alignas(64) float v[kB][kLanes];  // element-major: v[p][8i + j] = t[i][16j + p]
  for (int64_t i = 0; i < kB; ++i) {
    for (int64_t j = 0; j < kBlocks; ++j) {
      for (int64_t p = 0; p < kB; ++p) v[p][i * kBlocks + j] = t[i][j * kB + p];
    }
  }
  alignas(64) uint32_t keys[kLanes];
  if (job.two_d) {
    for (int64_t n = 0; n < kLanes; ++n) keys[n] = tile_keys[n % kBlocks];
  } else {
    for (int64_t n = 0; n < kLanes; n += 16) block_maxima(&t[0][0] + n * kB, keys + n);
  }
  PairN c[kLanes / kN];
  alignas(64) float err4[kLanes], err6[kLanes];
  for (int64_t g = 0; g < kLanes / kN; ++g) {
    candidates<MSE>(&v[0][kN * g], kLanes, vec::load<u32n>(keys + kN * g), sc, c[g]);
    vec::store(err4 + kN * g, c[g].err4);
    vec::store(err6 + kN * g, c[g].err6);
  }
  alignas(64) uint32_t pick[kLanes];
  if (job.two_d) {  // each tile (block column j) sums its 16 rows' errors by the tree
    for (int64_t j = 0; j < kBlocks; ++j) {
      const uint32_t p4 = tree16(err4 + j, kBlocks) < tree16(err6 + j, kBlocks) ? ~0u : 0u;
      for (int64_t i = 0; i < kB; ++i) pick[i * kBlocks + j] = p4;
    }
  } else {
    for (int64_t n = 0; n < kLanes; n += kN) vec::store(pick + n, (u32n)(vec::load<f32n>(err4 + n) < vec::load<f32n>(err6 + n)));
  }
  alignas(64) uint64_t words[kLanes];
  alignas(64) uint32_t scales[kLanes];
  for (int64_t g = 0; g < kLanes / kN; ++g) {
    vec::store(scales + kN * g, keep(c[g], vec::load<u32n>(pick + kN * g), words + kN * g));
  }
  for (int64_t i = 0; i < b.rows; ++i) {
    const int64_t r = b.r0 + i;
    uint8_t* sc_row = job.row_scales + r * nbk + b.c0 / kB;
    for (int64_t j = 0; j < blocks; ++j) sc_row[j] = static_cast<uint8_t>(scales[i * kBlocks + j]);
    const size_t bytes = static_cast<size_t>(b.w == kT ? kT / 2 : (b.w + 1) / 2);
    std::memcpy(job.row_data + r * kp + b.c0 / 2, words + i * kBlocks, bytes);  // little endian: bytes in order
  }
}

// The columnwise usage of a tile: the 16x1 blocks of its columns (lane: column), or the 16x16 tiles' columns.
template <bool MSE>
void columnwise_tile_46(const Nvfp4Job& job, const TileBox& b, const float (*__restrict t)[kT],
                        const uint32_t* __restrict tile_keys) {
  const Scale46 sc = scale_46(job.col_amax, job.e4m3_max);
  const int64_t M = job.M, nbm = (M + kB - 1) / kB, mp = (M + 1) / 2, block_row = b.r0 / kB;
  const size_t bytes = static_cast<size_t>((b.rows + 1) / 2);
  PairN c[16 / kN];
  alignas(64) uint64_t words[16];
  alignas(64) uint32_t s[16];
  for (int64_t g = 0; g < kT && g < b.w; g += 16) {  // 16 columns (a 16x16 tile's), kN at a time
    alignas(64) float e4[16], e6[16];
    for (int h = 0; h < 16; h += kN) {
      u32n key;
      if (job.two_d) {
        key = vec::splat<u32n>(tile_keys[g / kB]);
      } else {
        key = u32n{};
#pragma GCC unroll 16
        for (int64_t k = 0; k < kB; ++k) key = vec::max(key, vec::load<u32n>(t[k] + g + h) & 0x7FFFFFFFu);
      }
      candidates<MSE>(&t[0][g + h], kT, key, sc, c[h / kN]);
      vec::store(e4 + h, c[h / kN].err4);
      vec::store(e6 + h, c[h / kN].err6);
    }
    alignas(64) uint32_t pick[16];
    if (job.two_d) {  // the 16 columns of the tile: its 16 column errors by the tree
      const uint32_t p4 = tree16(e4, 1) < tree16(e6, 1) ? ~0u : 0u;
      for (int l = 0; l < 16; ++l) pick[l] = p4;
    } else {
      for (int h = 0; h < 16; h += kN) vec::store(pick + h, (u32n)(c[h / kN].err4 < c[h / kN].err6));
    }
    for (int h = 0; h < 16; h += kN) vec::store(s + h, keep(c[h / kN], vec::load<u32n>(pick + h), words + h));
    const int64_t n = b.w - g < 16 ? b.w - g : 16;
    for (int64_t l = 0; l < n; ++l) {
      job.col_scales[(b.c0 + g + l) * nbm + block_row] = static_cast<uint8_t>(s[l]);
      std::memcpy(job.col_data + (b.c0 + g + l) * mp + b.r0 / 2, words + l, bytes);
    }
  }
}

// The asked usages of one tile (no RHT, no stochastic rounding: refused by the glue).
template <bool BF16, bool MSE>
void quantize_tile_46(const Nvfp4Job& job, const TileBox& b, float (*__restrict t)[kT]) {
  alignas(64) uint32_t tile_keys[kT / kB];
  load_tile<BF16>(job, b, t);
  if (job.two_d) {
    for (int64_t j = 0; j < kT / kB; ++j) tile_keys[j] = tile_key(t, j * kB, kB);
  }
  if (job.row_data) rowwise_tile_46<MSE>(job, b, t, tile_keys);
  if (job.col_data) columnwise_tile_46<MSE>(job, b, t, tile_keys);
}

template <bool BF16, bool MSE>
void quantize_tiles_46_mode(const Nvfp4Job& job, int64_t u0, int64_t u1) {
  alignas(64) float t[kB][kT];
  for (int64_t u = u0; u < u1; ++u) quantize_tile_46<BF16, MSE>(job, tile_box(job, u), t);
}

template <bool BF16>
void quantize_tiles_46(const Nvfp4Job& job, int64_t u0, int64_t u1) {
  return job.mse ? quantize_tiles_46_mode<BF16, true>(job, u0, u1) : quantize_tiles_46_mode<BF16, false>(job, u0, u1);
}
