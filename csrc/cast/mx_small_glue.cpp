// MXFP4 / MXFP6 on the CPU, torch glue: argument checks, outputs, the split over OpenMP threads and the call of
// the kernels of the active instruction-set level (mx_small_kernels.cpp, where the rules are). One pass over x
// gives both usages. Threads run with round-to-nearest and without flush-to-zero (glue::DefaultFpEnv):
// x * 2^(127 - code) can be subnormal.
#include "cast/mx_small_glue.h"

#include "cast/mx_small.h"
#include "common/glue.h"

namespace engine_native {
namespace mx_small_glue {
namespace {

using glue::check_plain;
using glue::NoPythonDispatch;

void check_kind(int64_t kind) {
  TORCH_CHECK_VALUE(kind >= 0 && kind <= 2, "element kind: expected 0 (E2M1), 1 (E2M3) or 2 (E3M2), got ", kind);
}

int64_t packed(int64_t kind, int64_t cols) { return kind == 0 ? (cols + 1) / 2 : cols; }

// Tiles of 32 rows x 256 columns per thread below which threads cost more than they save.
constexpr int64_t kTileGrain = (1 << 15) / (kMxSmallBlock * kMxSmallTileCols);

}  // namespace

std::tuple<Tensor, Tensor, Tensor, Tensor> quantize(const Tensor& x_in, int64_t kind, bool rceil, bool rowwise,
                                                    bool columnwise, const optional<Tensor>& out_row_data,
                                                    const optional<Tensor>& out_row_codes,
                                                    const optional<Tensor>& out_col_data,
                                                    const optional<Tensor>& out_col_codes) {
  NoPythonDispatch no_python;
  check_plain(x_in, "x");
  TORCH_CHECK_VALUE(x_in.dim() == 2, "x: expected the 2D view, got ", x_in.dim(), " dims");
  check_kind(kind);
  const auto dt = x_in.scalar_type();
  TORCH_CHECK_TYPE(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
                   "x: expected dtype float32, bfloat16 or float16, got ", dt);
  const int64_t M = x_in.size(0), K = x_in.size(1);
  const int64_t row_blocks = (K + kMxSmallBlock - 1) / kMxSmallBlock, col_blocks = (M + kMxSmallBlock - 1) / kMxSmallBlock;
  Tensor row_data = glue::output(out_row_data, {rowwise ? M : 0, rowwise ? packed(kind, K) : 0}, at::kByte,
                                 "out_row_data");
  Tensor row_codes = glue::output(out_row_codes, {rowwise ? M : 0, rowwise ? row_blocks : 0}, at::kByte,
                                  "out_row_codes");
  Tensor col_data = glue::output(out_col_data, {columnwise ? M : 0, columnwise ? packed(kind, K) : 0}, at::kByte,
                                 "out_col_data");
  Tensor col_codes = glue::output(out_col_codes, {columnwise ? col_blocks : 0, columnwise ? K : 0}, at::kByte,
                                  "out_col_codes");
  for (const Tensor* t : {&row_data, &row_codes, &col_data, &col_codes}) {
    TORCH_CHECK_VALUE(t->numel() == 0 || x_in.numel() == 0 || !t->storage().is_alias_of(x_in.storage()),
                      "out_*: an output shares memory with x; pass separate buffers");
  }
  if (M * K == 0 || !(rowwise || columnwise)) return {row_data, row_codes, col_data, col_codes};
  Tensor x = dt == at::kHalf ? x_in.to(at::kFloat) : x_in;  // fp16 -> fp32 is exact (the reference does it too)
  if (!(x.stride(1) == 1 && x.stride(0) >= K)) x = x.contiguous();
  const MxSmallJob job{x.data_ptr(), x.scalar_type() == at::kBFloat16, x.stride(0), M, K, static_cast<int>(kind),
                       rceil, rowwise ? glue::bytes(row_data) : nullptr, rowwise ? glue::bytes(row_codes) : nullptr,
                       columnwise ? glue::bytes(col_data) : nullptr, columnwise ? glue::bytes(col_codes) : nullptr};
  const MxSmallKernels& kernels = mx_small_kernels(active_isa());
  const int64_t tiles = col_blocks * ((K + kMxSmallTileCols - 1) / kMxSmallTileCols);
  glue::parallel_chunks(tiles, kTileGrain, [&](int64_t u0, int64_t u1, int) { kernels.quantize_tiles(job, u0, u1); });
  return {row_data, row_codes, col_data, col_codes};
}

Tensor elements_to_bf16(const Tensor& data_in, int64_t kind, int64_t cols) {
  NoPythonDispatch no_python;
  check_plain(data_in, "data");
  TORCH_CHECK_TYPE(data_in.scalar_type() == at::kByte, "data: expected uint8 element codes, got ",
                   data_in.scalar_type());
  check_kind(kind);
  TORCH_CHECK_VALUE(data_in.dim() >= 1 && cols >= 0 && data_in.size(-1) == packed(kind, cols), "cols: ", cols,
                    " elements need ", packed(kind, std::max<int64_t>(cols, 0)), " bytes along the last dim, got ",
                    data_in.sizes());
  const Tensor data = data_in.contiguous();
  std::vector<int64_t> shape(data.sizes().begin(), data.sizes().end());
  shape.back() = cols;
  Tensor result = at::empty(shape, at::TensorOptions().dtype(at::kBFloat16).device(at::kCPU));
  const int64_t rows = cols == 0 ? 0 : result.numel() / cols;
  if (rows == 0) return result;
  const MxSmallKernels& kernels = mx_small_kernels(active_isa());
  const uint8_t* in = glue::bytes(data);
  uint16_t* out = static_cast<uint16_t*>(result.data_ptr());
  const int64_t stride = data.size(-1);
  glue::parallel_chunks(rows, std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(cols, 1)),
                        [&](int64_t r0, int64_t r1, int) { kernels.decode_rows(in, stride, out, cols, kind, r0, r1); });
  return result;
}

}  // namespace mx_small_glue
}  // namespace engine_native
