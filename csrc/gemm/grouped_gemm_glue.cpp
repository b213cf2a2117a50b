// Grouped exact GEMMs: every group's GEMM in one call, each as general_gemm computes it on the CPU (engine/gemm/cpu.py)
// - so the same bits - written into its rows of one output where one is given (a mixture of experts' fprop and
// dgrad: no per-group output and no concatenation), else returned one per group (the wgrads). Three numerics, one
// per call (the caller sorts the pairs):
// * "exact": per-tensor FP8 pairs and power-of-2 tile pairs: exact_gemm (gemm/exact_gemm_glue.cpp: the same decode,
//   the same addmm or small GEMM);
// * "nvfp4": NVFP4 pairs: exact_gemm of the exact bf16 values with fp32 block scales into an fp32 result, then
//   amax_a * amax_b / (6 E_a * 6 E_b) as frexp mantissas and two powers of two (engine.gemm.scales.
//   times_nvfp4_factor), then the bias, then one rounding to out_dtype (engine.gemm.cpu.nvfp4);
// * "fp32_tiles": fp32 tile scales (block scaling without power-of-2 scales, rowwise FP8 with fp32 scales): each
//   K block's fp32 partial product scaled and summed by the ATen calls of engine.gemm.cpu.per_k_block.
// What it saves against a Python loop of general_gemm is the per-call Python work (operand checks, dispatch, the
// NVFP4 factor's dozen small tensor ops) and the output's concatenation. The groups run one after the other, each
// GEMM on torch's threads (splitting the threads over groups would change addmm's bits).
// It reads exact_gemm_glue's Operand, Decoder and size rules: it compiles in the ATen glue unit
// (engine/ops/native_build.py), after gemm/exact_gemm_glue.cpp (the sources go in sorted order).
#include "gemm/grouped_gemm_glue.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <string>

#include "common/glue.h"
#include "gemm/exact_gemm_glue.h"

namespace engine_native {
namespace grouped_gemm_glue {

using namespace glue;

namespace {

enum class Numerics { Exact, Nvfp4, Fp32Tiles };

Numerics numerics_of(const std::string& name) {
  if (name == "exact") return Numerics::Exact;
  if (name == "nvfp4") return Numerics::Nvfp4;
  TORCH_CHECK_VALUE(name == "fp32_tiles", "numerics: expected \"exact\", \"nvfp4\" or \"fp32_tiles\", got \"", name,
                    "\"");
  return Numerics::Fp32Tiles;
}

// decode(a) @ decode(b)^T * alpha (+ bias) into `out` [m, n] (a row slice of the grouped output), as exact_gemm: the
// same path, with addmm writing into `out` where exact_gemm would return addmm's result as it is; false (nothing
// written) for a per-tensor pair whose scale product is not a normal number.
bool gemm_into(const Tensor& a_data, const Tensor& a_scale_inv, int64_t a_tile_rows, int64_t a_tile_cols,
               const Tensor& b_data, const Tensor& b_scale_inv, int64_t b_tile_rows, int64_t b_tile_cols,
               const optional<Tensor>& bias, at::ScalarType out_dtype, bool bf16_gemm, Tensor out) {
  using namespace exact_gemm_glue;
  const at::ScalarType gemm_dtype = out_dtype == at::kBFloat16 && bf16_gemm ? at::kBFloat16 : at::kFloat;
  const int64_t m = a_data.size(0), n = b_data.size(0), k = a_data.size(1);
  if (gemm_dtype != out_dtype || small_gemm_runs(m, n, k, gemm_dtype) || m * n == 0) {
    optional<Tensor> r = exact_gemm(a_data, a_scale_inv, a_tile_rows, a_tile_cols, b_data, b_scale_inv, b_tile_rows,
                                    b_tile_cols, bias, out_dtype, bf16_gemm);
    if (!r.has_value()) return false;
    out.copy_(*r);
    return true;
  }
  const Operand a = checked_operand(a_data, a_scale_inv, a_tile_rows, a_tile_cols, "a");
  const Operand b = checked_operand(b_data, b_scale_inv, b_tile_rows, b_tile_cols, "b");
  TORCH_CHECK_VALUE(a.per_tensor() == b.per_tensor(), "grouped_exact_gemm: pair per-tensor operands with per-tensor ones");
  TORCH_CHECK_VALUE(k == b_data.size(1), "grouped_exact_gemm: inner dims differ: A is ", a_data.sizes(), ", B is ",
                    b_data.sizes());
  if (bias.has_value()) {
    check_plain(*bias, "bias");
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == n, "bias: expected shape (", n, ",), got ", bias->sizes());
  }
  double alpha = 1.0;
  if (a.per_tensor()) {  // exact_gemm's fp32(sa * sb)
    const float product = static_cast<float>(static_cast<double>(*a_scale_inv.data_ptr<float>()) *
                                             static_cast<double>(*b_scale_inv.data_ptr<float>()));
    const float mag = std::fabs(product);
    if (!(mag >= 1.17549435e-38f && mag <= 3.40282347e38f)) return false;
    alpha = product;
  }
  const Decoder da(a), db(b);
  Tensor lhs = da.decode_all(), rhs = db.decode_all();
  if (gemm_dtype != at::kBFloat16) {  // an fp32 GEMM (fp32 output) on the same values, as exact_gemm
    lhs = lhs.to(gemm_dtype);
    rhs = rhs.to(gemm_dtype);
  }
  DefaultFpEnv env;
  if (bias.has_value()) {
    at::addmm_out(out, rounded_bias(*bias, out_dtype).to(gemm_dtype).expand({m, n}), lhs, rhs.t(), 1.0, alpha);
  } else {
    at::addmm_out(out, at::empty({m, n}, lhs.options()), lhs, rhs.t(), 0.0, alpha);
  }
  return true;
}

// 2^e as fp32 from its bits, exact for e in [-149, 127], 0 below (engine.gemm.scales.pow2).
float pow2(int32_t e) {
  e = std::clamp<int32_t>(e, -150, 127);
  if (e >= -126) return std::bit_cast<float>(static_cast<uint32_t>(e + 127) << 23);
  if (e >= -149) return std::bit_cast<float>(uint32_t{1} << std::clamp<int32_t>(e + 149, 0, 22));
  return 0.0f;
}

// NVFP4's per-tensor factor amax_a * amax_b / (div_a * div_b) as engine.gemm.scales.times_nvfp4_factor applies it:
// y * m * p1 * p2, m the fp32 product of the three frexp mantissas, p1 * p2 = 2^(sum of their exponents) split so
// that y * m * p1 is exact and normal (times_pow2).
struct Nvfp4Factor {
  float m, p1, p2;
};

Nvfp4Factor nvfp4_factor(const Tensor& amax_a, const Tensor& amax_b, double div_a, double div_b) {
  int ea = 0, eb = 0, ec = 0;
  const float ma = std::frexp(*scalar_f32(amax_a, "a_amax"), &ea);
  const float mb = std::frexp(*scalar_f32(amax_b, "b_amax"), &eb);
  const float mc = std::frexp(static_cast<float>(1.0 / (div_a * div_b)), &ec);
  const float product = ma * mb;
  const int32_t e = ea + eb + ec, e1 = std::clamp<int32_t>(e, -90, 67);
  return {product * mc, pow2(e1), pow2(e - e1)};
}

// dst[i, j] = y[i, j] * f.m * f.p1 * f.p2 (+ bias[j]), each product rounded to fp32 in that order, as the Python
// path's tensor ops (no flush-to-zero change: those ops run in the caller's floating-point environment too).
void nvfp4_epilogue(const Tensor& y, const Nvfp4Factor& f, const optional<Tensor>& bias, float* dst) {
  const int64_t m = y.size(0), n = y.size(1);
  const float* src = y.const_data_ptr<float>();
  Tensor bias_f;
  if (bias.has_value()) {
    check_plain(*bias, "bias");
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == n, "bias: expected shape (", n, ",), got ", bias->sizes());
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const float* bp = bias.has_value() ? bias_f.const_data_ptr<float>() : nullptr;
  at::parallel_for(0, m, std::max<int64_t>(1, kElemGrain / std::max<int64_t>(1, n)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* s = src + r * n;
      float* d = dst + r * n;
      if (bp != nullptr) {
        for (int64_t j = 0; j < n; ++j) d[j] = s[j] * f.m * f.p1 * f.p2 + bp[j];
      } else {
        for (int64_t j = 0; j < n; ++j) d[j] = s[j] * f.m * f.p1 * f.p2;
      }
    }
  });
}

// engine.gemm.cpu.nvfp4's fp32 result: exact_gemm (fp32 block scales, fp32 output), then the factor and the bias.
Tensor nvfp4_gemm(const Tensor& a_data, const Tensor& a_scale_inv, int64_t a_tile_rows, int64_t a_tile_cols,
                  const Tensor& b_data, const Tensor& b_scale_inv, int64_t b_tile_rows, int64_t b_tile_cols,
                  const Tensor& amax_a, const Tensor& amax_b, double div_a, double div_b, const optional<Tensor>& bias,
                  float* dst) {
  const optional<Tensor> no_bias;
  const Tensor sa = a_scale_inv.to(at::kFloat), sb = b_scale_inv.to(at::kFloat);  // the E4M3 block scales, exactly
  const Tensor y = *exact_gemm_glue::exact_gemm(a_data, sa, a_tile_rows, a_tile_cols, b_data, sb, b_tile_rows,
                                                b_tile_cols, no_bias, at::kFloat, false);
  const Tensor result = dst == nullptr ? y : Tensor();
  nvfp4_epilogue(y, nvfp4_factor(amax_a, amax_b, div_a, div_b), bias, dst == nullptr ? y.data_ptr<float>() : dst);
  return result;
}

// engine.gemm.cpu.per_k_block and fp32_tiles' bias: the same ATen calls, so the same bits. Tile scales given as fp32.
Tensor fp32_tiles_gemm(const Tensor& a_data, const Tensor& a_scales, int64_t a_tile_rows, int64_t a_tile_cols,
                       const Tensor& b_data, const Tensor& b_scales, int64_t b_tile_rows, const optional<Tensor>& bias) {
  TORCH_CHECK_VALUE(a_data.dim() == 2 && b_data.dim() == 2 && a_data.size(1) == b_data.size(1),
                    "grouped_exact_gemm: expected 2D operands with one K, got A ", a_data.sizes(), ", B ",
                    b_data.sizes());
  TORCH_CHECK_TYPE(a_scales.scalar_type() == at::kFloat && b_scales.scalar_type() == at::kFloat,
                   "fp32_tiles: expected float32 tile scales, got ", a_scales.scalar_type(), " and ",
                   b_scales.scalar_type());
  const int64_t rows_a = a_data.size(0), rows_b = b_data.size(0), k = a_data.size(1);
  const Tensor sa = a_scales.repeat_interleave(a_tile_rows, 0).slice(0, 0, rows_a);
  const Tensor sb = b_scales.repeat_interleave(b_tile_rows, 0).slice(0, 0, rows_b);
  Tensor out = at::zeros({rows_a, rows_b}, at::TensorOptions().dtype(at::kFloat));
  for (int64_t start = 0, kb = 0; start < k; start += a_tile_cols, ++kb) {
    const int64_t stop = std::min(start + a_tile_cols, k);
    const Tensor partial = at::matmul(a_data.slice(1, start, stop).to(at::kFloat),
                                      b_data.slice(1, start, stop).to(at::kFloat).t());
    out.addcmul_(partial, sa.slice(1, kb, kb + 1) * sb.select(1, kb).unsqueeze(0));
  }
  if (bias.has_value()) out.add_(bias->to(at::kFloat));
  return out;
}

}  // namespace

std::vector<optional<Tensor>> grouped_exact_gemm(
    const std::vector<Tensor>& a, const std::vector<Tensor>& a_scale_inv, const std::vector<int64_t>& a_tiles,
    const std::vector<Tensor>& b, const std::vector<Tensor>& b_scale_inv, const std::vector<int64_t>& b_tiles,
    const std::string& numerics_name, const std::vector<Tensor>& a_amax, const std::vector<Tensor>& b_amax,
    double a_amax_divisor, double b_amax_divisor, const std::vector<optional<Tensor>>& biases,
    at::ScalarType out_dtype, bool bf16_gemm, const optional<Tensor>& out) {
  NoPythonDispatch no_python;
  const Numerics numerics = numerics_of(numerics_name);
  const size_t groups = a.size();
  TORCH_CHECK_VALUE(a_scale_inv.size() == groups && b.size() == groups && b_scale_inv.size() == groups &&
                        a_tiles.size() == 2 * groups && b_tiles.size() == 2 * groups &&
                        (biases.empty() || biases.size() == groups),
                    "grouped_exact_gemm: expected one a, a_scale_inv, b, b_scale_inv, two tile sizes per side (and a "
                    "bias, if any) per group, got ", groups, ", ", a_scale_inv.size(), ", ", b.size(), ", ",
                    b_scale_inv.size(), ", ", a_tiles.size(), ", ", b_tiles.size(), ", ", biases.size());
  TORCH_CHECK_VALUE(numerics != Numerics::Nvfp4 || (a_amax.size() == groups && b_amax.size() == groups),
                    "grouped_exact_gemm: NVFP4 needs one a_amax and one b_amax per group, got ", a_amax.size(), " and ",
                    b_amax.size(), " for ", groups, " groups");
  TORCH_CHECK_TYPE(out_dtype == at::kFloat || out_dtype == at::kBFloat16 || out_dtype == at::kHalf,
                   "out_dtype: expected float32, bfloat16 or float16, got ", out_dtype);
  std::vector<optional<Tensor>> results(groups);
  const optional<Tensor> no_bias;
  int64_t n = groups ? b[0].size(0) : 0;
  if (out.has_value()) {
    const Tensor& o = *out;
    check_plain(o, "out");
    int64_t rows = 0;
    for (const Tensor& t : a) rows += t.dim() == 2 ? t.size(0) : 0;
    TORCH_CHECK_VALUE(o.dim() == 2 && o.is_contiguous() && o.scalar_type() == out_dtype && o.size(0) == rows &&
                          o.size(1) == n,
                      "out: expected a contiguous ", out_dtype, " tensor of shape [", rows, ", ", n, "] (the groups' "
                      "rows by b's rows), got ", o.scalar_type(), " ", o.sizes(), o.is_contiguous() ? "" : " (not "
                      "contiguous)");
  }
  int64_t first = 0;
  for (size_t g = 0; g < groups; ++g) {
    const int64_t atr = a_tiles[2 * g], atc = a_tiles[2 * g + 1], btr = b_tiles[2 * g], btc = b_tiles[2 * g + 1];
    const optional<Tensor>& bias = biases.empty() ? no_bias : biases[g];
    TORCH_CHECK_VALUE(a[g].dim() == 2 && b[g].dim() == 2, "grouped_exact_gemm: expected 2D operands, got ",
                      a[g].sizes(), " and ", b[g].sizes(), " in group ", g);
    const int64_t m = a[g].size(0);
    if (out.has_value()) {
      TORCH_CHECK_VALUE(b[g].size(0) == n, "b: expected every group's b with ", n, " rows, got ", b[g].sizes(),
                        " in group ", g);
      const Tensor rows_g = out->narrow(0, first, m);
      first += m;
      if (numerics == Numerics::Exact) {
        if (!gemm_into(a[g], a_scale_inv[g], atr, atc, b[g], b_scale_inv[g], btr, btc, bias, out_dtype, bf16_gemm,
                       rows_g)) {
          results[g] = at::empty({0});  // not written: the caller computes this group (a scale product to rescale)
        }
      } else if (numerics == Numerics::Nvfp4 && out_dtype == at::kFloat) {  // the epilogue writes the rows
        nvfp4_gemm(a[g], a_scale_inv[g], atr, atc, b[g], b_scale_inv[g], btr, btc, a_amax[g], b_amax[g],
                   a_amax_divisor, b_amax_divisor, bias, rows_g.data_ptr<float>());
      } else {
        const Tensor y = numerics == Numerics::Nvfp4
            ? nvfp4_gemm(a[g], a_scale_inv[g], atr, atc, b[g], b_scale_inv[g], btr, btc, a_amax[g], b_amax[g],
                         a_amax_divisor, b_amax_divisor, bias, nullptr)
            : fp32_tiles_gemm(a[g], a_scale_inv[g], atr, atc, b[g], b_scale_inv[g], btr, bias);
        rows_g.copy_(y);  // one rounding to out_dtype, as the Python path's .to(out_dtype)
      }
      continue;
    }
    if (numerics == Numerics::Exact) {
      results[g] = exact_gemm_glue::exact_gemm(a[g], a_scale_inv[g], atr, atc, b[g], b_scale_inv[g], btr, btc, bias,
                                               out_dtype, bf16_gemm);
      continue;
    }
    const Tensor y = numerics == Numerics::Nvfp4
        ? nvfp4_gemm(a[g], a_scale_inv[g], atr, atc, b[g], b_scale_inv[g], btr, btc, a_amax[g], b_amax[g],
                     a_amax_divisor, b_amax_divisor, bias, nullptr)
        : fp32_tiles_gemm(a[g], a_scale_inv[g], atr, atc, b[g], b_scale_inv[g], btr, bias);
    results[g] = y.scalar_type() == out_dtype ? y : y.to(out_dtype);
  }
  return results;
}

}  // namespace grouped_gemm_glue
}  // namespace engine_native
