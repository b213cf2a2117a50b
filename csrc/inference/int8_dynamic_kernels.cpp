// The row loops of int8_dynamic.h, plain loops the compiler vectorises for each instruction set (-ffp-contract=off
// keeps every fp32 operation separately rounded, as the torch ops they replace).
#include "inference/int8_dynamic.h"

namespace engine_native {
namespace ENGINE_ISA_NS {
namespace {

constexpr float kInt8Max = 127.0f;
constexpr float kFp32Tiny = 1.17549435e-38f;  // fp32's smallest normal: the least scale

void quantize_row(const float* __restrict row, int64_t K, uint8_t flip, uint8_t* __restrict out,
                  float* __restrict scale) {
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(row);
  uint32_t key = 0;  // max |x| bits: orders as |x| does, a NaN above every number
  for (int64_t k = 0; k < K; ++k) {
    const uint32_t a = bits[k] & 0x7FFFFFFFu;
    key = a > key ? a : key;
  }
  float amax;
  std::memcpy(&amax, &key, 4);
  float s = amax / kInt8Max;
  s = s < kFp32Tiny ? kFp32Tiny : s;  // a NaN stays
  *scale = s;
  for (int64_t k = 0; k < K; ++k) {
    // round-half-even(v) clamped to +-127 = the same of v clamped to +-128 first; below 2^22 in magnitude,
    // (v + 1.5 * 2^23) - 1.5 * 2^23 rounds v to an integer, half to even (no contraction: -ffp-contract=off)
    float v = row[k] / s;
    v = v < -128.0f ? -128.0f : (v > 128.0f ? 128.0f : v);
    v = (v + 12582912.0f) - 12582912.0f;
    v = v < -kInt8Max ? -kInt8Max : (v > kInt8Max ? kInt8Max : v);
    out[k] = static_cast<uint8_t>(static_cast<int32_t>(v == v ? v : 0.0f)) ^ flip;
  }
}

template <typename Acc>
inline __attribute__((always_inline)) void rescale_row(const Acc* __restrict acc, float sx,
                                                       const float* __restrict sw, int64_t N,
                                                       float* __restrict yf, uint16_t* __restrict yb) {
  if (yb == nullptr) {
    for (int64_t n = 0; n < N; ++n) yf[n] = static_cast<float>(acc[n]) * sx * sw[n];
    return;
  }
  for (int64_t n = 0; n < N; ++n) {
    const float v = static_cast<float>(acc[n]) * sx * sw[n];
    uint32_t u;
    std::memcpy(&u, &v, 4);
    yb[n] = (u & 0x7FFFFFFFu) > 0x7F800000u ? static_cast<uint16_t>((u >> 16) | 0x40u)
                                            : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
}

void rescale_row_i32(const int32_t* acc, float sx, const float* sw, int64_t N, float* yf, uint16_t* yb) {
  rescale_row(acc, sx, sw, N, yf, yb);
}
void rescale_row_f32(const float* acc, float sx, const float* sw, int64_t N, float* yf, uint16_t* yb) {
  rescale_row(acc, sx, sw, N, yf, yb);
}

}  // namespace

const Int8DynamicKernels& int8_dynamic_kernels() {
  static const Int8DynamicKernels table{quantize_row, rescale_row_i32, rescale_row_f32};
  return table;
}

}  // namespace ENGINE_ISA_NS
}  // namespace engine_native
