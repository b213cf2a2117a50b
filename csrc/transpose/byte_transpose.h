// The 64x64 byte transpose of the transposing casts (cast/fp8_kernels.cpp): a tile of 64 rows of 64 bytes
// in a buffer, written out as its 64 columns. Written on 64-bit words so that it vectorises at every
// instruction-set level with lane-wise shifts, ands and xors only (no shuffles): the tile is an 8 x 8 grid of
// 8 x 8 byte blocks; block row i's 8 rows, as vectors of their 8 words (one per block column), go through
// the three swap stages of an 8x8 byte transpose, which transposes every block at once; each transposed
// block's rows then go to their output row (the grid's transpose) as 8-byte stores.
//
// Include only from a `*_kernels.cpp` (after isa_begin.h).
#pragma once

#ifndef ENGINE_ISA_NS
#error "transpose/byte_transpose.h is for *_kernels.cpp sources (compiled per instruction set)"
#endif

namespace engine_native {
namespace ENGINE_ISA_NS {
namespace transpose {

typedef uint64_t u64x8 __attribute__((vector_size(64)));

// a[r] byte c <-> a[c] byte r for the 8 x 8 bytes of every lane: swaps of 1-, 2- and 4-byte pieces between
// rows 1, 2 and 4 apart.
inline __attribute__((always_inline)) void transpose8x8_bytes(u64x8 a[8]) {
  for (int r = 0; r < 8; r += 2) {
    const u64x8 t = ((a[r] >> 8) ^ a[r + 1]) & 0x00FF00FF00FF00FFull;
    a[r + 1] ^= t;
    a[r] ^= t << 8;
  }
  for (int r : {0, 1, 4, 5}) {
    const u64x8 t = ((a[r] >> 16) ^ a[r + 2]) & 0x0000FFFF0000FFFFull;
    a[r + 2] ^= t;
    a[r] ^= t << 16;
  }
  for (int r = 0; r < 4; ++r) {
    const u64x8 t = ((a[r] >> 32) ^ a[r + 4]) & 0x00000000FFFFFFFFull;
    a[r + 4] ^= t;
    a[r] ^= t << 32;
  }
}

// Transposes the 64x64 byte tile `tile` (row r at tile + 64 r) and stores row c of the result (= column c
// of the tile) to dst + c * ld, for c < cols, keeping its first `rows` bytes.
inline void transpose64_store(const uint8_t* tile, int64_t rows, int64_t cols, uint8_t* dst, int64_t ld) {
  for (int i = 0; i < 8 && 8 * i < rows; ++i) {  // block row i: tile rows 8i .. 8i + 7
    u64x8 a[8];
    for (int r = 0; r < 8; ++r) std::memcpy(&a[r], tile + 64 * (8 * i + r), 64);
    transpose8x8_bytes(a);
    // a[c] word j = column 8j + c of the tile, rows 8i .. 8i + 7: bytes 8i .. of output row 8j + c
    const int64_t n = std::min<int64_t>(8, rows - 8 * i);
    for (int j = 0; j < 8 && 8 * j < cols; ++j) {
      for (int c = 0; c < 8 && 8 * j + c < cols; ++c) {
        const uint64_t w = a[c][j];
        uint8_t* d = dst + (8 * j + c) * ld + 8 * i;
        if (n == 8) {
          std::memcpy(d, &w, 8);
        } else {
          std::memcpy(d, &w, static_cast<size_t>(n));
        }
      }
    }
  }
}

}  // namespace transpose
}  // namespace ENGINE_ISA_NS
}  // namespace engine_native
