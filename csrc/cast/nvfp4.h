// NVFP4 quantize kernels (nvfp4_kernels.cpp, compiled once per instruction-set level): the job the torch glue
// (nvfp4_glue.cpp) hands them and the table of entry points each level exports. The numerics are those of
// engine/ops/nvfp4.py and engine/ops/nvfp4_sr.py. No torch here: the kernel source includes only this.
#pragma once

#include <cstdint>

#include "common/isa.h"

namespace engine_native {

// A row-major 2D input x [M, K] and the outputs of the usages asked for (null: not asked for).
struct Nvfp4Job {
  const void* x;
  bool bf16;  // else fp32 (the glue widens fp16 to fp32, exactly)
  int64_t ld, M, K;
  bool two_d;  // 16x16 tiles (one amax per tile, shared by both usages)
  bool rht;    // columnwise data from the 16-point random Hadamard transform of x^T along M (M % 16 == 0)
  uint8_t* row_data;    // [M, ceil(K/2)] packed E2M1
  uint8_t* row_scales;  // [M, ceil(K/16)] E4M3
  uint8_t* col_data;    // [K, ceil(M/2)]
  uint8_t* col_scales;  // [K, ceil(M/16)]
  float row_amax, col_amax;  // the per-tensor amaxes the scales derive from (quantize pass)
  bool sr;                   // stochastic rounding with the counter-based bits of nvfp4_sr.random_bits
  uint64_t seed, row_offset, col_offset;  // the counter's seed; the offsets of the row / col bits
  // 4over6 (engine/ops/nvfp4_4over6.py; never with rht or sr): per block the map-to-4 or map-to-6 candidate
  // with the lower error, MAE (or MSE when `mse`), with the global E4M3 bound e4m3_max (448 or 256)
  bool four_over_six = false;
  bool mse = false;
  float e4m3_max = 448.0f;
};

constexpr int64_t kNvfp4Block = 16;
constexpr int64_t kNvfp4TileCols = 128;  // a multiple of 16; a tile is 16 rows x kNvfp4TileCols columns of x
constexpr int64_t kNvfp4BandStrips = 8;  // the quantize pass writes the columnwise usage by bands of 8 strips of
                                         // 16 rows (a 64-byte line of each column's packed data)

// The entry points of one level, over tiles [u0, u1) of the row-major grid ceil(M/16) x ceil(K/kNvfp4TileCols):
// `amax_tiles` the maxima, as |value| bits (a NaN above every number), of x (into `x_key`, when set) and of the
// RHT output of x^T (`rht_key`, when set); `quantize_tiles` the asked usages with the amaxes in the job.
struct Nvfp4Kernels {
  void (*amax_tiles)(const Nvfp4Job& job, int64_t u0, int64_t u1, uint32_t* x_key, uint32_t* rht_key);
  void (*quantize_tiles)(const Nvfp4Job& job, int64_t u0, int64_t u1);
};

ENGINE_ISA_VARIANTS(Nvfp4Kernels, nvfp4_kernels)

}  // namespace engine_native
