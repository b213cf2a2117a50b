// The fused Adam / AdamW step over compressed optimizer states (engine/optim/adam.py's `reference_step`, bit for
// bit): per chunk of 256 elements, decode exp_avg and exp_avg_sq, update them, encode them in their formats, read
// the stored values back and update the fp32 weight (and its bf16 copy): one pass over each tensor. No torch here.
#pragma once

#include <algorithm>
#include <cstdint>

#include "common/isa.h"

namespace engine_native {

// How a state is stored (engine/optim/formats.py): fp32, bf16 (nearest even), FP8 E4M3 / E5M2 with an fp32
// scale_inv per 128 elements (the block1d scheme), uint8 codes of a 256-entry map with an fp32 absmax per 256, or
// bf16 rounded stochastically (formats.round_bf16_stochastic with engine.ops.nvfp4_sr.random_bits' bytes).
enum class StateKind : int { F32 = 0, BF16 = 1, E4M3_128 = 2, E5M2_128 = 3, INT8_256 = 4, BF16_SR = 5 };

// The int8 code search as a table lookup: a value's bucket (its sign and the top bits of its magnitude, clamped to
// [2^-26, 1], in value order) holds `lo`, the number of decision points below every value of the bucket, and at
// most kInt8Probes decision points fall inside a bucket, so code = lo + #{j < kInt8Probes: mids[lo + j] < v}
// (the glue builds the table from the map and checks that bound; mids padded with +inf).
constexpr uint32_t kInt8LoMag = 0x32800000u;  // 2^-26: below every |decision point| of both maps
constexpr uint32_t kInt8HiMag = 0x3F800000u;  // 1.0: above every decision point
constexpr int kInt8Shift = 16;                // 7 mantissa bits per bucket
constexpr int kInt8Half = static_cast<int>((kInt8HiMag - kInt8LoMag) >> kInt8Shift) + 1;  // buckets per sign
constexpr int kInt8Buckets = 2 * kInt8Half;
constexpr int kInt8Probes = 1;

// The bucket of fp32 bits u (a NaN lands anywhere: the kernel gives it the top code).
inline int32_t int8_bucket(uint32_t u) {
  uint32_t mag = u & 0x7FFFFFFFu;
  mag = std::max(mag, kInt8LoMag);
  mag = std::min(mag, kInt8HiMag);
  const int32_t b = static_cast<int32_t>((mag - kInt8LoMag) >> kInt8Shift);
  return kInt8Half + (b ^ -static_cast<int32_t>(u >> 31));  // negative: kInt8Half - 1 - b (branch-free)
}

struct StateRef {
  StateKind kind;
  void* data;            // [n] of the kind's element
  float* scale;          // [ceil(n / block)] or null
  const float* codes;    // int8: the 256 code values
  const float* mids;     // int8: the 255 decision points (nearest code, ties down), then kInt8Probes +inf
  const int32_t* lo;     // int8: [kInt8Buckets] the bucket table above
  bool sqrt_form;        // the second moment stored as sqrt(v)
  uint32_t sr_key;       // BF16_SR: the random bits' key of the counter's seed (nvfp4_sr: h(seed) ^ seed >> 32)
  uint64_t sr_offset;    // BF16_SR: the counter index of element 0 of this tensor (the offset, mod 2^64)
};

struct AdamScalars {
  float beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, inv_bc2_sqrt, eps, decay, wd;
  bool maximize;
};

struct AdamKernels {
  // Elements [begin, end) (begin a multiple of 256) of one tensor of n elements: w fp32 [n] updated in place,
  // grad fp32 or bf16 (grad_bf16) [n], w_bf16 (or null) gets bf16(w) nearest even.
  void (*step)(float* w, const void* grad, bool grad_bf16, uint16_t* w_bf16, const StateRef& m,
               const StateRef& v, const AdamScalars& s, int64_t n, int64_t begin, int64_t end);
};

ENGINE_ISA_VARIANTS(AdamKernels, adam_kernels)

}  // namespace engine_native
