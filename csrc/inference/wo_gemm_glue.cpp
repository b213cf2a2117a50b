// Weight-only integer GEMMs at small M on the CPU, torch glue and the portable kernels: argument checks, x as
// fp32 (deinterleaved for int4), the split of the weight rows over OpenMP threads, the choice of the portable
// or AVX-512 build (kernels_wo_gemm_avx512.cpp), and the output in x's dtype (one rounding of the fp32 sums).
// The layouts and the numerics are in wo_gemm.h. Threads run with round-to-nearest and without
// flush-to-zero / denormals-are-zero (MXCSR set per thread), as the reference's fp32 arithmetic.
#include <torch/extension.h>

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#define ENGINE_WO_X86 1
#endif

#include "common/fp8_scalar.h"
#include "inference/wo_gemm.h"

#include "common/native_glue.h"

namespace engine_native {

// ------------------------------------------------------------------------------ portable kernels
// Plain loops (the compiler vectorises them with the baseline instruction set): each weight row is
// dequantized once into fp32, then dotted with every row of x over 16 partial sums.
namespace wo_portable {
namespace {

constexpr int kLanes = 16;

float dot(const float* __restrict a, const float* __restrict b, int64_t K) {
  float part[kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    for (int l = 0; l < kLanes; ++l) part[l] += a[k + l] * b[k + l];
  }
  for (int64_t l = 0; k < K; ++k, ++l) part[l] += a[k] * b[k];
  float sum = 0.0f;
  for (int l = 0; l < kLanes; ++l) sum += part[l];
  return sum;
}

float bf16_bits_value(uint32_t bits16) {
  const uint32_t u = bits16 << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

void int4_rows(const WoInt4Job& job, int64_t n0, int64_t n1) {
  const int64_t K = job.K, kb = K / 2;
  std::vector<float> row(static_cast<size_t>(K));
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = job.w + n * kb;
    for (int64_t k0 = 0; k0 < K; k0 += kWoChunk) {  // row[] in x's deinterleaved order
      const uint32_t word = job.sz[(k0 / job.group) * job.sz_ld + n];
      const float s = bf16_bits_value(word & 0xFFFFu), z = bf16_bits_value(word >> 16);
      for (int64_t i = 0; i < kWoChunk / 2; ++i) {
        const uint8_t b = w[k0 / 2 + i];
        row[k0 + i] = static_cast<float>((b & 15) - 8) * s + z;
        row[k0 + kWoChunk / 2 + i] = static_cast<float>((b >> 4) - 8) * s + z;
      }
    }
    for (int64_t m = 0; m < job.M; ++m) job.y[m * job.ldy + n] = dot(job.x + m * K, row.data(), K);
  }
}

void int8_rows(const WoInt8Job& job, int64_t n0, int64_t n1) {
  const int64_t K = job.K;
  std::vector<float> row(static_cast<size_t>(K));
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* w = job.w + n * K;
    for (int64_t k = 0; k < K; ++k) {
      row[k] = job.e4m3 ? bf16_to_f32(fp8_to_bf16_bits(static_cast<uint8_t>(w[k]), Fp8Kind::E4M3))
                        : static_cast<float>(w[k]);
    }
    for (int64_t m = 0; m < job.M; ++m) job.y[m * job.ldy + n] = dot(job.x + m * K, row.data(), K) * job.scale[n];
  }
}

}  // namespace wo_portable

// ------------------------------------------------------------------------------ glue
namespace wo_glue {
namespace {

using at::Tensor;

using glue::cpu_has_avx512;

bool cpu_has_avx512_bf16() {
#if defined(ENGINE_WO_X86) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

using glue::check_plain;
using glue::DefaultFpEnv;
using glue::NoPythonDispatch;

void check_contiguous(const Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.is_contiguous(), name, ": expected a contiguous tensor, got strides ", t.strides());
}

bool use_avx512(const std::string& isa) {
  parse_isa(isa);
  return isa == "avx512" && wo_avx512::compiled() && cpu_has_avx512();
}

// A subnormal in x (contiguous fp32): int4's bf16 path (vdpbf16ps) would read it as 0, so such x take the fp32 path.
bool has_subnormal(const Tensor& x) {
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(x.data_ptr<float>());
  const int64_t n = x.numel();
  bool found = false;
  for (int64_t i = 0; i < n; ++i) found |= (bits[i] & 0x7F800000u) == 0 && (bits[i] & 0x007FFFFFu) != 0;
  return found;
}

// x [M, K] (float32, bfloat16 or float16) checked, as contiguous fp32.
Tensor input_fp32(const Tensor& x) {
  check_plain(x, "x");
  TORCH_CHECK_VALUE(x.dim() == 2, "x: expected a 2D tensor [M, K], got ", x.dim(), " dims");
  const auto dt = x.scalar_type();
  TORCH_CHECK_TYPE(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
                   "x: expected dtype float32, bfloat16 or float16, got ", dt);
  return x.to(at::kFloat).contiguous();  // exact
}

// Calls f(n0, n1) on one contiguous range of rows per thread, ranges a multiple of 4 rows (small jobs stay on
// the calling thread).
template <typename F>
void parallel_rows(int64_t work, int64_t rows, const F& f) {
  const int64_t want = std::max<int64_t>(1, work / (1 << 16));
  const int64_t quads = (rows + 3) / 4;
  const int threads = static_cast<int>(std::min<int64_t>({static_cast<int64_t>(omp_get_max_threads()), want, quads}));
  if (threads <= 1 || omp_in_parallel()) {
    DefaultFpEnv env;
    if (rows > 0) f(int64_t{0}, rows);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    DefaultFpEnv env;
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t n0 = std::min(rows, quads * t / nt * 4), n1 = std::min(rows, quads * (t + 1) / nt * 4);
    if (n0 < n1) f(n0, n1);
  }
}

// y fp32 [M, N] in `like`'s dtype: bf16 by round-to-nearest-even (NaN stays NaN), others by torch.
Tensor output(const Tensor& y, at::ScalarType dtype) {
  if (dtype == at::kFloat) return y;
  if (dtype != at::kBFloat16) return y.to(dtype);
  Tensor out = at::empty(y.sizes(), y.options().dtype(at::kBFloat16));
  const uint32_t* src = reinterpret_cast<const uint32_t*>(y.data_ptr<float>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t n = y.numel();
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = src[i];
    dst[i] = (u & 0x7FFFFFFFu) > 0x7F800000u ? static_cast<uint16_t>((u >> 16) | 0x40u)
                                             : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
  return out;
}

// x [M, K] @ W^T for the int4 weight of wo_gemm.h: data uint8 [rows >= n, K/2], scale_and_zero bf16
// [K/group, rows, 2] (scale, zero) -> [M, n] in x's dtype.
Tensor int4_linear(const Tensor& x_in, const Tensor& data, const Tensor& scale_and_zero, int64_t group_size,
                   int64_t n, const std::string& isa) {
  NoPythonDispatch no_python;
  const bool avx512 = use_avx512(isa);
  const Tensor x = input_fp32(x_in);
  check_plain(data, "data");
  check_plain(scale_and_zero, "scale_and_zero");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK_VALUE(group_size >= kWoChunk && group_size % kWoChunk == 0, "group_size: expected a positive multiple of ",
                    kWoChunk, ", got ", group_size);
  TORCH_CHECK_VALUE(K % group_size == 0, "x: K = ", K, " is not a multiple of group_size ", group_size);
  TORCH_CHECK_TYPE(data.scalar_type() == at::kByte, "data: expected uint8, got ", data.scalar_type());
  TORCH_CHECK_VALUE(data.dim() == 2 && data.size(1) == K / 2 && data.size(0) >= n && n >= 0, "data: expected shape [",
                    "rows >= ", n, ", ", K / 2, "], got ", data.sizes());
  check_contiguous(data, "data");
  const int64_t rows = data.size(0);
  TORCH_CHECK_TYPE(scale_and_zero.scalar_type() == at::kBFloat16, "scale_and_zero: expected bfloat16, got ",
                   scale_and_zero.scalar_type());
  TORCH_CHECK_VALUE(scale_and_zero.dim() == 3 && scale_and_zero.size(0) == K / group_size &&
                        scale_and_zero.size(1) == rows && scale_and_zero.size(2) == 2,
                    "scale_and_zero: expected shape [", K / group_size, ", ", rows, ", 2], got ", scale_and_zero.sizes());
  check_contiguous(scale_and_zero, "scale_and_zero");
  const int64_t groups = K / group_size;
  Tensor xd, xb, xsum;
  const float* src = x.data_ptr<float>();
  // the bf16 path steps 64 k's at a time: one group (or part of one), or two of 32
  const bool steps64 = group_size % 64 == 0 || (group_size == 32 && K % 64 == 0);
  const bool bf16 = avx512 && x_in.scalar_type() == at::kBFloat16 && steps64 && !has_subnormal(x) &&
                    wo_avx512::compiled_bf16() && cpu_has_avx512_bf16();
  if (bf16) {
    xb = at::empty({M, K}, x.options().dtype(at::kBFloat16));
    xsum = at::empty({M, groups}, x.options());
    uint16_t* dst = reinterpret_cast<uint16_t*>(xb.data_ptr<at::BFloat16>());
    const uint16_t* xs = reinterpret_cast<const uint16_t*>(x_in.contiguous().data_ptr<at::BFloat16>());
    for (int64_t i = 0; i < M * K; i += 64) {  // each run of 64: even k's, then odd k's
      for (int64_t j = 0; j < 32; ++j) {
        dst[i + j] = xs[i + 2 * j];
        dst[i + 32 + j] = xs[i + 2 * j + 1];
      }
    }
    float* sums = xsum.data_ptr<float>();
    for (int64_t i = 0; i < M * groups; ++i) {
      float sum = 0.0f;
      for (int64_t k = 0; k < group_size; ++k) sum += src[i * group_size + k];
      sums[i] = sum;
    }
  } else {
    xd = at::empty({M, K}, x.options());
    float* dst = xd.data_ptr<float>();
    for (int64_t i = 0; i < M * K; i += kWoChunk) {  // each run of 32: even k's, then odd k's
      for (int64_t j = 0; j < kWoChunk / 2; ++j) {
        dst[i + j] = src[i + 2 * j];
        dst[i + kWoChunk / 2 + j] = src[i + 2 * j + 1];
      }
    }
  }
  Tensor y = at::empty({M, n}, x.options());
  const WoInt4Job job{bf16 ? nullptr : xd.data_ptr<float>(), M, K,
                      bf16 ? reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>()) : nullptr,
                      bf16 ? xsum.data_ptr<float>() : nullptr, data.data_ptr<uint8_t>(),
                      reinterpret_cast<const uint32_t*>(scale_and_zero.data_ptr<at::BFloat16>()), rows, group_size,
                      y.data_ptr<float>(), n};
  if (M > 0 && K > 0) {
    parallel_rows(M * n * K / 4 + n * K, n, [&](int64_t n0, int64_t n1) {
      if (bf16) {
        wo_avx512::int4_rows_bf16(job, n0, n1);
      } else if (avx512) {
        wo_avx512::int4_rows(job, n0, n1);
      } else {
        wo_portable::int4_rows(job, n0, n1);
      }
    });
  } else {
    y.zero_();
  }
  return output(y, x_in.scalar_type());
}

// x [M, K] @ (data * scale[:, None])^T for int8 data [N, K] and a float32 / bfloat16 scale [N] -> [M, N] in x's
// dtype (the scale multiplies each fp32 sum).
Tensor byte_linear(const Tensor& x_in, const Tensor& data, const Tensor& scale_in, const std::string& isa, bool e4m3) {
  NoPythonDispatch no_python;
  const bool avx512 = use_avx512(isa);
  const Tensor x = input_fp32(x_in);
  check_plain(data, "data");
  check_plain(scale_in, "scale");
  const int64_t M = x.size(0), K = x.size(1);
  if (e4m3) {
    TORCH_CHECK_TYPE(data.scalar_type() == at::kByte || data.scalar_type() == at::kFloat8_e4m3fn,
                     "data: expected float8_e4m3fn or its uint8 bytes, got ", data.scalar_type());
  } else {
    TORCH_CHECK_TYPE(data.scalar_type() == at::kChar, "data: expected int8, got ", data.scalar_type());
  }
  TORCH_CHECK_VALUE(data.dim() == 2 && data.size(1) == K, "data: expected shape [N, ", K, "], got ", data.sizes());
  check_contiguous(data, "data");
  const int64_t N = data.size(0);
  TORCH_CHECK_TYPE(scale_in.scalar_type() == at::kFloat || scale_in.scalar_type() == at::kBFloat16,
                   "scale: expected float32 or bfloat16, got ", scale_in.scalar_type());
  TORCH_CHECK_VALUE(scale_in.dim() == 1 && scale_in.size(0) == N, "scale: expected shape [", N, "], got ",
                    scale_in.sizes());
  const Tensor scale = scale_in.to(at::kFloat).contiguous();
  Tensor y = at::empty({M, N}, x.options());
  const WoInt8Job job{x.data_ptr<float>(), M, K, static_cast<const int8_t*>(data.data_ptr()), scale.data_ptr<float>(),
                      y.data_ptr<float>(), N, e4m3};
  if (M > 0 && K > 0) {
    parallel_rows(M * N * K / 4 + N * K, N, [&](int64_t n0, int64_t n1) {
      if (avx512) {
        wo_avx512::int8_rows(job, n0, n1);
      } else {
        wo_portable::int8_rows(job, n0, n1);
      }
    });
  } else {
    y.zero_();
  }
  return output(y, x_in.scalar_type());
}

}  // namespace
}  // namespace wo_glue

void register_wo_gemm(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("int4_linear", &wo_glue::int4_linear, py::arg("x"), py::arg("data"), py::arg("scale_and_zero"),
        py::arg("group_size"), py::arg("n"), py::arg("isa"),
        "x [M, K] @ W^T for groupwise int4 W (two codes a byte, low nibble first): [M, n] in x's dtype");
  m.def("int8_linear", &wo_glue::byte_linear, py::arg("x"), py::arg("data"), py::arg("scale"), py::arg("isa"),
        py::arg("e4m3") = false,
        "x [M, K] @ (data * scale)^T for per-channel int8 (or, e4m3=True, E4M3) data [N, K]: [M, N] in x's dtype");
}

}  // namespace engine_native
