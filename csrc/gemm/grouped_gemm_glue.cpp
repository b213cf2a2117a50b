// Grouped exact GEMMs: every group's decode(a_g) @ decode(b_g)^T (+ bias_g) in one call, each as exact_gemm computes
// it (gemm/exact_gemm_glue.cpp: the same decode, the same addmm or small GEMM, so the same bits), written into its
// rows of one output where one is given (a mixture of experts' fprop and dgrad: no per-group output and no
// concatenation), else returned one per group (the wgrads). What it saves against a Python loop of exact_gemm is
// the per-call Python work (operand checks, dispatch) and the output's concatenation. The groups run one after the
// other, each GEMM on torch's threads (splitting the threads over groups would change addmm's bits).
// It reads exact_gemm_glue's Operand, Decoder and size rules: it compiles in the ATen glue unit
// (engine/ops/native_build.py), after gemm/exact_gemm_glue.cpp (the sources go in sorted order).
#include "gemm/grouped_gemm_glue.h"

#include "common/glue.h"
#include "gemm/exact_gemm_glue.h"

namespace engine_native {
namespace grouped_gemm_glue {

using namespace glue;

namespace {

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
  const Tensor lhs = da.decode_all(), rhs = db.decode_all();  // bf16: gemm_dtype == out_dtype == bf16 here
  DefaultFpEnv env;
  if (bias.has_value()) {
    at::addmm_out(out, rounded_bias(*bias, out_dtype).to(gemm_dtype).expand({m, n}), lhs, rhs.t(), 1.0, alpha);
  } else {
    at::addmm_out(out, at::empty({m, n}, lhs.options()), lhs, rhs.t(), 0.0, alpha);
  }
  return true;
}

}  // namespace

std::vector<optional<Tensor>> grouped_exact_gemm(
    const std::vector<Tensor>& a, const std::vector<Tensor>& a_scale_inv, int64_t a_tile_rows, int64_t a_tile_cols,
    const std::vector<Tensor>& b, const std::vector<Tensor>& b_scale_inv, int64_t b_tile_rows, int64_t b_tile_cols,
    const std::vector<optional<Tensor>>& biases, at::ScalarType out_dtype, bool bf16_gemm, const optional<Tensor>& out) {
  NoPythonDispatch no_python;
  const size_t groups = a.size();
  TORCH_CHECK_VALUE(a_scale_inv.size() == groups && b.size() == groups && b_scale_inv.size() == groups &&
                        (biases.empty() || biases.size() == groups),
                    "grouped_exact_gemm: expected one a, a_scale_inv, b, b_scale_inv (and bias, if any) per group, got ",
                    groups, ", ", a_scale_inv.size(), ", ", b.size(), ", ", b_scale_inv.size(), ", ", biases.size());
  std::vector<optional<Tensor>> results(groups);
  const optional<Tensor> no_bias;
  if (!out.has_value()) {
    for (size_t g = 0; g < groups; ++g) {
      results[g] = exact_gemm_glue::exact_gemm(a[g], a_scale_inv[g], a_tile_rows, a_tile_cols, b[g], b_scale_inv[g],
                                               b_tile_rows, b_tile_cols, biases.empty() ? no_bias : biases[g],
                                               out_dtype, bf16_gemm);
    }
    return results;
  }
  const Tensor& o = *out;
  check_plain(o, "out");
  int64_t rows = 0;
  for (const Tensor& t : a) rows += t.dim() == 2 ? t.size(0) : 0;
  const int64_t n = groups ? b[0].size(0) : 0;
  TORCH_CHECK_VALUE(o.dim() == 2 && o.is_contiguous() && o.scalar_type() == out_dtype && o.size(0) == rows &&
                        o.size(1) == n,
                    "out: expected a contiguous ", out_dtype, " tensor of shape [", rows, ", ", n, "] (the groups' rows "
                    "by b's rows), got ", o.scalar_type(), " ", o.sizes(), o.is_contiguous() ? "" : " (not contiguous)");
  int64_t first = 0;
  for (size_t g = 0; g < groups; ++g) {
    const int64_t m = a[g].size(0);
    TORCH_CHECK_VALUE(b[g].dim() == 2 && b[g].size(0) == n, "b: expected every group's b with ", n, " rows, got ",
                      b[g].sizes(), " in group ", g);
    const Tensor rows_g = o.narrow(0, first, m);
    if (!gemm_into(a[g], a_scale_inv[g], a_tile_rows, a_tile_cols, b[g], b_scale_inv[g], b_tile_rows, b_tile_cols,
                   biases.empty() ? no_bias : biases[g], out_dtype, bf16_gemm, rows_g)) {
      results[g] = at::empty({0});  // not written: the caller computes this group (a scale product to rescale)
    }
    first += m;
  }
  return results;
}

}  // namespace grouped_gemm_glue
}  // namespace engine_native
