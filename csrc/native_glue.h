// What every native entry point shares: the default floating-point environment while a kernel runs,
// Python dispatch switched off, and the checks that only plain dense CPU tensors reach the kernels.
#pragma once

#include <torch/extension.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#define ENGINE_GLUE_X86 1
#endif

namespace engine_native {
namespace glue {

// The AVX-512 subsets the AVX-512 kernel builds are compiled for (F, BW, DQ, VL), read from CPUID.
inline bool cpu_has_avx512() {
#if defined(ENGINE_GLUE_X86) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}

// Round-to-nearest and no flush-to-zero / denormals-are-zero while a thread runs the kernels
// (torch.set_flush_denormal may have set them in MXCSR); the caller's state comes back after.
struct DefaultFpEnv {
#ifdef ENGINE_GLUE_X86
  unsigned saved;
  DefaultFpEnv() : saved(_mm_getcsr()) { _mm_setcsr(saved & ~(0x8000u | 0x6000u | 0x0040u)); }
  ~DefaultFpEnv() { _mm_setcsr(saved); }
#endif
};

// ATen calls made inside an entry point run on plain tensors, never back into Python subclasses.
struct NoPythonDispatch {
  c10::impl::ExcludeDispatchKeyGuard guard{c10::python_ks};
};

// A TypeError naming the argument for anything the kernels were not written for.
inline void check_plain(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(t.defined(), name, ": expected a tensor, got an undefined tensor");
  TORCH_CHECK_TYPE(!t.unsafeGetTensorImpl()->is_python_dispatch(), name,
                   ": expected a plain tensor, got a tensor subclass, whose data the native kernels cannot read");
  TORCH_CHECK_TYPE(t.layout() == at::kStrided && !t.is_nested() && t.has_storage(), name,
                   ": expected a dense (strided) tensor with storage");
  TORCH_CHECK_TYPE(t.device().is_cpu(), name, ": the native kernels take CPU tensors, got a tensor on ", t.device());
}

}  // namespace glue
}  // namespace engine_native
