// The fused Adam / AdamW step over compressed optimizer states (engine/optim/adam.py's `reference_step`, bit for
// bit): per chunk of 256 elements, decode exp_avg and exp_avg_sq, update them, encode them in their formats, read
// the stored values back and update the fp32 weight (and its bf16 copy): one pass over each tensor. No torch here.
#pragma once

#include <cstdint>

#include "common/isa.h"

namespace engine_native {

// How a state is stored (engine/optim/formats.py): fp32, bf16 (nearest even), FP8 E4M3 / E5M2 with an fp32
// scale_inv per 128 elements (the block1d scheme), or uint8 codes of a 256-entry map with an fp32 absmax per 256.
enum class StateKind : int { F32 = 0, BF16 = 1, E4M3_128 = 2, E5M2_128 = 3, INT8_256 = 4 };

struct StateRef {
  StateKind kind;
  void* data;            // [n] of the kind's element
  float* scale;          // [ceil(n / block)] or null
  const float* codes;    // int8: the 256 code values
  const float* mids;     // int8: the 255 decision points (nearest code, ties down)
  bool sqrt_form;        // the second moment stored as sqrt(v)
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
