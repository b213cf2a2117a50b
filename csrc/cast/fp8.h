// The FP8 cast kernels: a table of function pointers exported by every instruction-set variant of
// cast/fp8_kernels.cpp (one source, compiled per level).
//
// Kernels work on raw pointers over a slice of the work (a range of elements, rows or
// tiles) and never allocate or start threads: fp8_glue.cpp checks arguments, allocates,
// splits the work over OpenMP threads and asks for fp8_kernels(active_isa()).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "common/fp8_scalar.h"
#include "common/isa.h"

namespace engine_native {

// A 2D row-major view: element (r, c) is at data[r * ld + c].
struct Src {
  const void* data;
  InType type;
  int64_t ld;
};

// Block scaling parameters (reference.compute_scale) plus the tile shape.
struct BlockParams {
  int64_t tile_rows;
  int64_t tile_cols;
  ScaleRule rule;
  Fp8Kind kind;
};

struct Kernels {
  const char* name;

  // max |x| over the flat elements [begin, end), as an ordered key (see abs_key).
  uint32_t (*amax_key)(const void* x, InType type, int64_t begin, int64_t end);

  // out[i] = fp8(x[i] * scale) for the flat elements [begin, end); returns their amax key.
  uint32_t (*cast)(const void* x, InType type, int64_t begin, int64_t end, float scale, Fp8Kind kind,
                   uint8_t* out);

  // Cast of the region rows [r0, r1) x cols [c0, c1) of the M x K matrix `x` (the caller
  // keeps regions small, e.g. 64x64): writes out[r * K + c] when `out` is set and
  // out_t[c * M + r] when `out_t` is set; returns the region's amax key.
  uint32_t (*cast_transpose_region)(Src x, int64_t M, int64_t K, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                                    float scale, Fp8Kind kind, uint8_t* out, uint8_t* out_t);

  // Block quantization of a row-major M x K matrix, tiles [t0, t1) of the row-major tile
  // grid (ceil(M/tile_rows) x ceil(K/tile_cols)): data out[M x K], scale_inv[tile grid].
  void (*block_rowwise)(Src x, int64_t M, int64_t K, const BlockParams& p, int64_t t0, int64_t t1, uint8_t* out,
                        float* scale_inv);

  // Block quantization of the transpose of a row-major A x B matrix `x` (the tensor the
  // caller quantizes is x^T, B x A): out[B x A], scale_inv[ceil(B/tile_rows) x
  // ceil(A/tile_cols)]. Handles the panel x rows [a0, a1) x cols [b0, b1); a0 is a multiple
  // of tile_cols, b0 of tile_rows, a panel holds whole tiles except at the edges, and it
  // is at most 1024 columns wide.
  void (*block_transposed)(Src x, int64_t A, int64_t B, const BlockParams& p, int64_t a0, int64_t a1, int64_t b0,
                           int64_t b1, uint8_t* out, float* scale_inv);

  // MXFP8, 1x32 blocks along rows of an M x K matrix, rows [r0, r1): data out[M x K],
  // codes[M x ceil(K/32)]. rceil selects the scale rule (else floor).
  void (*mx_rowwise)(Src x, int64_t M, int64_t K, Fp8Kind kind, bool rceil, int64_t r0, int64_t r1, uint8_t* out,
                     uint8_t* codes);

  // MXFP8, 32x1 blocks along columns, for the block-rows [br0, br1) and columns [c0, c1)
  // (at most 512 columns): data out[M x K] (not transposed), codes[ceil(M/32) x K].
  void (*mx_colwise)(Src x, int64_t M, int64_t K, Fp8Kind kind, bool rceil, int64_t br0, int64_t br1, int64_t c0,
                     int64_t c1, uint8_t* out, uint8_t* codes);

  // bf16 bits of the FP8 codes [begin, end).
  void (*fp8_to_bf16)(const uint8_t* codes, Fp8Kind kind, int64_t begin, int64_t end, uint16_t* out);

  // x[i] = bf16(x[i] * s[i / run]) for i in [0, n): consecutive runs of `run` elements share a scale
  // (scale_bf16_runs_loop in fp8_scalar.h; run 1 is one scale per element).
  void (*scale_bf16)(uint16_t* x, const float* s, int64_t n, int64_t run);

  // fp8_to_bf16 of codes [0, n) into out [0, n), then scale_bf16(out, s, n, run): one pass where it can.
  void (*fp8_to_bf16_scaled)(const uint8_t* codes, Fp8Kind kind, int64_t n, uint16_t* out, const float* s,
                             int64_t run);
  // fp8_to_bf16 of codes [0, n) into out, then adds[i] added to the word of each finite nonzero value: one scale per
  // element, each 2^shift with shift_stays_normal (fp8_scalar.h) and adds[i] = shift * 128, exactly its product.
  void (*fp8_to_bf16_shifted)(const uint8_t* codes, Fp8Kind kind, int64_t n, uint16_t* out, const int16_t* adds);

  // dst[c * rows + r] = src[r * cols + c] for the rows [r0, r1) of the row-major rows x cols bytes `src`.
  void (*transpose_bytes)(const uint8_t* src, int64_t rows, int64_t cols, int64_t r0, int64_t r1, uint8_t* dst);

  // MXFP8 both usages from one read of x: mx_rowwise's data and codes for the rows of the block-rows [br0, br1)
  // and the columns [c0, c1), and mx_colwise's for the same region (c0 a multiple of 32, at most 512 columns;
  // c1 < K a multiple of 32). nullptr in a table that has no such kernel (the glue then makes the two passes).
  void (*mx_both)(Src x, int64_t M, int64_t K, Fp8Kind kind, bool rceil, int64_t br0, int64_t br1, int64_t c0,
                  int64_t c1, uint8_t* out_row, uint8_t* codes_row, uint8_t* out_col, uint8_t* codes_col);
};

// fp8_kernels() in every variant namespace, and fp8_kernels(Isa) that picks one.
ENGINE_ISA_VARIANTS(Kernels, fp8_kernels)

// cast/fp8_avx512_vbmi.cpp: hand-written AVX-512 + VBMI kernels (nullptr where they were not compiled).
const Kernels* fp8_avx512_vbmi_kernels();

// ENGINE_FP8_HAND_KERNELS=0 in the environment (read at every call; tests set it) turns the hand-written kernels
// off, so that the portable avx512 variant, which only AVX-512 CPUs without VBMI run, is tested on any AVX-512 CPU.
// Unset or 1: on. Any other value is a std::invalid_argument (a ValueError in Python).
inline bool fp8_hand_kernels_allowed() {
  const char* v = std::getenv("ENGINE_FP8_HAND_KERNELS");
  if (v == nullptr || std::strcmp(v, "1") == 0) return true;
  if (std::strcmp(v, "0") == 0) return false;
  throw std::invalid_argument(std::string("ENGINE_FP8_HAND_KERNELS: expected 0 or 1 (or unset), got '") + v + "'");
}

// The table the glue uses at `isa`: the hand-written kernels at avx512 on a CPU with VBMI (they measure
// 1.3-3x faster there) unless fp8_hand_kernels_allowed() says no, else the portable source's variant.
inline const Kernels& fp8_table(Isa isa) {
  const bool allowed = fp8_hand_kernels_allowed();  // checked at every level: a bad value is an error anywhere
  if (allowed && isa == Isa::Avx512 && cpu_has_avx512_vbmi() && fp8_avx512_vbmi_kernels() != nullptr) {
    return *fp8_avx512_vbmi_kernels();
  }
  return fp8_kernels(isa);
}

}  // namespace engine_native
