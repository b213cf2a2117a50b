// MXFP4 / MXFP6 on the CPU, torch glue: argument checks, outputs, the split over OpenMP threads, the choice
// of the portable or AVX-512 build of the kernels (mx_small_kernels.h, where the rules are), and the decode
// of element codes to bf16. One pass over x gives both usages: tiles of 32 rows x 256 columns are converted
// to fp32 once and read for the rowwise 1x32 and the columnwise 32x1 blocks. Threads run with
// round-to-nearest and without flush-to-zero (MXCSR set per thread): x * 2^(127 - code) can be subnormal.
#include <torch/extension.h>

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#define ENGINE_MX_X86 1
#endif

#include "cast/mx_small.h"

#define MX_SMALL_NAMESPACE mx_small_portable
#include "cast/mx_small_kernels.h"

#include "common/native_glue.h"

namespace engine_native {
namespace mx_small_glue {
namespace {

using at::Tensor;

// The MX kernels also use VBMI's byte permutes and BMI2's pext.
bool cpu_has_avx512() {
#if defined(ENGINE_MX_X86) && (defined(__GNUC__) || defined(__clang__))
  return glue::cpu_has_avx512() && __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("bmi2");
#else
  return false;
#endif
}

using glue::check_plain;
using glue::DefaultFpEnv;
using glue::NoPythonDispatch;

void check_kind(int64_t kind) {
  TORCH_CHECK_VALUE(kind >= 0 && kind <= 2, "element kind: expected 0 (E2M1), 1 (E2M3) or 2 (E3M2), got ", kind);
}

int64_t packed(int64_t kind, int64_t cols) { return kind == 0 ? (cols + 1) / 2 : cols; }

// (row data, row codes, col data, col codes); an unrequested usage gives empty tensors. `isa`: "avx512" or
// "portable" (the extension's current choice, engine.ops.native.isa()).
// A caller's output buffer (reused across calls: no page faults of fresh memory) must match exactly.
Tensor output(const c10::optional<Tensor>& given, at::IntArrayRef shape, const char* name) {
  if (!given.has_value()) return at::empty(shape, at::TensorOptions().dtype(at::kByte).device(at::kCPU));
  const Tensor& t = *given;
  check_plain(t, name);
  TORCH_CHECK_VALUE(t.scalar_type() == at::kByte && t.sizes() == shape && t.is_contiguous(), name,
                    ": expected a contiguous uint8 tensor of shape ", shape, ", got ", t.scalar_type(), " ", t.sizes());
  return t;
}

std::tuple<Tensor, Tensor, Tensor, Tensor> quantize(const Tensor& x_in, int64_t kind, bool rceil, bool rowwise,
                                                    bool columnwise, const std::string& isa,
                                                    const c10::optional<Tensor>& out_row_data,
                                                    const c10::optional<Tensor>& out_row_codes,
                                                    const c10::optional<Tensor>& out_col_data,
                                                    const c10::optional<Tensor>& out_col_codes) {
  NoPythonDispatch no_python;
  check_plain(x_in, "x");
  TORCH_CHECK_VALUE(x_in.dim() == 2, "x: expected the 2D view, got ", x_in.dim(), " dims");
  check_kind(kind);
  const auto dt = x_in.scalar_type();
  TORCH_CHECK_TYPE(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
                   "x: expected dtype float32, bfloat16 or float16, got ", dt);
  parse_isa(isa);
  const bool avx512 = isa == "avx512" && mx_small_avx512::compiled() && cpu_has_avx512();
  const int64_t M = x_in.size(0), K = x_in.size(1);
  Tensor row_data = output(out_row_data, {rowwise ? M : 0, rowwise ? packed(kind, K) : 0}, "out_row_data");
  Tensor row_codes = output(out_row_codes, {rowwise ? M : 0, rowwise ? (K + kMxSmallBlock - 1) / kMxSmallBlock : 0},
                            "out_row_codes");
  Tensor col_data = output(out_col_data, {columnwise ? M : 0, columnwise ? packed(kind, K) : 0}, "out_col_data");
  Tensor col_codes = output(out_col_codes,
                            {columnwise ? (M + kMxSmallBlock - 1) / kMxSmallBlock : 0, columnwise ? K : 0},
                            "out_col_codes");
  for (const Tensor* t : {&row_data, &row_codes, &col_data, &col_codes}) {
    TORCH_CHECK_VALUE(t->numel() == 0 || x_in.numel() == 0 || !t->storage().is_alias_of(x_in.storage()),
                      "out_*: an output shares memory with x; pass separate buffers");
  }
  if (M * K == 0 || !(rowwise || columnwise)) return {row_data, row_codes, col_data, col_codes};
  Tensor x = dt == at::kHalf ? x_in.to(at::kFloat) : x_in;  // fp16 -> fp32 is exact (the reference does it too)
  if (!(x.stride(1) == 1 && x.stride(0) >= K)) x = x.contiguous();
  MxSmallJob job{x.data_ptr(), x.scalar_type() == at::kBFloat16, x.stride(0), M, K, static_cast<int>(kind), rceil,
                 rowwise ? row_data.data_ptr<uint8_t>() : nullptr, rowwise ? row_codes.data_ptr<uint8_t>() : nullptr,
                 columnwise ? col_data.data_ptr<uint8_t>() : nullptr,
                 columnwise ? col_codes.data_ptr<uint8_t>() : nullptr};
  const int64_t units = ((M + kMxSmallBlock - 1) / kMxSmallBlock) * ((K + kMxSmallTileCols - 1) / kMxSmallTileCols);
  const int64_t want = std::max<int64_t>(1, M * K / (1 << 15));  // small jobs stay on the calling thread
  const int threads = static_cast<int>(std::min<int64_t>({static_cast<int64_t>(omp_get_max_threads()), want, units}));
  auto work = [&](int64_t u0, int64_t u1) {
    DefaultFpEnv env;
    if (avx512) {
      mx_small_avx512::mx_small_tiles(job, u0, u1);
    } else {
      mx_small_portable::mx_small_tiles(job, u0, u1);
    }
  };
  if (threads <= 1 || omp_in_parallel()) {
    work(0, units);
  } else {
#pragma omp parallel num_threads(threads)
    {
      const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
      const int64_t u0 = units * t / nt, u1 = units * (t + 1) / nt;
      if (u0 < u1) work(u0, u1);
    }
  }
  return {row_data, row_codes, col_data, col_codes};
}

// bf16 bits of an element code: exact (at most 4 significant bits), the sign kept on zero.
uint16_t bf16_of_code(uint32_t code, int eb, int mb, int bias) {
  const uint32_t sign = (code >> (eb + mb)) & 1u;
  const uint32_t exponent = (code >> mb) & ((1u << eb) - 1u), mantissa = code & ((1u << mb) - 1u);
  float value;
  if (exponent == 0) {
    value = std::ldexp(static_cast<float>(mantissa), 1 - bias - mb);
  } else {
    value = std::ldexp(static_cast<float>((1u << mb) | mantissa), static_cast<int>(exponent) - bias - mb);
  }
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  return static_cast<uint16_t>((bits >> 16) | (sign << 15));
}

// Element codes [..., packed(cols)] -> bf16 values [..., cols] (exact, unscaled); bits above a code's are ignored.
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
  static const int kFormat[3][3] = {{2, 1, 1}, {2, 3, 1}, {3, 2, 3}};  // exponent bits, mantissa bits, bias
  const int* f = kFormat[kind];
  const uint32_t code_mask = (1u << (1 + f[0] + f[1])) - 1u;
  uint16_t table[256];
  for (uint32_t c = 0; c < 256; ++c) table[c] = bf16_of_code(c & code_mask, f[0], f[1], f[2]);
  const uint8_t* in = data.data_ptr<uint8_t>();
  uint16_t* out = reinterpret_cast<uint16_t*>(result.data_ptr<at::BFloat16>());
  const int64_t bpr = data.size(-1);
  const bool four = kind == 0;
#pragma omp parallel for schedule(static) if (rows * cols > (1 << 16) && !omp_in_parallel())
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* i = in + r * bpr;
    uint16_t* o = out + r * cols;
    if (four) {
      const int64_t pairs = cols / 2;
      for (int64_t p = 0; p < pairs; ++p) {
        o[2 * p] = table[i[p] & 15];
        o[2 * p + 1] = table[i[p] >> 4];
      }
      if (cols % 2) o[cols - 1] = table[i[pairs] & 15];
    } else {
      for (int64_t c = 0; c < cols; ++c) o[c] = table[i[c]];
    }
  }
  return result;
}

}  // namespace
}  // namespace mx_small_glue

void register_mx_small(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("quantize_mx_small", &mx_small_glue::quantize, py::arg("x2d"), py::arg("kind"), py::arg("rceil"),
        py::arg("rowwise"), py::arg("columnwise"), py::arg("isa"), py::arg("out_row_data") = py::none(),
        py::arg("out_row_codes") = py::none(), py::arg("out_col_data") = py::none(),
        py::arg("out_col_codes") = py::none(),
        "MXFP4/MXFP6 quantize of a 2D tensor, both usages in one pass: (row data, row E8M0 codes, col data, col codes)");
  m.def("mx_small_to_bf16", &mx_small_glue::elements_to_bf16, py::arg("data"), py::arg("kind"), py::arg("cols"),
        "E2M1 (packed) / E2M3 / E3M2 codes -> bf16 values (exact)");
}

}  // namespace engine_native
