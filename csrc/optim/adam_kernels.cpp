// The fused Adam step of adam.h, plain loops over a 256-element chunk the compiler vectorises per instruction set
// (-ffp-contract=off: every fp32 operation rounded once, as the torch ops of Adam.reference_step).
#include "optim/adam.h"

#include <cmath>
#include <cstring>

#include "common/fp8_scalar.h"

namespace engine_native {
namespace ENGINE_ISA_NS {
namespace {

constexpr int64_t kChunk = 256;
constexpr float kFltMax = 3.40282347e+38f;

// NaN as the canonical quiet NaN 0x7FC00000 (arithmetic NaNs carry the sign and payload of whichever operand the
// instruction picks; fp32 / bf16 states and weights store this one).
inline float canonical(float x) {
  if (x != x) {
    const uint32_t q = 0x7FC00000u;
    std::memcpy(&x, &q, 4);
  }
  return x;
}

inline float fp8_value(uint8_t code, bool e4m3) {
  const bool neg = code & 0x80;
  const int mag = code & 0x7F;
  float v;
  if (e4m3) {
    if (mag == 0x7F) return std::nanf("");
    const int e = mag >> 3, m = mag & 7;
    v = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(static_cast<float>(8 + m), e - 10);
  } else {
    const int e = mag >> 2, m = mag & 3;
    if (e == 31) return m ? std::nanf("") : (neg ? -INFINITY : INFINITY);
    v = e == 0 ? std::ldexp(static_cast<float>(m), -16) : std::ldexp(static_cast<float>(4 + m), e - 17);
  }
  return neg ? -v : v;
}

struct Fp8Table {
  float value[2][256];
  Fp8Table() {
    for (int c = 0; c < 256; ++c) {
      value[0][c] = fp8_value(static_cast<uint8_t>(c), true);
      value[1][c] = fp8_value(static_cast<uint8_t>(c), false);
    }
  }
};

const Fp8Table& fp8_table() {
  static const Fp8Table table;
  return table;
}

inline uint16_t bf16_nearest_even(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? static_cast<uint16_t>((u >> 16) | 0x40u)
                                         : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// |x| max as ordered bits (a NaN above every number), as torch's amax propagates NaN.
inline float block_amax(const float* x, int64_t count) {
  uint32_t key = 0;
  for (int64_t i = 0; i < count; ++i) {
    uint32_t a;
    std::memcpy(&a, x + i, 4);
    a &= 0x7FFFFFFFu;
    key = a > key ? a : key;
  }
  return key_to_amax(key);
}

// Encode `count` values of x (at element offset `at` of the tensor) into the state, and write back into x the
// value the stored form decodes to.
void encode_decode(const StateRef& s, float* x, int64_t at, int64_t count) {
  switch (s.kind) {
    case StateKind::F32: {
      float* d = static_cast<float*>(s.data) + at;
      for (int64_t i = 0; i < count; ++i) d[i] = x[i] = canonical(x[i]);
      return;
    }
    case StateKind::BF16: {
      uint16_t* d = static_cast<uint16_t*>(s.data) + at;
      for (int64_t i = 0; i < count; ++i) {
        d[i] = bf16_nearest_even(canonical(x[i]));
        x[i] = bf16_to_f32(d[i]);
      }
      return;
    }
    case StateKind::E4M3_128:
    case StateKind::E5M2_128: {
      const bool e4m3 = s.kind == StateKind::E4M3_128;
      const Fp8Kind kind = e4m3 ? Fp8Kind::E4M3 : Fp8Kind::E5M2;
      const ScaleRule rule{e4m3 ? 448.0f : 57344.0f, false, 0.0f, kFltMax};
      const float* table = fp8_table().value[e4m3 ? 0 : 1];
      uint8_t* d = static_cast<uint8_t*>(s.data) + at;
      for (int64_t b = 0; b < count; b += 128) {
        const int64_t len = count - b < 128 ? count - b : 128;
        const float scale = compute_scale(block_amax(x + b, len), rule);
        const float scale_inv = 1.0f / scale;
        s.scale[(at + b) / 128] = scale_inv;
        for (int64_t i = b; i < b + len; ++i) {
          d[i] = fp32_to_fp8(x[i] * scale, kind);
          x[i] = table[d[i]] * scale_inv;
        }
      }
      return;
    }
    case StateKind::INT8_256: {
      uint8_t* d = static_cast<uint8_t*>(s.data) + at;
      const float amax = block_amax(x, count);
      const float div = amax == 0.0f ? 1.0f : amax;
      s.scale[at / 256] = amax;
      alignas(64) float mids[256];  // the 255 decision points and +inf: a branchless 8-step search over 256
      std::memcpy(mids, s.mids, 255 * 4);
      mids[255] = INFINITY;
      for (int64_t i = 0; i < count; ++i) {
        const float v = x[i] / div;
        int lo = 0;  // the number of decision points < v (torch.bucketize, right=False)
        for (int step = 128; step >= 1; step >>= 1) lo += step & -static_cast<int>(mids[lo + step - 1] < v);
        if (v != v) lo = 255;  // NaN: the top code, as torch.bucketize
        d[i] = static_cast<uint8_t>(lo);
        x[i] = s.codes[lo] * amax;
      }
      return;
    }
  }
}

void decode(const StateRef& s, float* x, int64_t at, int64_t count) {
  switch (s.kind) {
    case StateKind::F32:
      std::memcpy(x, static_cast<const float*>(s.data) + at, count * 4);
      return;
    case StateKind::BF16: {
      const uint16_t* d = static_cast<const uint16_t*>(s.data) + at;
      for (int64_t i = 0; i < count; ++i) x[i] = bf16_to_f32(d[i]);
      return;
    }
    case StateKind::E4M3_128:
    case StateKind::E5M2_128: {
      const float* table = fp8_table().value[s.kind == StateKind::E4M3_128 ? 0 : 1];
      const uint8_t* d = static_cast<const uint8_t*>(s.data) + at;
      for (int64_t i = 0; i < count; ++i) x[i] = table[d[i]] * s.scale[(at + i) / 128];
      return;
    }
    case StateKind::INT8_256: {
      const uint8_t* d = static_cast<const uint8_t*>(s.data) + at;
      const float amax = s.scale[at / 256];
      for (int64_t i = 0; i < count; ++i) x[i] = s.codes[d[i]] * amax;
      return;
    }
  }
}

void step(float* w, const void* grad, bool grad_bf16, uint16_t* w_bf16, const StateRef& m, const StateRef& v,
          const AdamScalars& s, int64_t n, int64_t begin, int64_t end) {
  alignas(64) float g[kChunk], mv[kChunk], vv[kChunk];
  for (int64_t at = begin; at < end; at += kChunk) {
    const int64_t count = (end - at) < kChunk ? (end - at) : kChunk;
    float* wc = w + at;
    if (grad_bf16) {
      const uint16_t* gb = static_cast<const uint16_t*>(grad) + at;
      for (int64_t i = 0; i < count; ++i) g[i] = bf16_to_f32(gb[i]);
    } else {
      std::memcpy(g, static_cast<const float*>(grad) + at, count * 4);
    }
    if (s.maximize) for (int64_t i = 0; i < count; ++i) g[i] = -g[i];
    if (s.wd != 0.0f) for (int64_t i = 0; i < count; ++i) g[i] = g[i] + wc[i] * s.wd;
    decode(m, mv, at, count);
    decode(v, vv, at, count);
    if (v.sqrt_form) for (int64_t i = 0; i < count; ++i) vv[i] = vv[i] * vv[i];
    for (int64_t i = 0; i < count; ++i) {
      mv[i] = mv[i] * s.beta1 + g[i] * s.one_minus_beta1;
      vv[i] = vv[i] * s.beta2 + (g[i] * g[i]) * s.one_minus_beta2;
    }
    if (v.sqrt_form) for (int64_t i = 0; i < count; ++i) vv[i] = std::sqrt(vv[i]);
    encode_decode(m, mv, at, count);
    encode_decode(v, vv, at, count);
    if (!v.sqrt_form) for (int64_t i = 0; i < count; ++i) vv[i] = std::sqrt(vv[i]);
    for (int64_t i = 0; i < count; ++i) {
      const float wi = s.decay != 1.0f ? wc[i] * s.decay : wc[i];
      wc[i] = canonical(wi - (mv[i] * s.step_size) / (vv[i] * s.inv_bc2_sqrt + s.eps));
    }
    if (w_bf16 != nullptr) for (int64_t i = 0; i < count; ++i) w_bf16[at + i] = bf16_nearest_even(wc[i]);
  }
  (void)n;
}

}  // namespace

const AdamKernels& adam_kernels() {
  static const AdamKernels table{step};
  return table;
}

}  // namespace ENGINE_ISA_NS
}  // namespace engine_native
