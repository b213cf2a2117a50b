// Torch glue of the FP8 casts (cast/fp8.h): amax, per-tensor cast (+ transpose), block scaling
// (1x128, 128x128, any tile), MXFP8; argument checks, outputs, the split over threads.
#include "common/glue.h"

#include <cmath>
#include <cstring>
#include <string>
#include <tuple>

#include "cast/fp8.h"
#include "cast/fp8_glue.h"

namespace engine_native {
namespace fp8_glue {

using namespace glue;

const Kernels& kernels() { return fp8_table(active_isa()); }

// transposed view). Anything else is made contiguous by the caller.
optional<Src> row_major(const Tensor& x) {
  const int64_t R = x.size(0), C = x.size(1);
  if (C == 1 || x.stride(1) == 1) return Src{x.data_ptr(), in_type(x, "x"), R == 1 ? C : x.stride(0)};
  return c10::nullopt;
}

bool column_major(const Tensor& x) { return x.size(0) > 1 && x.size(1) > 1 && x.stride(0) == 1; }

// --------------------------------------------------------------------------------- amax
float amax_of(const Tensor& x) {
  if (x.numel() == 0) return 0.0f;
  Tensor flat = x.is_non_overlapping_and_dense() ? x : x.contiguous();
  const InType type = in_type(flat, "x");
  const void* data = flat.data_ptr();
  const Kernels& k = kernels();
  const uint32_t key = parallel_max_key(flat.numel(), kElemGrain, [&](int64_t b, int64_t e) {
    return k.amax_key(data, type, b, e);
  });
  return key_to_amax(key);
}

Tensor amax(const Tensor& x, const optional<Tensor>& out) {
  NoPythonDispatch no_python;
  check_plain(x, "x");
  in_type(x, "x");
  Tensor result = output(out, {1}, at::kFloat, "out");
  check_disjoint(result, "out", x, "x");
  result.data_ptr<float>()[0] = amax_of(x);
  return result;
}

// ---------------------------------------------------------------------- per-tensor casts
// (swapped) when x is a column-major 2D view. `holder` keeps a contiguous copy alive, made
// only when x is neither.
struct Matrix {
  Tensor holder;
  Src src;
  int64_t rows, cols;
  bool swapped;
};

Matrix as_matrix(const Tensor& x_in, int64_t M, int64_t K, const char* name) {
  const InType type = in_type(x_in, name);
  if (x_in.dim() != 2 && x_in.is_contiguous()) return {x_in, Src{x_in.data_ptr(), type, K}, M, K, false};
  Tensor x = x_in.dim() == 2 ? x_in : x_in.reshape({M, K});  // a view when the strides allow
  if (column_major(x)) return {x, Src{x.data_ptr(), type, x.stride(1)}, K, M, true};
  if (!row_major(x).has_value()) x = x.contiguous();
  return {x, *row_major(x), M, K, false};
}

uint32_t matrix_amax_key(const Matrix& m) {
  const Kernels& k = kernels();
  const Src s = m.src;
  if (s.ld == m.cols) {
    return parallel_max_key(m.rows * m.cols, kElemGrain,
                            [&](int64_t b, int64_t e) { return k.amax_key(s.data, s.type, b, e); });
  }
  return parallel_max_key(m.rows, std::max<int64_t>(1, kElemGrain / m.cols), [&](int64_t b, int64_t e) {
    uint32_t best = 0;
    for (int64_t r = b; r < e; ++r) best = std::max(best, k.amax_key(s.data, s.type, r * s.ld, r * s.ld + m.cols));
    return best;
  });
}

// sat(x * scale) for the M x K matrix of `m` (M * K > 0): codes row-major into `data`
// (M x K) and/or transposed into `data_t` (K x M). Returns the amax key of x.
uint32_t cast_matrix(const Matrix& m, float scale, Fp8Kind kind, uint8_t* data, uint8_t* data_t) {
  const int64_t n = m.rows * m.cols;
  if (is_nan_f32(scale)) {
    // x * NaN is NaN for every element, so the data is the canonical NaN code 0x7F
    // throughout; only the amax needs the input.
    if (data) std::memset(data, 0x7F, static_cast<size_t>(n));
    if (data_t) std::memset(data_t, 0x7F, static_cast<size_t>(n));
    return matrix_amax_key(m);
  }
  // A swapped matrix is x^T: its row-major codes are data_t, its transposed ones data.
  const Src src = m.src;
  const int64_t rows = m.rows, cols = m.cols;
  uint8_t* out_row = m.swapped ? data_t : data;
  uint8_t* out_col = m.swapped ? data : data_t;
  const Kernels& k = kernels();
  if (out_col == nullptr && src.ld == cols) {
    // rowwise only on contiguous data: one flat pass
    return parallel_max_key(n, kElemGrain, [&](int64_t b, int64_t e) {
      if (out_row == nullptr) return k.amax_key(src.data, src.type, b, e);
      return k.cast(src.data, src.type, b, e, scale, kind, out_row);
    });
  }
  // Units of 64 rows x up to 1024 columns, all the row blocks of a column chunk in a
  // row: the 1024 rows of data_t they write stay in the TLB (each row is a page apart).
  const int64_t row_blocks = (rows + 63) / 64, col_chunks = (cols + 1023) / 1024;
  return parallel_max_key(row_blocks * col_chunks, std::max<int64_t>(1, kElemGrain / (64 * 1024)),
                          [&](int64_t b, int64_t e) {
                            uint32_t best = 0;
                            for (int64_t u = b; u < e; ++u) {
                              const int64_t r0 = (u % row_blocks) * 64, c0 = (u / row_blocks) * 1024;
                              const int64_t r1 = std::min(rows, r0 + 64), c1 = std::min(cols, c0 + 1024);
                              best = std::max(best, k.cast_transpose_region(src, rows, cols, r0, r1, c0, c1, scale,
                                                                            kind, out_row, out_col));
                            }
                            return best;
                          });
}


CastTransposeResult cast_transpose(const Tensor& x_in, const Tensor& scale_t, int64_t kind_i, bool rowwise,
                                   bool columnwise, const optional<Tensor>& out_data,
                                   const optional<Tensor>& out_data_t, const optional<Tensor>& out_amax) {
  NoPythonDispatch no_python;
  check_plain(x_in, "x2d");
  in_type(x_in, "x2d");
  TORCH_CHECK_VALUE(x_in.dim() == 2, "x2d: expected a 2D tensor, got ", x_in.dim(), " dims");
  const float scale = *scalar_f32(scale_t, "scale");
  const Fp8Kind kind = fp8_kind(kind_i);
  const int64_t M = x_in.size(0), K = x_in.size(1);
  optional<Tensor> data, data_t;
  if (rowwise) data = output(out_data, {M, K}, fp8_dtype(kind), "out_data");
  if (columnwise) data_t = output(out_data_t, {K, M}, fp8_dtype(kind), "out_data_t");
  Tensor amax_t = output(out_amax, {1}, at::kFloat, "out_amax");
  check_all_disjoint({{&x_in, "x2d"}, {ptr(data), "out_data"}, {ptr(data_t), "out_data_t"}, {&amax_t, "out_amax"}});
  DefaultFpEnv env;
  uint32_t key = 0;
  if (M * K > 0) key = cast_matrix(as_matrix(x_in, M, K, "x2d"), scale, kind, maybe_bytes(data), maybe_bytes(data_t));
  amax_t.data_ptr<float>()[0] = key_to_amax(key);
  return {data, data_t, amax_t};
}

// Per-tensor quantization in one call: (data in x's shape | None, data_t [K, M] | None,
// scale_inv [1] = 1 / scale, amax [1] = max|x|). The scale is the given 1-element `scale`
// (delayed scaling), or the current-scaling rule of x's amax (reference.compute_scale with
// power-of-2 and epsilon options; an inf scale becomes FLT_MAX). With `record_amax`,
// max(record_amax, amax) is written into it (torch.maximum: NaN if either is NaN).

PerTensorResult quantize_per_tensor(const Tensor& x, int64_t kind_i, bool rowwise, bool columnwise,
                                    const optional<Tensor>& scale_t, bool pow2, double amax_epsilon,
                                    const optional<Tensor>& record_amax, const optional<Tensor>& out_data,
                                    const optional<Tensor>& out_data_t, const optional<Tensor>& out_scale_inv,
                                    const optional<Tensor>& out_amax) {
  NoPythonDispatch no_python;
  check_plain(x, "x");
  in_type(x, "x");
  const Fp8Kind kind = fp8_kind(kind_i);
  const float* given = scale_t ? scalar_f32(*scale_t, "scale") : nullptr;
  float* recorded = record_amax ? scalar_f32(*record_amax, "record_amax") : nullptr;
  // the 2D view of reference.as_2d: M = prod(leading dims), K = last dim (a scalar is 1 x 1)
  const int64_t K = x.dim() == 0 ? 1 : x.size(-1);
  int64_t M = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) M *= x.size(d);
  optional<Tensor> data, data_t;
  if (rowwise) data = output(out_data, x.sizes(), fp8_dtype(kind), "out_data");
  if (columnwise) data_t = output(out_data_t, {K, M}, fp8_dtype(kind), "out_data_t");
  Tensor scale_inv = output(out_scale_inv, {1}, at::kFloat, "out_scale_inv");
  Tensor amax_t = output(out_amax, {1}, at::kFloat, "out_amax");
  check_all_disjoint({{&x, "x"},
                      {ptr(data), "out_data"},
                      {ptr(data_t), "out_data_t"},
                      {&scale_inv, "out_scale_inv"},
                      {&amax_t, "out_amax"},
                      {ptr(record_amax), "record_amax"}});

  DefaultFpEnv env;
  float scale = given ? *given : 1.0f;
  uint32_t key = 0;
  if (M * K > 0) {
    const Matrix m = as_matrix(x, M, K, "x");
    if (!given) key = matrix_amax_key(m);
    const Fp8Format f = fp8_format(kind);
    if (!given) scale = compute_scale(key_to_amax(key), ScaleRule{f.max, pow2, static_cast<float>(amax_epsilon),
                                                                  3.4028234663852886e38f});
    key = cast_matrix(m, scale, kind, maybe_bytes(data), maybe_bytes(data_t));
  } else if (!given) {
    const Fp8Format f = fp8_format(kind);  // no elements: amax 0 (epsilon may still apply)
    scale = compute_scale(0.0f, ScaleRule{f.max, pow2, static_cast<float>(amax_epsilon), 3.4028234663852886e38f});
  }
  const float amax = key_to_amax(key);
  scale_inv.data_ptr<float>()[0] = 1.0f / scale;
  amax_t.data_ptr<float>()[0] = amax;
  if (recorded) {
    const float old = *recorded;
    *recorded = (is_nan_f32(old) || is_nan_f32(amax)) ? bits_f32(0x7FC00000u) : (old < amax ? amax : old);
  }
  return {data, data_t, scale_inv, amax_t};
}

// ------------------------------------------------------------------------ block scaling
std::tuple<Tensor, Tensor> quantize_block(const Tensor& x_in, int64_t kind_i, int64_t tile_rows, int64_t tile_cols,
                                          bool pow2, double amax_epsilon, double value_for_inf,
                                          const optional<Tensor>& out_data, const optional<Tensor>& out_scale_inv) {
  NoPythonDispatch no_python;
  check_plain(x_in, "x2d");
  in_type(x_in, "x2d");
  TORCH_CHECK_VALUE(x_in.dim() == 2, "x2d: expected a 2D tensor, got ", x_in.dim(), " dims");
  TORCH_CHECK_VALUE(tile_rows >= 1 && tile_cols >= 1, "tile_rows and tile_cols must be >= 1, got ", tile_rows, " and ",
                    tile_cols);
  const Fp8Kind kind = fp8_kind(kind_i);
  const int64_t M = x_in.size(0), K = x_in.size(1);
  const int64_t tm = (M + tile_rows - 1) / tile_rows, tk = (K + tile_cols - 1) / tile_cols;
  Tensor data = output(out_data, {M, K}, fp8_dtype(kind), "out_data");
  Tensor scale_inv = output(out_scale_inv, {tm, tk}, at::kFloat, "out_scale_inv");
  check_disjoint(data, "out_data", x_in, "x2d");
  check_disjoint(scale_inv, "out_scale_inv", x_in, "x2d");
  check_disjoint(scale_inv, "out_scale_inv", data, "out_data");
  if (M * K == 0) return {data, scale_inv};

  const Fp8Format f = fp8_format(kind);
  const ScaleRule rule{f.max, pow2, static_cast<float>(amax_epsilon), static_cast<float>(value_for_inf)};
  const BlockParams p{tile_rows, tile_cols, rule, kind};
  float* sinv = scale_inv.data_ptr<float>();
  uint8_t* out = bytes(data);
  // The hand-written AVX-512 kernels (fp8_table) need every tile scale to be a positive normal number, which
  // holds unless value_for_inf itself is not one, and panels of at most 1024 columns; the portable source
  // (fp8_kernels) takes anything.
  const float vfi = p.rule.value_for_inf;
  const bool normal_vfi = vfi >= 1.17549435e-38f && vfi <= 3.4028234663852886e38f;
  const Kernels& kern = normal_vfi ? kernels() : fp8_kernels(active_isa());

  // a panel holds whole tiles of at most kPanel (1024) columns of y: taller tiles read a row-major copy
  if (column_major(x_in) && tile_rows <= 1024) {
    // x2d = y^T for a row-major y (A x B = K x M): tiles of x2d are transposed panels of y.
    const Src src{x_in.data_ptr(), in_type(x_in, "x2d"), x_in.stride(1)};
    const int64_t A = K, B = M;
    // columns of y per panel: whole tiles, 128 KiB of input per 128 rows (long row
    // segments to read; the panel and the next one, prefetched, stay in L2)
    const int64_t target = std::min<int64_t>(1024, (128 * 1024 / 128) / x_in.element_size());
    const int64_t width = tile_rows * std::max<int64_t>(1, target / tile_rows);
    const Kernels& k = kern;
    const int64_t a_panels = tk, b_panels = (B + width - 1) / width;
    parallel_chunks(a_panels * b_panels, std::max<int64_t>(1, kElemGrain / (width * tile_cols)),
                    [&](int64_t b, int64_t e, int) {
                      for (int64_t u = b; u < e; ++u) {
                        // all the row tiles of a column panel in a row: its rows of
                        // scale_inv (one float per tile) fill up while in cache
                        const int64_t a0 = (u % a_panels) * tile_cols, b0 = (u / a_panels) * width;
                        k.block_transposed(src, A, B, p, a0, std::min(A, a0 + tile_cols), b0, std::min(B, b0 + width),
                                           out, sinv);
                      }
                    });
    return {data, scale_inv};
  }
  Tensor x = row_major(x_in).has_value() ? x_in : x_in.contiguous();
  const Src src = *row_major(x);
  const Kernels& k = kern;
  parallel_chunks(tm * tk, std::max<int64_t>(1, kElemGrain / (tile_rows * tile_cols)), [&](int64_t b, int64_t e, int) {
    k.block_rowwise(src, M, K, p, b, e, out, sinv);
  });
  return {data, scale_inv};
}

// --------------------------------------------------------------------------------- MXFP8
std::tuple<Tensor, Tensor> quantize_mxfp8(const Tensor& x_in, int64_t kind_i, bool rceil, bool columnwise,
                                          const optional<Tensor>& out_data, const optional<Tensor>& out_codes) {
  NoPythonDispatch no_python;
  check_plain(x_in, "x");
  in_type(x_in, "x");
  TORCH_CHECK_VALUE(x_in.dim() == 2, "x: expected the 2D view, got ", x_in.dim(), " dims");
  const Fp8Kind kind = fp8_kind(kind_i);
  const int64_t M = x_in.size(0), K = x_in.size(1);
  constexpr int64_t kBlock = 32;
  const int64_t code_rows = columnwise ? (M + kBlock - 1) / kBlock : M;
  const int64_t code_cols = columnwise ? K : (K + kBlock - 1) / kBlock;
  Tensor data = output(out_data, {M, K}, fp8_dtype(kind), "out_data");
  Tensor codes = output(out_codes, {code_rows, code_cols}, at::kByte, "out_scale");
  check_disjoint(data, "out_data", x_in, "x");
  check_disjoint(codes, "out_scale", x_in, "x");
  check_disjoint(codes, "out_scale", data, "out_data");
  if (M * K == 0) return {data, codes};

  Tensor x = row_major(x_in).has_value() ? x_in : x_in.contiguous();
  const Src src = *row_major(x);
  const Kernels& k = kernels();
  uint8_t* out = bytes(data);
  uint8_t* c = bytes(codes);
  if (!columnwise) {
    parallel_chunks(M, std::max<int64_t>(1, kElemGrain / K), [&](int64_t b, int64_t e, int) {
      k.mx_rowwise(src, M, K, kind, rceil, b, e, out, c);
    });
  } else {
    constexpr int64_t kChunk = 512;  // columns per work unit
    const int64_t chunks = (K + kChunk - 1) / kChunk;
    parallel_chunks(code_rows * chunks, std::max<int64_t>(1, kElemGrain / (kBlock * kChunk)),
                    [&](int64_t b, int64_t e, int) {
                      for (int64_t u = b; u < e; ++u) {
                        const int64_t br = u / chunks, c0 = (u % chunks) * kChunk;
                        k.mx_colwise(src, M, K, kind, rceil, br, br + 1, c0, std::min(K, c0 + kChunk), out, c);
                      }
                    });
  }
  return {data, codes};
}

// ------------------------------------------------------------- both usages in one call
// (rowwise data, its scales, columnwise data, its scales), None for a usage not asked for: what the
// Python wrappers' two calls gave, with one call's checks and binding cost (~10 us of a 16x256 Linear's
// step per quantized tensor).

// Block scaling: the rowwise usage from x2d, the columnwise one from its transposed view, same tiles.
UsageBuffers quantize_block_usages(const Tensor& x2d, int64_t kind, int64_t tile_rows, int64_t tile_cols, bool pow2,
                                   double amax_epsilon, double value_for_inf, bool rowwise, bool columnwise,
                                   const optional<Tensor>& out_row_data, const optional<Tensor>& out_col_data) {
  UsageBuffers r;
  TORCH_CHECK_VALUE(x2d.dim() == 2, "x2d: expected a 2D tensor, got ", x2d.dim(), " dims");
  if (rowwise) {
    std::tie(std::get<0>(r), std::get<1>(r)) = quantize_block(x2d, kind, tile_rows, tile_cols, pow2, amax_epsilon,
                                                              value_for_inf, out_row_data, c10::nullopt);
  }
  if (columnwise && rowwise && tile_rows == tile_cols) {
    // square tiles: tile (i, j) of x2d^T is tile (j, i) of x2d, with the same amax, scale and cast of each
    // element, so the columnwise usage is the rowwise one transposed, bit for bit (a byte transpose, not a pass)
    const Tensor& row = *std::get<0>(r);
    const int64_t M = row.size(0), K = row.size(1);
    Tensor col = output(out_col_data, {K, M}, row.scalar_type(), "out_col_data");
    check_disjoint(col, "out_col_data", x2d, "x2d");
    check_disjoint(col, "out_col_data", row, "out_row_data");
    const uint8_t* src = bytes(row);
    uint8_t* dst = bytes(col);
    const Kernels& kern = kernels();
    parallel_chunks((M + 63) / 64, std::max<int64_t>(1, kElemGrain / (64 * std::max<int64_t>(1, K))),
                    [&](int64_t b, int64_t e, int) { kern.transpose_bytes(src, M, K, 64 * b, std::min(M, 64 * e), dst); });
    const Tensor& row_scale = *std::get<1>(r);  // [tm, tk], contiguous
    Tensor col_scale = at::empty({row_scale.size(1), row_scale.size(0)}, row_scale.options());
    const float* rs = row_scale.data_ptr<float>();
    float* cs = col_scale.data_ptr<float>();
    for (int64_t i = 0; i < row_scale.size(0); ++i)
      for (int64_t j = 0; j < row_scale.size(1); ++j) cs[j * row_scale.size(0) + i] = rs[i * row_scale.size(1) + j];
    std::get<2>(r) = col;
    std::get<3>(r) = col_scale;
  } else if (columnwise) {
    std::tie(std::get<2>(r), std::get<3>(r)) = quantize_block(x2d.t(), kind, tile_rows, tile_cols, pow2, amax_epsilon,
                                                              value_for_inf, out_col_data, c10::nullopt);
  }
  return r;
}

// MXFP8: 1x32 and 32x1 blocks of x2d, both in x2d's shape.
UsageBuffers quantize_mxfp8_usages(const Tensor& x2d, int64_t kind, bool rceil, bool rowwise, bool columnwise,
                                   const optional<Tensor>& out_row_data, const optional<Tensor>& out_col_data) {
  UsageBuffers r;
  const Kernels& k = kernels();
  if (rowwise && columnwise && k.mx_both != nullptr) {
    // one read of x for both (the kernel's table has mx_both): quantize_mxfp8's checks and outputs, twice
    NoPythonDispatch no_python;
    check_plain(x2d, "x");
    in_type(x2d, "x");
    TORCH_CHECK_VALUE(x2d.dim() == 2, "x: expected the 2D view, got ", x2d.dim(), " dims");
    const Fp8Kind kd = fp8_kind(kind);
    const int64_t M = x2d.size(0), K = x2d.size(1);
    constexpr int64_t kBlock = 32, kChunk = 512;  // kChunk: columns per work unit, as the columnwise pass
    const int64_t block_rows = (M + kBlock - 1) / kBlock;
    Tensor row_data = output(out_row_data, {M, K}, fp8_dtype(kd), "out_row_data");
    Tensor col_data = output(out_col_data, {M, K}, fp8_dtype(kd), "out_col_data");
    Tensor row_codes = at::empty({M, (K + kBlock - 1) / kBlock}, x2d.options().dtype(at::kByte));
    Tensor col_codes = at::empty({block_rows, K}, x2d.options().dtype(at::kByte));
    check_all_disjoint({{&x2d, "x"}, {&row_data, "out_row_data"}, {&col_data, "out_col_data"}});
    if (M * K > 0) {
      DefaultFpEnv env;
      Tensor x = row_major(x2d).has_value() ? x2d : x2d.contiguous();
      const Src src = *row_major(x);
      uint8_t *orow = bytes(row_data), *ocol = bytes(col_data), *crow = bytes(row_codes), *ccol = bytes(col_codes);
      const int64_t chunks = (K + kChunk - 1) / kChunk;
      parallel_chunks(block_rows * chunks, std::max<int64_t>(1, kElemGrain / (kBlock * kChunk)),
                      [&](int64_t b, int64_t e, int) {
                        for (int64_t u = b; u < e; ++u) {
                          const int64_t br = u / chunks, c0 = (u % chunks) * kChunk;
                          k.mx_both(src, M, K, kd, rceil, br, br + 1, c0, std::min(K, c0 + kChunk), orow, crow, ocol,
                                    ccol);
                        }
                      });
    }
    return {row_data, row_codes, col_data, col_codes};
  }
  if (rowwise) {
    std::tie(std::get<0>(r), std::get<1>(r)) = quantize_mxfp8(x2d, kind, rceil, false, out_row_data, c10::nullopt);
  }
  if (columnwise) {
    std::tie(std::get<2>(r), std::get<3>(r)) = quantize_mxfp8(x2d, kind, rceil, true, out_col_data, c10::nullopt);
  }
  return r;
}

}  // namespace fp8_glue
}  // namespace engine_native
