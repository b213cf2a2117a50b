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

// The int8 code search below AVX-512 (where the tables of the rule below do not fit the registers) as a table
// lookup: a value's bucket (its sign and the top bits of its magnitude, clamped to
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

// The int8 code search at AVX-512 (torch.bucketize of x / absmax on the map's 255 decision points, right=False) by the map's
// structure: its codes fall in runs of equal steps (the decades), the "regions". A value's region is that of the
// lowest value of its bin (sign and fp32 exponent, clamped to [2^-31, 2^0]: `int8_bin`) or the next one, by one
// comparison with the next region's lower decision point (no bin holds two). In region r the code is
// clamp(trunc(v * a[r] + b), first[r], last[r]) with b = b1[r] and with b = b2[r] (b1 / b2 = the linear index
// minus / plus a margin): where both agree that is the code; else (values within the margin of a decision point,
// ~3e-4 of them) the code is c1 + (mids[c1] < v). The glue builds these tables from the map and proves the rule:
// both are monotone in v, so checking them one ulp either side of every decision point covers every value.
constexpr int kInt8Bins = 64;     // sign x 32 exponents
constexpr int kInt8Regions = 32;  // tables' size; a map may have at most 31 regions (lower[r + 1] stays in range)
constexpr int kInt8ExpBase = 96;  // the fp32 exponent field of bin 0 (and below): 2^-31

inline int32_t int8_bin(uint32_t u) {
  int32_t e = static_cast<int32_t>((u >> 23) & 0xFFu) - kInt8ExpBase;
  e = std::min(std::max(e, 0), 31);
  return static_cast<int32_t>(u >> 31) * 32 + e;
}

struct Int8Map {
  alignas(64) int32_t bin_region[kInt8Bins];  // the region of each bin's lowest value
  alignas(64) float lower[kInt8Regions];      // region r = (lower[r], lower[r + 1]]: lower[0] = -inf, unused +inf
  alignas(64) float a[kInt8Regions];
  alignas(64) float b1[kInt8Regions];
  alignas(64) float b2[kInt8Regions];
  alignas(64) int32_t first[kInt8Regions];
  alignas(64) int32_t last[kInt8Regions];
  alignas(64) float mids[256];  // the 255 decision points, then +inf
  alignas(64) float codes[256];
  int32_t bucket_lo[kInt8Buckets];  // the bucket table (below AVX-512)
};

struct StateRef {
  StateKind kind;
  void* data;            // [n] of the kind's element
  float* scale;          // [ceil(n / block)] or null
  const float* codes;    // int8: the 256 code values
  const Int8Map* map;    // int8: the code search's tables (above)
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
