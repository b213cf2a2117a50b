// NVFP4 on the CPU, torch glue: argument checks, outputs, the per-tensor amaxes and the split over OpenMP threads;
// the kernels (nvfp4_kernels.cpp, where the rules are) of the active instruction-set level. Two passes over x:
// the amaxes (skipped for given ones), then both usages, 16 x 128 tiles at a time. Threads run with
// round-to-nearest and without flush-to-zero / denormals-are-zero (MXCSR set per thread): the E4M3 scale decode
// and the element products meet fp32 subnormals.
#include "common/glue.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cast/nvfp4.h"
#include "cast/nvfp4_glue.h"

namespace engine_native {
namespace nvfp4_glue {
namespace {

using glue::check_plain;
using glue::DefaultFpEnv;
using glue::NoPythonDispatch;

// A given per-tensor amax: a 1-element fp32 tensor, read here.
float given_amax(const Tensor& t, const char* name) {
  check_plain(t, name);
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, name, ": expected a float32 tensor, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.numel() == 1, name, ": expected a 1-element tensor, got shape ", t.sizes());
  return *t.data_ptr<float>();
}

Tensor amax_tensor(uint32_t key) {
  Tensor out = at::empty({1}, at::TensorOptions().dtype(at::kFloat).device(at::kCPU));
  const uint32_t bits = key > 0x7F800000u ? 0x7FC00000u : key;  // the canonical NaN, as reference.amax
  std::memcpy(out.data_ptr<float>(), &bits, 4);
  return out;
}

// A [rows, cols] uint8 output: fresh, or the caller's buffer (reused across calls: no page faults of fresh
// memory), which must be a contiguous uint8 tensor of exactly that shape.
Tensor output(const optional<Tensor>& given, int64_t rows, int64_t cols, const char* name) {
  if (!given.has_value()) return at::empty({rows, cols}, at::TensorOptions().dtype(at::kByte).device(at::kCPU));
  const Tensor& t = *given;
  check_plain(t, name);
  TORCH_CHECK_TYPE(t.scalar_type() == at::kByte, name, ": expected a uint8 tensor, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, name, ": expected shape [", rows, ", ",
                    cols, "], got ", t.sizes());
  TORCH_CHECK_VALUE(t.is_contiguous(), name, ": expected a contiguous tensor, got strides ", t.strides());
  return t;
}

// Calls f(u0, u1, thread) on one contiguous chunk of the tiles per thread (small jobs stay on the calling thread).
template <typename F>
void parallel_tiles(int64_t units, const F& f) {
  glue::parallel_chunks(units, glue::kElemGrain / (kNvfp4Block * kNvfp4TileCols), f);
}

// (row data, row E4M3 scales, row amax, col data, col scales, col amax); an unrequested usage gives empty
// tensors (or its out_* buffers, of shape [0, 0] then) and an undefined amax. `out_*`: the caller's buffers
// for the outputs (see `output`), none sharing memory with x or with another. `amax` / `amax_t`: given fp32
// amaxes (returned as given), else x's own (of the RHT output for an RHT'd columnwise usage). `counter`: the
// int64 (seed, offset) of stochastic rounding, read here (the caller advances it), or none for
// round-to-nearest-even. The kernels: those of the active level (common/isa.h).
}  // namespace

Nvfp4Result quantize(
    const Tensor& x_in, bool rowwise, bool columnwise, bool two_d, bool rht, const optional<Tensor>& amax,
    const optional<Tensor>& amax_t, const optional<Tensor>& counter,
    const optional<Tensor>& out_row_data, const optional<Tensor>& out_row_scales, const optional<Tensor>& out_col_data,
    const optional<Tensor>& out_col_scales, bool four_over_six, const std::string& four_over_six_err_mode,
    double four_over_six_e4m3_max) {
  NoPythonDispatch no_python;
  TORCH_CHECK_VALUE(four_over_six_err_mode == "MAE" || four_over_six_err_mode == "MSE",
                    "four_over_six_err_mode: expected 'MAE' or 'MSE', got '", four_over_six_err_mode, "'");
  TORCH_CHECK_VALUE(four_over_six_e4m3_max == 448.0 || four_over_six_e4m3_max == 256.0,
                    "four_over_six_e4m3_max: expected 448 or 256, got ", four_over_six_e4m3_max);
  TORCH_CHECK_VALUE(!(four_over_six && rht), "four_over_six and rht: TE has no 4over6 with the random Hadamard "
                    "transform; quantize this tensor with rht=False or four_over_six=False");
  TORCH_CHECK_VALUE(!(four_over_six && counter.has_value()), "four_over_six and stochastic rounding: TE refuses "
                    "4over6 with stochastic rounding; drop the counter or four_over_six");
  check_plain(x_in, "x");
  TORCH_CHECK_VALUE(x_in.dim() == 2, "x: expected the 2D view, got ", x_in.dim(), " dims");
  const auto dt = x_in.scalar_type();
  TORCH_CHECK_TYPE(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
                   "x: expected dtype float32, bfloat16 or float16, got ", dt);
  TORCH_CHECK_VALUE(!(two_d && rht), "two_d and rht: the RHT is for inputs and gradients, never with 16x16 tiles");
  const int64_t M = x_in.size(0), K = x_in.size(1);
  TORCH_CHECK_VALUE(!(rht && columnwise) || M % kNvfp4Block == 0, "x: the random Hadamard transform mixes ",
                    kNvfp4Block, " tokens, so the token count (M, the product of the leading dims) must be a "
                    "multiple of ", kNvfp4Block, ", got ", M);
  uint64_t seed = 0, offset = 0;
  if (counter.has_value()) {
    check_plain(*counter, "counter");
    TORCH_CHECK_TYPE(counter->scalar_type() == at::kLong && counter->dim() == 1 && counter->size(0) == 2, "counter: "
                     "expected an int64 tensor of shape (2,) holding (seed, offset), got ", counter->scalar_type(),
                     " ", counter->sizes());
    const Tensor c = counter->contiguous();
    seed = static_cast<uint64_t>(c.data_ptr<int64_t>()[0]);
    offset = static_cast<uint64_t>(c.data_ptr<int64_t>()[1]);
  }
  const Nvfp4Kernels& kernels = nvfp4_kernels(active_isa());
  Tensor row_data = output(out_row_data, rowwise ? M : 0, rowwise ? (K + 1) / 2 : 0, "out_row_data");
  Tensor row_scales = output(out_row_scales, rowwise ? M : 0, rowwise ? (K + kNvfp4Block - 1) / kNvfp4Block : 0,
                             "out_row_scales");
  Tensor col_data = output(out_col_data, columnwise ? K : 0, columnwise ? (M + 1) / 2 : 0, "out_col_data");
  Tensor col_scales = output(out_col_scales, columnwise ? K : 0,
                             columnwise ? (M + kNvfp4Block - 1) / kNvfp4Block : 0, "out_col_scales");
  const std::pair<const Tensor*, const char*> outs[] = {
      {&row_data, "out_row_data"}, {&row_scales, "out_row_scales"}, {&col_data, "out_col_data"},
      {&col_scales, "out_col_scales"}};
  for (size_t i = 0; i < 4; ++i) {
    const Tensor& t = *outs[i].first;
    if (t.numel() == 0) continue;
    TORCH_CHECK_VALUE(x_in.numel() == 0 || !t.storage().is_alias_of(x_in.storage()), outs[i].second,
                      ": shares memory with x; pass a separate buffer");
    for (size_t j = 0; j < i; ++j) {
      const Tensor& u = *outs[j].first;
      TORCH_CHECK_VALUE(u.numel() == 0 || !t.storage().is_alias_of(u.storage()), outs[i].second, " and ",
                        outs[j].second, ": the same memory; pass separate buffers");
    }
  }
  Tensor row_amax, col_amax;
  float row_a = 0.0f, col_a = 0.0f;
  if (rowwise && amax.has_value()) {
    row_a = given_amax(*amax, "amax");
    row_amax = amax->reshape({1});
  }
  if (columnwise && amax_t.has_value()) {
    col_a = given_amax(*amax_t, "amax_t");
    col_amax = amax_t->reshape({1});
  }
  const bool want_x = (rowwise && !row_amax.defined()) || (columnwise && !rht && !col_amax.defined());
  const bool want_rht = columnwise && rht && !col_amax.defined();
  Tensor x = dt == at::kHalf ? x_in.to(at::kFloat) : x_in;  // fp16 -> fp32 is exact (the reference does it too)
  if (M * K > 0 && !(x.stride(1) == 1 && x.stride(0) >= K)) x = x.contiguous();
  Nvfp4Job job{x.data_ptr(), x.scalar_type() == at::kBFloat16, M * K > 0 ? x.stride(0) : K, M, K, two_d, rht,
               rowwise ? row_data.data_ptr<uint8_t>() : nullptr, rowwise ? row_scales.data_ptr<uint8_t>() : nullptr,
               columnwise ? col_data.data_ptr<uint8_t>() : nullptr,
               columnwise ? col_scales.data_ptr<uint8_t>() : nullptr, 0.0f, 0.0f, counter.has_value(), seed,
               offset, offset + (rowwise ? static_cast<uint64_t>(M) * static_cast<uint64_t>(K) : 0u),
               four_over_six, four_over_six_err_mode == "MSE", static_cast<float>(four_over_six_e4m3_max)};
  const int64_t units = ((M + kNvfp4Block - 1) / kNvfp4Block) * ((K + kNvfp4TileCols - 1) / kNvfp4TileCols);
  uint32_t x_key = 0, rht_key = 0;
  if ((want_x || want_rht) && M * K > 0) {
    std::vector<uint32_t> keys(2 * (static_cast<size_t>(omp_get_max_threads()) + 1), 0u);
    parallel_tiles(units, [&](int64_t u0, int64_t u1, int t) {
      kernels.amax_tiles(job, u0, u1, want_x ? &keys[2 * t] : nullptr, want_rht ? &keys[2 * t + 1] : nullptr);
    });
    for (size_t i = 0; i < keys.size(); i += 2) {
      x_key = std::max(x_key, keys[i]);
      rht_key = std::max(rht_key, keys[i + 1]);
    }
  }
  if (rowwise && !row_amax.defined()) {
    row_amax = amax_tensor(x_key);
    row_a = *row_amax.data_ptr<float>();
  }
  if (columnwise && !col_amax.defined()) {
    col_amax = amax_tensor(rht ? rht_key : x_key);
    col_a = *col_amax.data_ptr<float>();
  }
  job.row_amax = row_a;
  job.col_amax = col_a;
  if (M * K > 0 && (rowwise || columnwise)) {
    parallel_tiles(units, [&](int64_t u0, int64_t u1, int) { kernels.quantize_tiles(job, u0, u1); });
  }
  return {row_data, row_scales, row_amax, col_data, col_scales, col_amax};
}

}  // namespace nvfp4_glue
}  // namespace engine_native
