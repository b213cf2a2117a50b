// Transitional: the pybind-based glue files (mx_small, nvfp4, wo_gemm, int8_dynamic) include this until their
// registrations move to glue/module.cpp. The shared glue is common/glue.h.
#pragma once

#include <torch/extension.h>

#include "common/glue.h"

namespace engine_native {
namespace glue {

// The AVX-512 subsets the hand-written AVX-512 kernel files are compiled for (F, BW, DQ, VL), read from CPUID.
inline bool cpu_has_avx512() {
#if defined(ENGINE_GLUE_X86) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}

}  // namespace glue
}  // namespace engine_native
