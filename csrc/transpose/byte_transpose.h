// The 64x64 byte transpose of the transposing casts (cast/fp8_kernels.cpp): a tile of 64 rows of 64 bytes
// in a buffer, written out as its 64 columns. The tile is a 4 x 4 grid of 16 x 16 byte blocks; each block
// is transposed in 16-byte registers by four rounds of byte interleaves (unpack low / high of rows i and
// i + 8, `__builtin_shufflevector` with constant indices: punpck{l,h}bw at every x86 level, zip1/zip2 on
// NEON), and its 16 rows go out as 16-byte stores, so every output row gets 4 consecutive stores.
// (The previous form, 8x8 swaps on 64-bit words with 8-byte stores, measured 1.2-1.4x slower at avx2.)
//
// Include only from a `*_kernels.cpp` (after isa_begin.h).
#pragma once

#ifndef ENGINE_ISA_NS
#error "transpose/byte_transpose.h is for *_kernels.cpp sources (compiled per instruction set)"
#endif

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

// Transposes the 64x64 byte tile `tile` (row r at tile + 64 r) and stores row c of the result (= column c
// of the tile) to dst + c * ld, for c < cols, keeping its first `rows` bytes.
inline void transpose64_store(const uint8_t* tile, int64_t rows, int64_t cols, uint8_t* dst, int64_t ld) {
  for (int j = 0; 16 * j < cols; ++j) {  // tile columns 16j .. 16j + 15: output rows
    const int64_t nc = std::min<int64_t>(16, cols - 16 * j);
    for (int i = 0; 16 * i < rows; ++i) {  // tile rows 16i .. 16i + 15: bytes 16i .. of those output rows
      u8x16 a[16];
      for (int r = 0; r < 16; ++r) std::memcpy(&a[r], tile + 64 * (16 * i + r) + 16 * j, 16);
      transpose16x16_bytes(a);
      const int64_t n = std::min<int64_t>(16, rows - 16 * i);
      for (int64_t c = 0; c < nc; ++c) {
        uint8_t* d = dst + (16 * j + c) * ld + 16 * i;
        if (n == 16) {
          std::memcpy(d, &a[c], 16);
        } else {
          std::memcpy(d, &a[c], static_cast<size_t>(n));
        }
      }
    }
  }
}

}  // namespace transpose
}  // namespace ENGINE_ISA_NS
}  // namespace engine_native
