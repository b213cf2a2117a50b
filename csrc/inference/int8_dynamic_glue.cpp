// Int8DynamicActivationInt8Weight's glue around the int8 GEMM: argument checks, the rows split over OpenMP
// threads, and the row loops of the variant in use (int8_dynamic_kernels.cpp, chosen by active_isa()): per-token
// int8 quantization of x, and the rescale of the int sums to x's dtype, bit for bit the torch ops of
// engine/inference/int_formats.py (int8_dynamic.h). Threads run with round-to-nearest and without flush-to-zero /
// denormals-are-zero (MXCSR set per thread).
#include "inference/int8_dynamic_glue.h"

#include "common/glue.h"
#include "inference/int8_dynamic.h"

namespace engine_native {
namespace int8_dynamic_glue {
namespace {

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

}  // namespace

// (q int8 [M, K], scale fp32 [M]): scale = max(amax / 127, fp32 tiny) per row (NaN if the row has one), q =
// round-half-even(x / scale) clamped to [-127, 127] (NaN quotients give 0).
std::tuple<Tensor, Tensor> quantize_rows(const Tensor& x_in, bool biased) {
  NoPythonDispatch no_python;
  const Int8DynamicKernels& kernels = int8_dynamic_kernels(active_isa());
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
      kernels.quantize_row(src + r * K, K, flip, dst + r * K, sc + r);
    }
  });
  return {q, scale};
}

// (acc.float() * sx[:, None] * sw[None, :]) in fp32, rounded once to `dtype` (bf16 to nearest even in place,
// float16 by torch).
Tensor rescale(const Tensor& acc, const Tensor& sx, const Tensor& sw, at::ScalarType dtype) {
  NoPythonDispatch no_python;
  const Int8DynamicKernels& kernels = int8_dynamic_kernels(active_isa());
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
        kernels.rescale_row_i32(a.data_ptr<int32_t>() + r * N, xs[r], ws, N, yf_r, yb_r);
      } else {
        kernels.rescale_row_f32(a.data_ptr<float>() + r * N, xs[r], ws, N, yf_r, yb_r);
      }
    }
  });
  return dtype == at::kHalf ? y.to(at::kHalf) : out;
}

}  // namespace int8_dynamic_glue
}  // namespace engine_native
