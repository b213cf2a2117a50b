// Int8DynamicActivationInt8Weight's glue around torch._int_mm, in one pass each (plain loops, the compiler
// vectorises them, for AVX-512 too by GCC's target clones; rows split over OpenMP threads): per-token int8 quantization of x, and the rescale of the
// int32 sums to x's dtype. Bit for bit the torch ops of engine/inference/int_formats.py (`rowwise_int8` and
// `(acc.float() * sx[:, None] * sw[None, :]).to(dtype)`): the same fp32 operations in the same order.
// Threads run with round-to-nearest and without flush-to-zero / denormals-are-zero (MXCSR set per thread).
#include <torch/extension.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#define ENGINE_I8D_X86 1
#endif

#if defined(ENGINE_I8D_X86) && defined(__GNUC__) && !defined(__clang__)
#define ENGINE_I8D_CLONES __attribute__((target_clones("arch=x86-64-v4", "default")))
#else
#define ENGINE_I8D_CLONES
#endif

#include "common/native_glue.h"

namespace engine_native {
namespace int8_dynamic {
namespace {

using at::Tensor;

constexpr float kInt8Max = 127.0f;
constexpr float kFp32Tiny = 1.17549435e-38f;  // fp32's smallest normal: the least scale

using glue::check_plain;
using glue::DefaultFpEnv;
using glue::NoPythonDispatch;

template <typename F>
void parallel_rows(int64_t rows, int64_t work, const F& f) {
  const int threads = static_cast<int>(std::min<int64_t>(
      {static_cast<int64_t>(omp_get_max_threads()), std::max<int64_t>(1, work / (1 << 16)), std::max<int64_t>(1, rows)}));
  if (threads <= 1 || omp_in_parallel()) {
    DefaultFpEnv env;
    f(int64_t{0}, rows);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    DefaultFpEnv env;
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t r0 = rows * t / nt, r1 = rows * (t + 1) / nt;
    if (r0 < r1) f(r0, r1);
  }
}

// One row: its scale and codes. Cloned for x86-64-v4 (AVX-512) and the baseline, chosen by the loader (the same
// fp32 operations either way).
ENGINE_I8D_CLONES void quantize_row(const float* __restrict row, int64_t K, uint8_t flip, uint8_t* __restrict out,
                                    float* __restrict scale) {
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(row);
  uint32_t key = 0;  // max |x| bits: orders as |x| does, a NaN above every number
  for (int64_t k = 0; k < K; ++k) {
    const uint32_t a = bits[k] & 0x7FFFFFFFu;
    key = a > key ? a : key;
  }
  float amax;
  std::memcpy(&amax, &key, 4);
  float s = amax / kInt8Max;
  s = s < kFp32Tiny ? kFp32Tiny : s;  // a NaN stays
  *scale = s;
  for (int64_t k = 0; k < K; ++k) {
    // round-half-even(v) clamped to +-127 = the same of v clamped to +-128 first; below 2^22 in magnitude,
    // (v + 1.5 * 2^23) - 1.5 * 2^23 rounds v to an integer, half to even (no contraction: -ffp-contract=off)
    float v = row[k] / s;
    v = v < -128.0f ? -128.0f : (v > 128.0f ? 128.0f : v);
    v = (v + 12582912.0f) - 12582912.0f;
    v = v < -kInt8Max ? -kInt8Max : (v > kInt8Max ? kInt8Max : v);
    // the code's two's-complement byte; `flip` 0x80 adds 128 (the uint8 code of oneDNN's u8 x with zero point 128)
    out[k] = static_cast<uint8_t>(static_cast<int32_t>(v == v ? v : 0.0f)) ^ flip;
  }
}

template <typename Acc>
inline __attribute__((always_inline)) void rescale_row(const Acc* __restrict acc, float sx, const float* __restrict sw, int64_t N,
                                   float* __restrict yf, uint16_t* __restrict yb) {
  for (int64_t n = 0; n < N; ++n) {
    const float v = static_cast<float>(acc[n]) * sx * sw[n];
    if (yb) {
      uint32_t u;
      std::memcpy(&u, &v, 4);
      yb[n] = (u & 0x7FFFFFFFu) > 0x7F800000u ? static_cast<uint16_t>((u >> 16) | 0x40u)
                                              : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    } else {
      yf[n] = v;
    }
  }
}

// The int32 sums (torch._int_mm) or their fp32 values (oneDNN's u8 x s8 GEMM, exact int32 sums converted once).
ENGINE_I8D_CLONES void rescale_row_i32(const int32_t* __restrict acc, float sx, const float* __restrict sw, int64_t N,
                                       float* __restrict yf, uint16_t* __restrict yb) {
  rescale_row(acc, sx, sw, N, yf, yb);
}
ENGINE_I8D_CLONES void rescale_row_f32(const float* __restrict acc, float sx, const float* __restrict sw, int64_t N,
                                       float* __restrict yf, uint16_t* __restrict yb) {
  rescale_row(acc, sx, sw, N, yf, yb);
}

// (q int8 [M, K], scale fp32 [M]): scale = max(amax / 127, fp32 tiny) per row (NaN if the row has one), q =
// round-half-even(x / scale) clamped to [-127, 127] (NaN quotients give 0).
std::tuple<Tensor, Tensor> quantize_rows(const Tensor& x_in, bool biased) {
  NoPythonDispatch no_python;
  check_plain(x_in, "x");
  TORCH_CHECK_VALUE(x_in.dim() == 2, "x: expected a 2D tensor [M, K], got ", x_in.dim(), " dims");
  const auto dt = x_in.scalar_type();
  TORCH_CHECK_TYPE(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
                   "x: expected dtype float32, bfloat16 or float16, got ", dt);
  const Tensor x = x_in.to(at::kFloat).contiguous();  // exact
  const int64_t M = x.size(0), K = x.size(1);
  Tensor q = at::empty({M, K}, x.options().dtype(biased ? at::kByte : at::kChar));
  Tensor scale = at::empty({M}, x.options());
  const float* src = x.data_ptr<float>();
  uint8_t* dst = static_cast<uint8_t*>(q.data_ptr());
  const uint8_t flip = biased ? 0x80 : 0;
  float* sc = scale.data_ptr<float>();
  parallel_rows(M, M * K, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      quantize_row(src + r * K, K, flip, dst + r * K, sc + r);
    }
  });
  return {q, scale};
}

// (acc.float() * sx[:, None] * sw[None, :]) in fp32, rounded once to `dtype` (bf16 to nearest even in place,
// float16 by torch).
Tensor rescale(const Tensor& acc, const Tensor& sx, const Tensor& sw, at::ScalarType dtype) {
  NoPythonDispatch no_python;
  check_plain(acc, "acc");
  check_plain(sx, "sx");
  check_plain(sw, "sw");
  TORCH_CHECK_TYPE(acc.scalar_type() == at::kInt || acc.scalar_type() == at::kFloat,
                   "acc: expected int32 or float32, got ", acc.scalar_type());
  TORCH_CHECK_VALUE(acc.dim() == 2, "acc: expected a 2D tensor [M, N], got ", acc.dim(), " dims");
  const int64_t M = acc.size(0), N = acc.size(1);
  TORCH_CHECK_TYPE(sx.scalar_type() == at::kFloat, "sx: expected float32, got ", sx.scalar_type());
  TORCH_CHECK_TYPE(sw.scalar_type() == at::kFloat, "sw: expected float32, got ", sw.scalar_type());
  TORCH_CHECK_VALUE(sx.dim() == 1 && sx.size(0) == M, "sx: expected shape [", M, "], got ", sx.sizes());
  TORCH_CHECK_VALUE(sw.dim() == 1 && sw.size(0) == N, "sw: expected shape [", N, "], got ", sw.sizes());
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
                   "dtype: expected float32, bfloat16 or float16, got ", dtype);
  const Tensor a = acc.contiguous(), x_scale = sx.contiguous(), w_scale = sw.contiguous();
  const bool bf16 = dtype == at::kBFloat16;
  Tensor y = at::empty({bf16 ? 0 : M, bf16 ? 0 : N}, a.options().dtype(at::kFloat));
  const float* xs = x_scale.data_ptr<float>();
  const float* ws = w_scale.data_ptr<float>();
  Tensor out = bf16 ? at::empty({M, N}, a.options().dtype(at::kBFloat16)) : y;
  float* yf = bf16 ? nullptr : y.data_ptr<float>();
  uint16_t* yb = bf16 ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) : nullptr;
  parallel_rows(M, M * N, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* yf_r = yf ? yf + r * N : nullptr;
      uint16_t* yb_r = yb ? yb + r * N : nullptr;
      if (a.scalar_type() == at::kInt) {
        rescale_row_i32(a.data_ptr<int32_t>() + r * N, xs[r], ws, N, yf_r, yb_r);
      } else {
        rescale_row_f32(a.data_ptr<float>() + r * N, xs[r], ws, N, yf_r, yb_r);
      }
    }
  });
  return dtype == at::kHalf ? y.to(at::kHalf) : out;
}

}  // namespace
}  // namespace int8_dynamic

void register_int8_dynamic(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("int8_quantize_rows", &int8_dynamic::quantize_rows, py::arg("x"), py::arg("biased"),
        "per-row symmetric int8 of x [M, K]: (q [M, K], scale fp32 [M]), as int_formats.rowwise_int8; q is int8, "
        "or uint8 q + 128 when biased");
  m.def("int8_rescale", &int8_dynamic::rescale, py::arg("acc"), py::arg("sx"), py::arg("sw"), py::arg("dtype"),
        "(acc.float() * sx[:, None] * sw[None, :]).to(dtype) in one pass (acc int32, or float32)");
}

}  // namespace engine_native
