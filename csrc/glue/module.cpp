// The Python module of the kernels: every entry point bound by name (the one file that includes
// torch's Python headers). The ops' glue lives by operation (csrc/README.md); engine/ops/native.py
// documents each function.
//
// torch's pybind11 type casters (at::Tensor, optional, ...) and no more: <torch/extension.h> would bring
// all of libtorch's C++ API (nn, optim, data), 35 s of CPU to parse against 14 s for this.
#include <torch/csrc/utils/pybind.h>

#include <string>

#include "cast/fp8_glue.h"
#include "cast/nvfp4_glue.h"
#include "cast/mx_small_glue.h"
#include "common/isa.h"
#include "gemm/exact_gemm_glue.h"
#include "gemm/grouped_gemm_glue.h"
#include "inference/int8_dynamic_glue.h"
#include "inference/wo_gemm_glue.h"
#include "optim/adam_glue.h"
#include "scaling/delayed_update_glue.h"

#ifndef ENGINE_BUILD_KEY
#define ENGINE_BUILD_KEY "unknown"
#endif

namespace engine_native {
}  // namespace engine_native

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace engine_native;
  namespace py = pybind11;
  m.doc() = "engine's C++ CPU quantization kernels (see engine/ops/native.py)";
  m.def("isa", [] { return std::string(isa_name(active_isa())); }, "the instruction-set level the kernels run at");
  m.def("set_isa", &set_active_isa, py::arg("name"), "'baseline', 'avx2', 'avx512' (at most the CPU's) or 'auto'");
  m.def("available_isas", &available_isas, "every level this CPU and build run, lowest first");
  m.def("build_key", [] { return std::string(ENGINE_BUILD_KEY); }, "the key of the csrc/ sources this was built from");
  m.def("amax", &fp8_glue::amax, py::arg("x"), py::arg("out") = py::none());
  m.def("cast_transpose", &fp8_glue::cast_transpose, py::arg("x2d"), py::arg("scale"), py::arg("kind"), py::arg("rowwise"),
        py::arg("columnwise"), py::arg("out_data") = py::none(), py::arg("out_data_t") = py::none(),
        py::arg("out_amax") = py::none());
  m.def("quantize_per_tensor", &fp8_glue::quantize_per_tensor, py::arg("x"), py::arg("kind"), py::arg("rowwise"),
        py::arg("columnwise"), py::arg("scale"), py::arg("force_pow_2_scales"), py::arg("amax_epsilon"),
        py::arg("record_amax"), py::arg("out_data") = py::none(), py::arg("out_data_t") = py::none(),
        py::arg("out_scale_inv") = py::none(), py::arg("out_amax") = py::none());
  m.def("delayed_update", &delayed_update_glue::delayed_update_op, py::arg("amax_history"), py::arg("scale"), py::arg("fp8_max"),
        py::arg("margin"), py::arg("most_recent"), py::arg("held"));
  m.def("quantize_block", &fp8_glue::quantize_block, py::arg("x2d"), py::arg("kind"), py::arg("tile_rows"), py::arg("tile_cols"),
        py::arg("force_pow_2_scales"), py::arg("amax_epsilon"), py::arg("value_for_inf"),
        py::arg("out_data") = py::none(), py::arg("out_scale_inv") = py::none());
  m.def("quantize_mxfp8", &fp8_glue::quantize_mxfp8, py::arg("x2d"), py::arg("kind"), py::arg("rceil"), py::arg("columnwise"),
        py::arg("out_data") = py::none(), py::arg("out_scale") = py::none());
  m.def("quantize_block_usages", &fp8_glue::quantize_block_usages, py::arg("x2d"), py::arg("kind"), py::arg("tile_rows"),
        py::arg("tile_cols"), py::arg("pow2"), py::arg("amax_epsilon"), py::arg("value_for_inf"), py::arg("rowwise"),
        py::arg("columnwise"), py::arg("out_row_data") = py::none(), py::arg("out_col_data") = py::none());
  m.def("quantize_mxfp8_usages", &fp8_glue::quantize_mxfp8_usages, py::arg("x2d"), py::arg("kind"), py::arg("rceil"),
        py::arg("rowwise"), py::arg("columnwise"), py::arg("out_row_data") = py::none(),
        py::arg("out_col_data") = py::none());
  m.def("fp8_to_bf16", &exact_gemm_glue::fp8_to_bf16, py::arg("data"), py::arg("out") = py::none());
  m.def("exact_gemm", &exact_gemm_glue::exact_gemm, py::arg("a"), py::arg("a_scale_inv"), py::arg("a_tile_rows"),
        py::arg("a_tile_cols"), py::arg("b"), py::arg("b_scale_inv"), py::arg("b_tile_rows"), py::arg("b_tile_cols"),
        py::arg("bias"), py::arg("out_dtype"), py::arg("bf16_gemm"));
  m.def("grouped_exact_gemm", &grouped_gemm_glue::grouped_exact_gemm, py::arg("a"), py::arg("a_scale_inv"),
        py::arg("a_tiles"), py::arg("b"), py::arg("b_scale_inv"), py::arg("b_tiles"), py::arg("numerics"),
        py::arg("a_amax"), py::arg("b_amax"), py::arg("a_amax_divisor"), py::arg("b_amax_divisor"), py::arg("biases"),
        py::arg("out_dtype"), py::arg("bf16_gemm"), py::arg("out"));
  m.def("quantize_nvfp4", &nvfp4_glue::quantize, py::arg("x2d"), py::arg("rowwise"), py::arg("columnwise"),
        py::arg("two_d"), py::arg("rht"), py::arg("amax"), py::arg("amax_t"), py::arg("counter"),
        py::arg("out_row_data") = py::none(), py::arg("out_row_scales") = py::none(),
        py::arg("out_col_data") = py::none(), py::arg("out_col_scales") = py::none(),
        py::arg("four_over_six") = false, py::arg("four_over_six_err_mode") = "MAE",
        py::arg("four_over_six_e4m3_max") = 448.0,
        "NVFP4 quantize of a 2D tensor: (row data, row E4M3 scales, row amax, col data, col scales, col amax); "
        "four_over_six: TE's 4over6 (MAE or MSE, E4M3 bound 448 or 256; not with rht nor a counter)");
  // inference: weight-only int4 / int8 / E4M3 GEMMs, int8 dynamic activations' quantize and rescale
  m.def("int4_linear", &wo_gemm_glue::int4_linear, py::arg("x"), py::arg("data"), py::arg("scale_and_zero"),
        py::arg("group_size"), py::arg("n"));
  m.def("int8_linear", &wo_gemm_glue::byte_linear, py::arg("x"), py::arg("data"), py::arg("scale"),
        py::arg("e4m3") = false);
  m.def("block_linear", &wo_gemm_glue::block_linear, py::arg("x"), py::arg("data"), py::arg("scale"), py::arg("kind"),
        py::arg("block"), py::arg("amax"), py::arg("factor"));
  // optim: the fused Adam step over compressed states
  m.def("adam_step", &adam_glue::adam_step, py::arg("w"), py::arg("grad"), py::arg("w_bf16"), py::arg("m"),
        py::arg("m_scale"), py::arg("m_kind"), py::arg("v"), py::arg("v_scale"), py::arg("v_kind"), py::arg("v_sqrt"),
        py::arg("signed_codes"), py::arg("signed_mids"), py::arg("unsigned_codes"), py::arg("unsigned_mids"),
        py::arg("beta1"), py::arg("one_minus_beta1"), py::arg("beta2"), py::arg("one_minus_beta2"),
        py::arg("step_size"), py::arg("inv_bc2_sqrt"), py::arg("eps"), py::arg("decay"), py::arg("wd"),
        py::arg("maximize"));
  m.def("adam_step_group", &adam_glue::adam_step_group, py::arg("ws"), py::arg("grads"), py::arg("ms"),
        py::arg("m_scales"), py::arg("m_kind"), py::arg("vs"), py::arg("v_scales"), py::arg("v_kind"),
        py::arg("v_sqrt"), py::arg("steps"), py::arg("signed_codes"), py::arg("signed_mids"),
        py::arg("unsigned_codes"), py::arg("unsigned_mids"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
        py::arg("eps"), py::arg("weight_decay"), py::arg("decoupled"), py::arg("maximize"),
        py::arg("counters") = std::vector<std::optional<at::Tensor>>{}, py::arg("global_numels") = std::vector<int64_t>{},
        py::arg("signed_tables") = py::none(), py::arg("unsigned_tables") = py::none());
  m.def("adam_int8_tables", &adam_glue::adam_int8_tables, py::arg("codes"), py::arg("mids"));
  m.def("int8_quantize_rows", &int8_dynamic_glue::quantize_rows, py::arg("x"), py::arg("biased"));
  m.def("int8_rescale", &int8_dynamic_glue::rescale, py::arg("acc"), py::arg("sx"), py::arg("sw"), py::arg("dtype"));
  m.def("quantize_mx_small", &mx_small_glue::quantize, py::arg("x2d"), py::arg("kind"), py::arg("rceil"),
        py::arg("rowwise"), py::arg("columnwise"), py::arg("out_row_data") = py::none(),
        py::arg("out_row_codes") = py::none(), py::arg("out_col_data") = py::none(),
        py::arg("out_col_codes") = py::none(),
        "MXFP4/MXFP6 quantize of a 2D tensor, both usages in one pass: (row data, row E8M0 codes, col data, col codes)");
  m.def("mx_small_to_bf16", &mx_small_glue::elements_to_bf16, py::arg("data"), py::arg("kind"), py::arg("cols"),
        "E2M1 (packed) / E2M3 / E3M2 codes -> bf16 values (exact)");
}