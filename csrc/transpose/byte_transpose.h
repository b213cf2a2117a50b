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

#if ENGINE_ISA_LEVEL >= 1 && defined(__x86_64__)
#define ENGINE_TRANSPOSE_32 1
typedef uint8_t u8x32 __attribute__((vector_size(32)));

// Two 16x16 byte transposes per register half at once (AVX2 / AVX-512: in-lane punpck{l,h}bw on 32-byte
// registers): rows 0-15 and 16-31 of a 32x32 block, each 128-bit half a 16x16 block, transposed as
// transpose16x16_bytes does; a[16g + c] half h then holds column 16h + c of rows 16g .. 16g + 15.
inline __attribute__((always_inline)) void transpose16x16_halves(u8x32* a) {
  for (int round = 0; round < 4; ++round) {
    u8x32 b[16];
    for (int i = 0; i < 8; ++i) {
      b[2 * i] = __builtin_shufflevector(a[i], a[i + 8], 0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39, 16,
                                         48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55);
      b[2 * i + 1] = __builtin_shufflevector(a[i], a[i + 8], 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46,
                                             15, 47, 24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63);
    }
    for (int i = 0; i < 16; ++i) a[i] = b[i];
  }
}

// transpose64_store in 32x32 blocks (fewer shuffles per byte than the 16-byte form's 16x16 blocks: 160 against
// 256 per KiB): the four 32x32 blocks of a 32-column group, then its 32 output rows of 64 bytes.
inline void transpose64_store_32(const uint8_t* tile, int64_t ld_tile, int64_t rows, int64_t cols, uint8_t* dst,
                                 int64_t ld, bool stream) {
  const int halves = rows > 32 ? 2 : 1;
  for (int j = 0; 32 * j < cols; ++j) {  // tile columns 32j .. 32j + 31: output rows
    const int64_t nc = std::min<int64_t>(32, cols - 32 * j);
    u8x32 out[2][32];  // [tile rows 32i .. 32i + 31][output row]
    for (int i = 0; i < halves; ++i) {
      u8x32 a[32];
      for (int r = 0; r < 32; ++r) std::memcpy(&a[r], tile + ld_tile * (32 * i + r) + 32 * j, 32);
      transpose16x16_halves(a);
      transpose16x16_halves(a + 16);
      for (int c = 0; c < 16; ++c) {  // column 16h + c: rows 0-15 from a[c] half h, rows 16-31 from a[16 + c]
        out[i][c] = __builtin_shufflevector(a[c], a[16 + c], 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 32,
                                            33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47);
        out[i][16 + c] = __builtin_shufflevector(a[c], a[16 + c], 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28,
                                                 29, 30, 31, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61,
                                                 62, 63);
      }
    }
    for (int64_t c = 0; c < nc; ++c) {
      uint8_t* d = dst + (32 * j + c) * ld;
      if (rows == 64 && stream) {
        for (int i = 0; i < 2; ++i) vec::store_stream(d + 32 * i, out[i][c]);  // 16-byte pieces
      } else if (rows == 64) {
        std::memcpy(d, &out[0][c], 32);
        std::memcpy(d + 32, &out[1][c], 32);
      } else {
        for (int i = 0; i < halves; ++i) {
          std::memcpy(d + 32 * i, &out[i][c], static_cast<size_t>(std::min<int64_t>(32, rows - 32 * i)));
        }
      }
    }
  }
}
#else
#define ENGINE_TRANSPOSE_32 0
#endif

// Transposes the tile of `rows` x `cols` bytes (both <= 64) at `tile` (row r at tile + ld_tile r) and stores row c
// of the result (= column c of the tile) to dst + c * ld, for c < cols, keeping its first `rows` bytes. Rows of the
// tile's 16-row (32-row where ENGINE_TRANSPOSE_32) blocks past `rows` are read (any bytes; their results are not stored). Each output row is written
// as one run of stores (all four 16x16 blocks of a 16-column group are transposed first): a whole 64-byte line
// when rows = 64, around the caches when `stream` (vec::store_stream; then dst and ld must be multiples of 16,
// and the caller runs vec::stream_fence() before returning).
inline void transpose64_store(const uint8_t* tile, int64_t ld_tile, int64_t rows, int64_t cols, uint8_t* dst,
                              int64_t ld, bool stream) {
#if ENGINE_TRANSPOSE_32
  return transpose64_store_32(tile, ld_tile, rows, cols, dst, ld, stream);
#endif
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
