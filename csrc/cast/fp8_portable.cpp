// Portable kernels: plain loops over the scalar rules of fp8_scalar.h. They run on any CPU
// (the build adds no -march flags) and are the fallback when AVX-512 is missing.
#include <algorithm>

#include "cast/fp8.h"

namespace engine_native {
namespace {

constexpr int64_t kMx = 32;

template <InType T>
uint32_t amax_key_t(const void* x, int64_t begin, int64_t end) {
  uint32_t key = 0;
  for (int64_t i = begin; i < end; ++i) key = std::max(key, abs_key<T>(x, i));
  return key;
}

uint32_t amax_key(const void* x, InType type, int64_t begin, int64_t end) {
  switch (type) {
    case InType::F32: return amax_key_t<InType::F32>(x, begin, end);
    case InType::BF16: return amax_key_t<InType::BF16>(x, begin, end);
    default: return amax_key_t<InType::F16>(x, begin, end);
  }
}

template <InType T>
uint32_t cast_t(const void* x, int64_t begin, int64_t end, float scale, Fp8Kind kind, uint8_t* out) {
  uint32_t key = 0;
  for (int64_t i = begin; i < end; ++i) {
    const float v = load_f32<T>(x, i);
    key = std::max(key, f32_bits(v) & 0x7FFFFFFFu);
    out[i] = fp32_to_fp8(v * scale, kind);
  }
  return key;
}

uint32_t cast(const void* x, InType type, int64_t begin, int64_t end, float scale, Fp8Kind kind, uint8_t* out) {
  switch (type) {
    case InType::F32: return cast_t<InType::F32>(x, begin, end, scale, kind, out);
    case InType::BF16: return cast_t<InType::BF16>(x, begin, end, scale, kind, out);
    default: return cast_t<InType::F16>(x, begin, end, scale, kind, out);
  }
}

template <InType T>
uint32_t cast_transpose_t(Src x, int64_t M, int64_t K, int64_t r0, int64_t r1, int64_t c0, int64_t c1, float scale,
                          Fp8Kind kind, uint8_t* out, uint8_t* out_t) {
  uint32_t key = 0;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t c = c0; c < c1; ++c) {
      const float v = load_f32<T>(x.data, r * x.ld + c);
      key = std::max(key, f32_bits(v) & 0x7FFFFFFFu);
      const uint8_t q = fp32_to_fp8(v * scale, kind);
      if (out) out[r * K + c] = q;
      if (out_t) out_t[c * M + r] = q;
    }
  }
  return key;
}

uint32_t cast_transpose_region(Src x, int64_t M, int64_t K, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                               float scale, Fp8Kind kind, uint8_t* out, uint8_t* out_t) {
  switch (x.type) {
    case InType::F32: return cast_transpose_t<InType::F32>(x, M, K, r0, r1, c0, c1, scale, kind, out, out_t);
    case InType::BF16: return cast_transpose_t<InType::BF16>(x, M, K, r0, r1, c0, c1, scale, kind, out, out_t);
    default: return cast_transpose_t<InType::F16>(x, M, K, r0, r1, c0, c1, scale, kind, out, out_t);
  }
}

// One tile of `rows x cols` at element (r0, c0) of a matrix whose element (r, c) is
// get(r, c); the quantized element goes to put(r, c, code). Returns the tile's scale.
template <typename Get, typename Put>
float quantize_tile(int64_t r0, int64_t r1, int64_t c0, int64_t c1, const BlockParams& p, Get get, Put put) {
  uint32_t key = 0;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = c0; c < c1; ++c) key = std::max(key, f32_bits(get(r, c)) & 0x7FFFFFFFu);
  const float scale = compute_scale(key_to_amax(key), p.rule);
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = c0; c < c1; ++c) put(r, c, fp32_to_fp8(get(r, c) * scale, p.kind));
  return scale;
}

template <InType T>
void block_rowwise_t(Src x, int64_t M, int64_t K, const BlockParams& p, int64_t t0, int64_t t1, uint8_t* out,
                     float* scale_inv) {
  const int64_t tiles_k = (K + p.tile_cols - 1) / p.tile_cols;
  auto get = [&](int64_t r, int64_t c) { return load_f32<T>(x.data, r * x.ld + c); };
  auto put = [&](int64_t r, int64_t c, uint8_t q) { out[r * K + c] = q; };
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t r0 = (t / tiles_k) * p.tile_rows, c0 = (t % tiles_k) * p.tile_cols;
    const float s = quantize_tile(r0, std::min(M, r0 + p.tile_rows), c0, std::min(K, c0 + p.tile_cols), p, get, put);
    scale_inv[t] = 1.0f / s;
  }
}

void block_rowwise(Src x, int64_t M, int64_t K, const BlockParams& p, int64_t t0, int64_t t1, uint8_t* out,
                   float* scale_inv) {
  switch (x.type) {
    case InType::F32: return block_rowwise_t<InType::F32>(x, M, K, p, t0, t1, out, scale_inv);
    case InType::BF16: return block_rowwise_t<InType::BF16>(x, M, K, p, t0, t1, out, scale_inv);
    default: return block_rowwise_t<InType::F16>(x, M, K, p, t0, t1, out, scale_inv);
  }
}

template <InType T>
void block_transposed_t(Src x, int64_t A, int64_t B, const BlockParams& p, int64_t a0, int64_t a1, int64_t b0,
                        int64_t b1, uint8_t* out, float* scale_inv) {
  // The quantized tensor is y = x^T (B x A): y(r, c) = x(c, r).
  const int64_t tiles_a = (A + p.tile_cols - 1) / p.tile_cols;
  auto get = [&](int64_t r, int64_t c) { return load_f32<T>(x.data, c * x.ld + r); };
  auto put = [&](int64_t r, int64_t c, uint8_t q) { out[r * A + c] = q; };
  for (int64_t r0 = b0; r0 < b1; r0 += p.tile_rows) {
    for (int64_t c0 = a0; c0 < a1; c0 += p.tile_cols) {
      const float s =
          quantize_tile(r0, std::min(b1, r0 + p.tile_rows), c0, std::min(a1, c0 + p.tile_cols), p, get, put);
      scale_inv[(r0 / p.tile_rows) * tiles_a + c0 / p.tile_cols] = 1.0f / s;
    }
  }
}

void block_transposed(Src x, int64_t A, int64_t B, const BlockParams& p, int64_t a0, int64_t a1, int64_t b0,
                      int64_t b1, uint8_t* out, float* scale_inv) {
  switch (x.type) {
    case InType::F32: return block_transposed_t<InType::F32>(x, A, B, p, a0, a1, b0, b1, out, scale_inv);
    case InType::BF16: return block_transposed_t<InType::BF16>(x, A, B, p, a0, a1, b0, b1, out, scale_inv);
    default: return block_transposed_t<InType::F16>(x, A, B, p, a0, a1, b0, b1, out, scale_inv);
  }
}

uint8_t mx_code(uint32_t key, Fp8Kind kind, bool rceil) {
  const Fp8Format f = fp8_format(kind);
  const float amax = key_to_amax(key);
  return rceil ? e8m0_rceil(amax, static_cast<float>(1.0 / f.max)) : e8m0_floor(amax, f.max_exponent);
}

// x * 2^(127 - code) cast to FP8. A NaN multiplier (code 255) makes every element NaN:
// the canonical code 0x7F whatever the element was.
uint8_t mx_element(float v, uint8_t code, Fp8Kind kind) {
  if (code == kE8M0NaN) return 0x7F;
  return fp32_to_fp8(v * e8m0_element_scale(code), kind);
}

template <InType T>
void mx_rowwise_t(Src x, int64_t M, int64_t K, Fp8Kind kind, bool rceil, int64_t r0, int64_t r1, uint8_t* out,
                  uint8_t* codes) {
  (void)M;
  const int64_t nb = (K + kMx - 1) / kMx;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t base = r * x.ld;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t c0 = b * kMx, c1 = std::min(K, c0 + kMx);
      uint32_t key = 0;
      for (int64_t c = c0; c < c1; ++c) key = std::max(key, abs_key<T>(x.data, base + c));
      const uint8_t code = mx_code(key, kind, rceil);
      codes[r * nb + b] = code;
      for (int64_t c = c0; c < c1; ++c) out[r * K + c] = mx_element(load_f32<T>(x.data, base + c), code, kind);
    }
  }
}

void mx_rowwise(Src x, int64_t M, int64_t K, Fp8Kind kind, bool rceil, int64_t r0, int64_t r1, uint8_t* out,
                uint8_t* codes) {
  switch (x.type) {
    case InType::F32: return mx_rowwise_t<InType::F32>(x, M, K, kind, rceil, r0, r1, out, codes);
    case InType::BF16: return mx_rowwise_t<InType::BF16>(x, M, K, kind, rceil, r0, r1, out, codes);
    default: return mx_rowwise_t<InType::F16>(x, M, K, kind, rceil, r0, r1, out, codes);
  }
}

template <InType T>
void mx_colwise_t(Src x, int64_t M, int64_t K, Fp8Kind kind, bool rceil, int64_t br0, int64_t br1, int64_t c0,
                  int64_t c1, uint8_t* out, uint8_t* codes) {
  for (int64_t br = br0; br < br1; ++br) {
    const int64_t r0 = br * kMx, r1 = std::min(M, r0 + kMx);
    for (int64_t c = c0; c < c1; ++c) {
      uint32_t key = 0;
      for (int64_t r = r0; r < r1; ++r) key = std::max(key, abs_key<T>(x.data, r * x.ld + c));
      const uint8_t code = mx_code(key, kind, rceil);
      codes[br * K + c] = code;
      for (int64_t r = r0; r < r1; ++r) out[r * K + c] = mx_element(load_f32<T>(x.data, r * x.ld + c), code, kind);
    }
  }
}

void mx_colwise(Src x, int64_t M, int64_t K, Fp8Kind kind, bool rceil, int64_t br0, int64_t br1, int64_t c0,
                int64_t c1, uint8_t* out, uint8_t* codes) {
  switch (x.type) {
    case InType::F32: return mx_colwise_t<InType::F32>(x, M, K, kind, rceil, br0, br1, c0, c1, out, codes);
    case InType::BF16: return mx_colwise_t<InType::BF16>(x, M, K, kind, rceil, br0, br1, c0, c1, out, codes);
    default: return mx_colwise_t<InType::F16>(x, M, K, kind, rceil, br0, br1, c0, c1, out, codes);
  }
}

struct Fp8Bf16Table {
  uint16_t bits[256];
};

Fp8Bf16Table make_fp8_bf16_table(Fp8Kind kind) {
  Fp8Bf16Table t;
  for (int i = 0; i < 256; ++i) t.bits[i] = fp8_to_bf16_bits(static_cast<uint8_t>(i), kind);
  return t;
}

void fp8_to_bf16(const uint8_t* codes, Fp8Kind kind, int64_t begin, int64_t end, uint16_t* out) {
  // built once per format (immutable after)
  static const Fp8Bf16Table e4m3 = make_fp8_bf16_table(Fp8Kind::E4M3), e5m2 = make_fp8_bf16_table(Fp8Kind::E5M2);
  const uint16_t* table = (kind == Fp8Kind::E4M3 ? e4m3 : e5m2).bits;
  for (int64_t i = begin; i < end; ++i) out[i] = table[codes[i]];
}

void scale_bf16(uint16_t* x, const float* s, int64_t n, int64_t run) {
  if (run == 1) {
    scale_bf16_loop(x, s, n);
  } else {
    scale_bf16_runs_loop(x, s, n, run);
  }
}

void fp8_to_bf16_scaled(const uint8_t* codes, Fp8Kind kind, int64_t n, uint16_t* out, const float* s, int64_t run) {
  fp8_to_bf16(codes, kind, 0, n, out);
  scale_bf16(out, s, n, run);
}

void fp8_to_bf16_shifted(const uint8_t* codes, Fp8Kind kind, int64_t n, uint16_t* out, const int16_t* adds) {
  const uint8_t special = first_special_magnitude(kind);
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t mag = codes[i] & 0x7F;
    const uint16_t w = fp8_to_bf16_bits(codes[i], kind);
    out[i] = mag != 0 && mag < special ? static_cast<uint16_t>(w + adds[i]) : w;
  }
}

void transpose_bytes(const uint8_t* src, int64_t rows, int64_t cols, int64_t r0, int64_t r1, uint8_t* dst) {
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
}

}  // namespace

const Kernels& portable_kernels() {
  static const Kernels k = {"portable",       amax_key,   cast,       cast_transpose_region, block_rowwise,
                            block_transposed, mx_rowwise, mx_colwise, fp8_to_bf16,
                            scale_bf16,       fp8_to_bf16_scaled, fp8_to_bf16_shifted, transpose_bytes};
  return k;
}

}  // namespace engine_native
