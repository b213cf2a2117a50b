// The 64x64 byte transpose of the transposing casts (cast/fp8_kernels.cpp): a tile of 64 rows of 64 bytes
// in a buffer, written out as its 64 columns. The tile is a 4 x 4 grid of 16 x 16 byte blocks; each block
// is transposed in 16-byte registers by four rounds of byte interleaves (unpack low / high of rows i and
// i + 8, `__builtin_shufflevector` with constant indices: punpck{l,h}bw at every x86 level, zip1/zip2 on
// NEON); the four blocks of a 16-column group are transposed before their 16 output rows are stored, so every
// output row is one run of four 16-byte stores (a whole line: streaming stores then skip reading it).
// (The previous form, 8x8 swaps on 64-bit words with 8-byte stores, measured 1.2-1.4x slower at avx2.)
//
// Include only from a `*_kernels.cpp` (after isa_begin.h).
#pragma once

#ifndef ENGINE_ISA_NS
#error "transpose/byte_transpose.h is for *_kernels.cpp sources (compiled per instruction set)"
#endif

#include "common/vec.h"

namespace engine_native {
namespace ENGINE_ISA_NS {
namespace transpose {

typedef uint8_t u8x16 __attribute__((vector_size(16)));

// a[r] byte c <-> a[c] byte r: each round interleaves the bytes of rows i and i + 8 into rows 2i and 2i + 1,
// which rotates the 8 index bits (row, column) by one; four rounds swap row and column.
inline __attribute__((always_inline)) void transpose16x16_bytes(u8x16 a[16]) {
  for (int round = 0; round < 4; ++round) {
    u8x16 b[16];
    for (int i = 0; i < 8; ++i) {
      b[2 * i] = __builtin_shufflevector(a[i], a[i + 8], 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
      b[2 * i + 1] =
          __builtin_shufflevector(a[i], a[i + 8], 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    }
    for (int i = 0; i < 16; ++i) a[i] = b[i];
  }
}

// Transposes the tile of `rows` x `cols` bytes (both <= 64) at `tile` (row r at tile + ld_tile r) and stores row c
// of the result (= column c of the tile) to dst + c * ld, for c < cols, keeping its first `rows` bytes. Rows of the
// tile's 16-row blocks past `rows` are read (any bytes; their results are not stored). Each output row is written
// as one run of stores (all four 16x16 blocks of a 16-column group are transposed first): a whole 64-byte line
// when rows = 64, around the caches when `stream` (vec::store_stream; then dst and ld must be multiples of 16,
// and the caller runs vec::stream_fence() before returning).
inline void transpose64_store(const uint8_t* tile, int64_t ld_tile, int64_t rows, int64_t cols, uint8_t* dst,
                              int64_t ld, bool stream) {
  const int blocks = static_cast<int>((rows + 15) / 16);
  for (int j = 0; 16 * j < cols; ++j) {  // tile columns 16j .. 16j + 15: output rows
    const int64_t nc = std::min<int64_t>(16, cols - 16 * j);
    u8x16 a[4][16];
    for (int i = 0; i < blocks; ++i) {  // tile rows 16i .. 16i + 15: bytes 16i .. of those output rows
      for (int r = 0; r < 16; ++r) std::memcpy(&a[i][r], tile + ld_tile * (16 * i + r) + 16 * j, 16);
      transpose16x16_bytes(a[i]);
    }
    for (int64_t c = 0; c < nc; ++c) {
      uint8_t* d = dst + (16 * j + c) * ld;
      if (rows == 64 && stream) {
        for (int i = 0; i < 4; ++i) vec::store_stream(d + 16 * i, a[i][c]);
      } else if (rows == 64) {
        for (int i = 0; i < 4; ++i) std::memcpy(d + 16 * i, &a[i][c], 16);
      } else {
        for (int i = 0; i < blocks; ++i) {
          std::memcpy(d + 16 * i, &a[i][c], static_cast<size_t>(std::min<int64_t>(16, rows - 16 * i)));
        }
      }
    }
  }
}

// The 64-byte row-major tile at `tile` (row stride 64) as is.
inline void transpose64_store(const uint8_t* tile, int64_t rows, int64_t cols, uint8_t* dst, int64_t ld) {
  transpose64_store(tile, 64, rows, cols, dst, ld, false);
}

}  // namespace transpose
}  // namespace ENGINE_ISA_NS
}  // namespace engine_native
