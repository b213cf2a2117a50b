// Weight-only integer GEMMs at small M on the CPU, the glue: argument checks, x as fp32 in the order of the
// kernel variant in use (wo_gemm_kernels.cpp, chosen by active_isa()), the split of the weight rows over OpenMP
// threads, and the output in x's dtype (one rounding of the fp32 sums). The layouts and the numerics are in
// wo_gemm.h. Threads run with round-to-nearest and without flush-to-zero / denormals-are-zero (MXCSR set per
// thread), as the reference's fp32 arithmetic.
#include "inference/wo_gemm_glue.h"

#include "common/glue.h"
#include "inference/wo_gemm.h"

namespace engine_native {
namespace wo_gemm_glue {
namespace {

using glue::check_plain;
using glue::DefaultFpEnv;
using glue::NoPythonDispatch;

void check_contiguous(const Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.is_contiguous(), name, ": expected a contiguous tensor, got strides ", t.strides());
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

// y fp32 [M, N] in `dtype`: bf16 by round-to-nearest-even (NaN stays NaN), others by torch.
Tensor output(const WoKernels& k, const Tensor& y, at::ScalarType dtype) {
  if (dtype == at::kFloat) return y;
  if (dtype != at::kBFloat16) return y.to(dtype);
  Tensor out = at::empty(y.sizes(), y.options().dtype(at::kBFloat16));
  k.to_bf16(y.data_ptr<float>(), y.numel(), reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
  return out;
}

}  // namespace

Tensor int4_linear(const Tensor& x_in, const Tensor& data, const Tensor& scale_and_zero, int64_t group_size,
                   int64_t n) {
  NoPythonDispatch no_python;
  const WoKernels& k = wo_kernels(active_isa());
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
  const float* src = x.data_ptr<float>();
  // the bf16 path steps 64 k's at a time: one group (or part of one), or two of 32; it reads subnormals as 0
  const bool steps64 = group_size % 64 == 0 || (group_size == 32 && K % 64 == 0);
  const bool bf16 = k.int4_rows_bf16 != nullptr && x_in.scalar_type() == at::kBFloat16 && steps64 &&
                    !k.has_subnormal(src, M * K);
  const int64_t ldx = (K + k.int4_block - 1) / k.int4_block * k.int4_block;
  Tensor xd, xb;
  Tensor xsum = at::empty({M, groups}, x.options());
  if (bf16) {
    xb = at::empty({M, K}, x.options().dtype(at::kBFloat16));
    const Tensor xs = x_in.contiguous();
    k.int4_pack_x_bf16(reinterpret_cast<const uint16_t*>(xs.data_ptr<at::BFloat16>()), src, M, K, group_size,
                       reinterpret_cast<uint16_t*>(xb.data_ptr<at::BFloat16>()), xsum.data_ptr<float>());
  } else {
    xd = at::empty({M, ldx}, x.options());
    k.int4_pack_x(src, M, K, group_size, xd.data_ptr<float>(), ldx, xsum.data_ptr<float>());
  }
  Tensor y = at::empty({M, n}, x.options());
  const WoInt4Job job{bf16 ? nullptr : xd.data_ptr<float>(), M, K, ldx,
                      bf16 ? reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>()) : nullptr,
                      xsum.data_ptr<float>(), data.data_ptr<uint8_t>(),
                      reinterpret_cast<const uint32_t*>(scale_and_zero.data_ptr<at::BFloat16>()), rows, group_size,
                      y.data_ptr<float>(), n};
  if (M > 0 && K > 0) {
    const auto rows_of = bf16 ? k.int4_rows_bf16 : k.int4_rows;
    parallel_rows(M * n * K / 4 + n * K, n, [&](int64_t n0, int64_t n1) { rows_of(job, n0, n1); });
  } else {
    y.zero_();
  }
  return output(k, y, x_in.scalar_type());
}

Tensor byte_linear(const Tensor& x_in, const Tensor& data, const Tensor& scale_in, bool e4m3) {
  NoPythonDispatch no_python;
  const WoKernels& k = wo_kernels(active_isa());
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
  const int64_t ldx = (K + k.int8_block - 1) / k.int8_block * k.int8_block;
  Tensor xp = at::empty({M, ldx}, x.options());
  k.int8_pack_x(x.data_ptr<float>(), M, K, xp.data_ptr<float>(), ldx);
  Tensor y = at::empty({M, N}, x.options());
  const WoInt8Job job{xp.data_ptr<float>(), M, K, ldx, static_cast<const int8_t*>(data.data_ptr()),
                      scale.data_ptr<float>(), y.data_ptr<float>(), N, e4m3};
  if (M > 0 && K > 0) {
    parallel_rows(M * N * K / 4 + N * K, N, [&](int64_t n0, int64_t n1) { k.int8_rows(job, n0, n1); });
  } else {
    y.zero_();
  }
  return output(k, y, x_in.scalar_type());
}

Tensor block_linear(const Tensor& x_in, const Tensor& data, const Tensor& scale, int64_t kind, int64_t block,
                    const std::optional<Tensor>& amax, double factor) {
  NoPythonDispatch no_python;
  const WoKernels& k = wo_kernels(active_isa());
  const Tensor x = input_fp32(x_in);
  check_plain(data, "data");
  check_plain(scale, "scale");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK_VALUE(kind >= kWoE2M1 && kind <= kWoE4M3, "kind: expected 0 (E2M1), 1 (E2M3), 2 (E3M2) or 3 (E4M3), got ",
                    kind);
  TORCH_CHECK_VALUE(block == 16 || block == 32, "block: expected 16 or 32, got ", block);
  TORCH_CHECK_VALUE(kind == kWoE2M1 || block == 32, "block: expected 32 for a byte per element, got ", block);
  TORCH_CHECK_TYPE(data.scalar_type() == at::kByte || data.scalar_type() == at::kFloat8_e4m3fn,
                   "data: expected uint8 codes (or float8_e4m3fn), got ", data.scalar_type());
  const int64_t packed = kind == kWoE2M1 ? (K + 1) / 2 : K;
  TORCH_CHECK_VALUE(data.dim() == 2 && data.size(1) == packed, "data: expected shape [N, ", packed, "], got ",
                    data.sizes());
  check_contiguous(data, "data");
  const int64_t N = data.size(0), blocks = (K + block - 1) / block;
  TORCH_CHECK_TYPE(scale.scalar_type() == at::kByte || scale.scalar_type() == at::kFloat8_e4m3fn,
                   "scale: expected uint8 codes (or float8_e4m3fn), got ", scale.scalar_type());
  TORCH_CHECK_VALUE(scale.dim() == 2 && scale.size(0) == N && scale.size(1) == blocks, "scale: expected shape [", N,
                    ", ", blocks, "], got ", scale.sizes());
  check_contiguous(scale, "scale");
  float amax_value = 0.0f;
  if (amax.has_value()) {
    check_plain(*amax, "amax");
    TORCH_CHECK_TYPE(amax->scalar_type() == at::kFloat, "amax: expected float32, got ", amax->scalar_type());
    TORCH_CHECK_VALUE(amax->numel() == 1, "amax: expected one element, got ", amax->numel());
    amax_value = amax->data_ptr<float>()[0];
  }
  const int64_t kv = k.block_vector_k(static_cast<int>(kind), K);
  Tensor xp = at::empty({M, kv}, x.options());
  k.block_pack_x(static_cast<int>(kind), x.data_ptr<float>(), M, K, xp.data_ptr<float>(), kv);
  Tensor y = at::empty({M, N}, x.options());
  const WoBlockJob job{xp.data_ptr<float>(), x.data_ptr<float>(), M, K, kv, kv,
                       static_cast<const uint8_t*>(data.data_ptr()), packed,
                       static_cast<const uint8_t*>(scale.data_ptr()), blocks, static_cast<int>(kind),
                       static_cast<int>(block), amax.has_value(), amax_value, static_cast<float>(factor),
                       y.data_ptr<float>(), N};
  if (M > 0 && K > 0) {
    parallel_rows(M * N * K / 4 + N * K, N, [&](int64_t n0, int64_t n1) { k.block_rows(job, n0, n1); });
  } else {
    y.zero_();
  }
  return output(k, y, x_in.scalar_type());
}

}  // namespace wo_gemm_glue
}  // namespace engine_native
