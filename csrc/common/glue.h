// The one glue layer between torch and the kernels: argument checks (only plain dense CPU tensors
// reach raw pointers), outputs (a caller's buffer checked, or a new tensor), the default floating-point
// environment while kernels run, Python dispatch switched off, and splitting work over OpenMP threads.
// Glue files (`*_glue.cpp`) include this; kernel sources never do.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#define ENGINE_GLUE_X86 1
#endif

#include "common/fp8_scalar.h"
#include "common/isa.h"

namespace engine_native {
namespace glue {

using at::Tensor;
using c10::optional;

// ------------------------------------------------------------------------- threading
// each thread runs the kernels with the default MXCSR and restores its own afterwards.
struct DefaultFpEnv {
#ifdef ENGINE_GLUE_X86
  unsigned saved;
  DefaultFpEnv() : saved(_mm_getcsr()) { _mm_setcsr(saved & ~(0x8000u | 0x6000u | 0x0040u)); }
  ~DefaultFpEnv() { _mm_setcsr(saved); }
#endif
};

// Calls f(begin, end, thread) on one contiguous chunk of [0, n) per thread, with at least
// `grain` units per thread (small jobs stay on the calling thread).
template <typename F>
inline int parallel_chunks(int64_t n, int64_t grain, const F& f) {
  const int64_t want = std::max<int64_t>(1, n / std::max<int64_t>(1, grain));
  const int threads = static_cast<int>(std::min<int64_t>(omp_get_max_threads(), want));
  if (threads <= 1 || omp_in_parallel()) {
    DefaultFpEnv env;
    if (n > 0) f(int64_t{0}, n, 0);
    return 1;
  }
#pragma omp parallel num_threads(threads)
  {
    DefaultFpEnv env;
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t b = n * t / nt, e = n * (t + 1) / nt;
    if (b < e) f(b, e, static_cast<int>(t));
  }
  return threads;
}

// Max of per-thread amax keys.
template <typename F>
inline uint32_t parallel_max_key(int64_t n, int64_t grain, const F& f) {
  std::vector<uint32_t> keys(static_cast<size_t>(omp_get_max_threads()) + 1, 0u);
  parallel_chunks(n, grain, [&](int64_t b, int64_t e, int t) { keys[t] = std::max(keys[t], f(b, e)); });
  return *std::max_element(keys.begin(), keys.end());
}

constexpr int64_t kElemGrain = 1 << 15;  // elements per thread below which threads cost more than they save


// ------------------------------------------------------------------------- arguments
inline InType in_type(const Tensor& x, const char* name) {
  switch (x.scalar_type()) {
    case at::kFloat: return InType::F32;
    case at::kBFloat16: return InType::BF16;
    case at::kHalf: return InType::F16;
    default:
      TORCH_CHECK_TYPE(false, name, ": expected dtype float32, bfloat16 or float16, got ", x.scalar_type());
  }
  return InType::F32;
}

inline Fp8Kind fp8_kind(int64_t kind) {
  TORCH_CHECK_VALUE(kind == 0 || kind == 1, "fp8 kind: expected 0 (E4M3) or 1 (E5M2), got ", kind);
  return kind == 0 ? Fp8Kind::E4M3 : Fp8Kind::E5M2;
}

inline at::ScalarType fp8_dtype(Fp8Kind kind) {
  return kind == Fp8Kind::E4M3 ? at::kFloat8_e4m3fn : at::kFloat8_e5m2;
}

// The dispatch keys of a plain CPU tensor, with or without autograd.
constexpr c10::DispatchKeySet kPlainCpuKeys({c10::DispatchKey::CPU, c10::DispatchKey::ADInplaceOrView,
                                             c10::DispatchKey::AutogradCPU, c10::DispatchKey::AutocastCPU});

// The kernels read and write raw memory through data pointers, so every tensor they get
// must be a plain, dense CPU tensor with storage: a tensor subclass (DTensor, FakeTensor,
// any __torch_dispatch__ wrapper) arrives here as a wrapper with no data of its own, a
// meta tensor has none, functorch (vmap, grad) and negated/conjugated views wrap or
// reinterpret theirs. O(1): a few bit tests per argument.
inline void check_plain(const Tensor& x, const char* name) {
  TORCH_CHECK_TYPE(x.defined(), name, ": expected a tensor, got an undefined tensor");
  TORCH_CHECK_TYPE(!x.unsafeGetTensorImpl()->is_python_dispatch(), name,
                   ": expected a plain tensor, got a tensor subclass (such as DTensor or FakeTensor), whose data the "
                   "native kernels cannot read");
  TORCH_CHECK_TYPE(x.layout() == at::kStrided && !x.is_nested(), name, ": expected a dense (strided) tensor, got layout ",
                   x.layout(), x.is_nested() ? " (nested)" : "");
  TORCH_CHECK_TYPE(x.device().is_cpu(), name, ": the native kernels take CPU tensors, got a tensor on ", x.device());
  const uint64_t extra = x.key_set().raw_repr() & ~kPlainCpuKeys.raw_repr();
  TORCH_CHECK_TYPE(extra == 0 && x.has_storage(), name, ": expected a plain CPU tensor, got one with dispatch keys ",
                   x.key_set(), " (a functorch-wrapped, functionalized, negated or conjugated tensor?)");
}

// Each entry point runs with the Python dispatch keys excluded: a TorchDispatchMode that is
// active (FakeTensorMode, ...) would otherwise be asked for the outputs and intermediate
// copies made here, and could hand back tensors without data. The kernels are opaque.
struct NoPythonDispatch {
  c10::impl::ExcludeDispatchKeyGuard guard{c10::python_ks};
};

// The bytes [first, last] a strided tensor can touch (non-negative strides).
inline std::pair<const char*, const char*> byte_span(const Tensor& t) {
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  const char* first = static_cast<const char*>(t.data_ptr());
  return {first, first + (last + 1) * t.element_size() - 1};
}

// A given output must not share memory with an input or another output: the kernels
// read the input while they write, and write each output in parallel chunks.
inline void check_disjoint(const Tensor& out, const char* name, const Tensor& other, const char* other_name) {
  if (out.numel() == 0 || other.numel() == 0 || !out.storage().is_alias_of(other.storage())) return;
  const auto a = byte_span(out), b = byte_span(other);
  TORCH_CHECK_VALUE(a.second < b.first || b.second < a.first, name, ": shares memory with ", other_name,
                    "; pass a separate buffer");
}

// A caller-provided output must match exactly; otherwise a new contiguous tensor.
inline Tensor output(const optional<Tensor>& given, at::IntArrayRef shape, at::ScalarType dtype, const char* name) {
  if (given.has_value()) {
    const Tensor& t = *given;
    check_plain(t, name);
    TORCH_CHECK_VALUE(t.scalar_type() == dtype, name, ": expected dtype ", dtype, ", got ", t.scalar_type());
    TORCH_CHECK_VALUE(t.sizes() == shape, name, ": expected shape ", shape, ", got ", t.sizes());
    TORCH_CHECK_VALUE(t.is_contiguous(), name, ": must be contiguous");
    return t;
  }
  return at::empty(shape, at::TensorOptions().dtype(dtype).device(at::kCPU));
}

inline uint8_t* bytes(const Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }

// A 2D tensor as a row-major view, or nullopt when it is stored column-major (a

// The value of a 1-element fp32 CPU tensor (a scale, an amax to record into).
inline float* scalar_f32(const Tensor& t, const char* name) {
  check_plain(t, name);
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, name, ": expected dtype float32, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.numel() == 1, name, ": expected a 1-element tensor, got shape ", t.sizes());
  return t.data_ptr<float>();
}

// x read as the row-major matrix `src` (rows x cols): x's 2D view M x K, or its transpose

inline uint8_t* maybe_bytes(const optional<Tensor>& t) { return t ? bytes(*t) : nullptr; }

// Every given tensor against every other: none may share memory (outputs are written while
// the input is read, and in parallel chunks).
inline void check_all_disjoint(std::initializer_list<std::pair<const Tensor*, const char*>> tensors) {
  for (auto a = tensors.begin(); a != tensors.end(); ++a) {
    for (auto b = a + 1; b != tensors.end(); ++b) {
      if (a->first && b->first) check_disjoint(*a->first, a->second, *b->first, b->second);
    }
  }
}

inline const Tensor* ptr(const optional<Tensor>& t) { return t ? &*t : nullptr; }


}  // namespace glue
}  // namespace engine_native
