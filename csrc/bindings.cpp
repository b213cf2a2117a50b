// Torch glue for the kernels: argument checks, output allocation (or reuse of caller
// buffers), splitting the work over OpenMP threads, and the choice between the AVX-512
// and the portable kernels (CPUID at load time; `set_isa` overrides it for tests).
#include <torch/extension.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <bit>
#include <cstring>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#define ENGINE_X86 1
#endif

#include "delayed_update.h"
#include "kernels.h"
#include "small_gemm.h"

namespace engine_native {
namespace {

using at::Tensor;
using c10::optional;

// ------------------------------------------------------------------ kernel selection
bool cpu_has_avx512() {
#if defined(ENGINE_X86) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512vbmi");
#else
  return false;
#endif
}

std::atomic<const Kernels*> g_kernels{nullptr};  // nullptr: not chosen yet

const Kernels& kernels() {
  const Kernels* k = g_kernels.load(std::memory_order_acquire);
  if (k == nullptr) {
    k = (cpu_has_avx512() && avx512_kernels()) ? avx512_kernels() : &portable_kernels();
    g_kernels.store(k, std::memory_order_release);
  }
  return *k;
}

std::string isa() { return kernels().name; }

void set_isa(const std::string& name) {
  if (name == "portable") {
    g_kernels = &portable_kernels();
  } else if (name == "avx512") {
    TORCH_CHECK_VALUE(cpu_has_avx512() && avx512_kernels(), "set_isa: this CPU (or build) has no AVX-512 kernels");
    g_kernels = avx512_kernels();
  } else if (name == "auto") {
    g_kernels = nullptr;
  } else {
    TORCH_CHECK_VALUE(false, "set_isa: expected 'auto', 'avx512' or 'portable', got '", name, "'");
  }
}

std::vector<std::string> available_isas() {
  std::vector<std::string> out{"portable"};
  if (cpu_has_avx512() && avx512_kernels()) out.push_back("avx512");
  return out;
}

// ------------------------------------------------------------------------- threading
// The kernels follow the reference's default IEEE arithmetic: round-to-nearest (which the
// AVX-512 rounding trick relies on) and subnormals kept (x * scale can be one, and FP8
// subnormals come from them); torch.set_flush_denormal(True) sets FTZ/DAZ in MXCSR, so
// each thread runs the kernels with the default MXCSR and restores its own afterwards.
struct DefaultFpEnv {
#ifdef ENGINE_X86
  unsigned saved;
  DefaultFpEnv() : saved(_mm_getcsr()) { _mm_setcsr(saved & ~(0x8000u | 0x6000u | 0x0040u)); }
  ~DefaultFpEnv() { _mm_setcsr(saved); }
#endif
};

// Calls f(begin, end, thread) on one contiguous chunk of [0, n) per thread, with at least
// `grain` units per thread (small jobs stay on the calling thread).
template <typename F>
int parallel_chunks(int64_t n, int64_t grain, const F& f) {
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
uint32_t parallel_max_key(int64_t n, int64_t grain, const F& f) {
  std::vector<uint32_t> keys(static_cast<size_t>(omp_get_max_threads()) + 1, 0u);
  parallel_chunks(n, grain, [&](int64_t b, int64_t e, int t) { keys[t] = std::max(keys[t], f(b, e)); });
  return *std::max_element(keys.begin(), keys.end());
}

constexpr int64_t kElemGrain = 1 << 15;  // elements per thread below which threads cost more than they save

// ------------------------------------------------------------------------- arguments
InType in_type(const Tensor& x, const char* name) {
  switch (x.scalar_type()) {
    case at::kFloat: return InType::F32;
    case at::kBFloat16: return InType::BF16;
    case at::kHalf: return InType::F16;
    default:
      TORCH_CHECK_TYPE(false, name, ": expected dtype float32, bfloat16 or float16, got ", x.scalar_type());
  }
  return InType::F32;
}

Fp8Kind fp8_kind(int64_t kind) {
  TORCH_CHECK_VALUE(kind == 0 || kind == 1, "fp8 kind: expected 0 (E4M3) or 1 (E5M2), got ", kind);
  return kind == 0 ? Fp8Kind::E4M3 : Fp8Kind::E5M2;
}

at::ScalarType fp8_dtype(Fp8Kind kind) {
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
void check_plain(const Tensor& x, const char* name) {
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
std::pair<const char*, const char*> byte_span(const Tensor& t) {
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  const char* first = static_cast<const char*>(t.data_ptr());
  return {first, first + (last + 1) * t.element_size() - 1};
}

// A given output must not share memory with an input or another output: the kernels
// read the input while they write, and write each output in parallel chunks.
void check_disjoint(const Tensor& out, const char* name, const Tensor& other, const char* other_name) {
  if (out.numel() == 0 || other.numel() == 0 || !out.storage().is_alias_of(other.storage())) return;
  const auto a = byte_span(out), b = byte_span(other);
  TORCH_CHECK_VALUE(a.second < b.first || b.second < a.first, name, ": shares memory with ", other_name,
                    "; pass a separate buffer");
}

// A caller-provided output must match exactly; otherwise a new contiguous tensor.
Tensor output(const optional<Tensor>& given, at::IntArrayRef shape, at::ScalarType dtype, const char* name) {
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

uint8_t* bytes(const Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }

// A 2D tensor as a row-major view, or nullopt when it is stored column-major (a
// transposed view). Anything else is made contiguous by the caller.
optional<Src> row_major(const Tensor& x) {
  const int64_t R = x.size(0), C = x.size(1);
  if (C == 1 || x.stride(1) == 1) return Src{x.data_ptr(), in_type(x, "x"), R == 1 ? C : x.stride(0)};
  return c10::nullopt;
}

bool column_major(const Tensor& x) { return x.size(0) > 1 && x.size(1) > 1 && x.stride(0) == 1; }

// --------------------------------------------------------------------------------- amax
float amax_of(const Tensor& x) {
  if (x.numel() == 0) return 0.0f;
  Tensor flat = x.is_non_overlapping_and_dense() ? x : x.contiguous();
  const InType type = in_type(flat, "x");
  const void* data = flat.data_ptr();
  const Kernels& k = kernels();
  const uint32_t key = parallel_max_key(flat.numel(), kElemGrain, [&](int64_t b, int64_t e) {
    return k.amax_key(data, type, b, e);
  });
  return key_to_amax(key);
}

Tensor amax(const Tensor& x, const optional<Tensor>& out) {
  NoPythonDispatch no_python;
  check_plain(x, "x");
  in_type(x, "x");
  Tensor result = output(out, {1}, at::kFloat, "out");
  check_disjoint(result, "out", x, "x");
  result.data_ptr<float>()[0] = amax_of(x);
  return result;
}

// ---------------------------------------------------------------------- per-tensor casts
// The value of a 1-element fp32 CPU tensor (a scale, an amax to record into).
float* scalar_f32(const Tensor& t, const char* name) {
  check_plain(t, name);
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, name, ": expected dtype float32, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.numel() == 1, name, ": expected a 1-element tensor, got shape ", t.sizes());
  return t.data_ptr<float>();
}

// x read as the row-major matrix `src` (rows x cols): x's 2D view M x K, or its transpose
// (swapped) when x is a column-major 2D view. `holder` keeps a contiguous copy alive, made
// only when x is neither.
struct Matrix {
  Tensor holder;
  Src src;
  int64_t rows, cols;
  bool swapped;
};

Matrix as_matrix(const Tensor& x_in, int64_t M, int64_t K, const char* name) {
  const InType type = in_type(x_in, name);
  if (x_in.dim() != 2 && x_in.is_contiguous()) return {x_in, Src{x_in.data_ptr(), type, K}, M, K, false};
  Tensor x = x_in.dim() == 2 ? x_in : x_in.reshape({M, K});  // a view when the strides allow
  if (column_major(x)) return {x, Src{x.data_ptr(), type, x.stride(1)}, K, M, true};
  if (!row_major(x).has_value()) x = x.contiguous();
  return {x, *row_major(x), M, K, false};
}

uint32_t matrix_amax_key(const Matrix& m) {
  const Kernels& k = kernels();
  const Src s = m.src;
  if (s.ld == m.cols) {
    return parallel_max_key(m.rows * m.cols, kElemGrain,
                            [&](int64_t b, int64_t e) { return k.amax_key(s.data, s.type, b, e); });
  }
  return parallel_max_key(m.rows, std::max<int64_t>(1, kElemGrain / m.cols), [&](int64_t b, int64_t e) {
    uint32_t best = 0;
    for (int64_t r = b; r < e; ++r) best = std::max(best, k.amax_key(s.data, s.type, r * s.ld, r * s.ld + m.cols));
    return best;
  });
}

// sat(x * scale) for the M x K matrix of `m` (M * K > 0): codes row-major into `data`
// (M x K) and/or transposed into `data_t` (K x M). Returns the amax key of x.
uint32_t cast_matrix(const Matrix& m, float scale, Fp8Kind kind, uint8_t* data, uint8_t* data_t) {
  const int64_t n = m.rows * m.cols;
  if (is_nan_f32(scale)) {
    // x * NaN is NaN for every element, so the data is the canonical NaN code 0x7F
    // throughout; only the amax needs the input.
    if (data) std::memset(data, 0x7F, static_cast<size_t>(n));
    if (data_t) std::memset(data_t, 0x7F, static_cast<size_t>(n));
    return matrix_amax_key(m);
  }
  // A swapped matrix is x^T: its row-major codes are data_t, its transposed ones data.
  const Src src = m.src;
  const int64_t rows = m.rows, cols = m.cols;
  uint8_t* out_row = m.swapped ? data_t : data;
  uint8_t* out_col = m.swapped ? data : data_t;
  const Kernels& k = kernels();
  if (out_col == nullptr && src.ld == cols) {
    // rowwise only on contiguous data: one flat pass
    return parallel_max_key(n, kElemGrain, [&](int64_t b, int64_t e) {
      if (out_row == nullptr) return k.amax_key(src.data, src.type, b, e);
      return k.cast(src.data, src.type, b, e, scale, kind, out_row);
    });
  }
  // Units of 64 rows x up to 1024 columns, all the row blocks of a column chunk in a
  // row: the 1024 rows of data_t they write stay in the TLB (each row is a page apart).
  const int64_t row_blocks = (rows + 63) / 64, col_chunks = (cols + 1023) / 1024;
  return parallel_max_key(row_blocks * col_chunks, std::max<int64_t>(1, kElemGrain / (64 * 1024)),
                          [&](int64_t b, int64_t e) {
                            uint32_t best = 0;
                            for (int64_t u = b; u < e; ++u) {
                              const int64_t r0 = (u % row_blocks) * 64, c0 = (u / row_blocks) * 1024;
                              const int64_t r1 = std::min(rows, r0 + 64), c1 = std::min(cols, c0 + 1024);
                              best = std::max(best, k.cast_transpose_region(src, rows, cols, r0, r1, c0, c1, scale,
                                                                            kind, out_row, out_col));
                            }
                            return best;
                          });
}

uint8_t* maybe_bytes(const optional<Tensor>& t) { return t ? bytes(*t) : nullptr; }

// Every given tensor against every other: none may share memory (outputs are written while
// the input is read, and in parallel chunks).
void check_all_disjoint(std::initializer_list<std::pair<const Tensor*, const char*>> tensors) {
  for (auto a = tensors.begin(); a != tensors.end(); ++a) {
    for (auto b = a + 1; b != tensors.end(); ++b) {
      if (a->first && b->first) check_disjoint(*a->first, a->second, *b->first, b->second);
    }
  }
}

const Tensor* ptr(const optional<Tensor>& t) { return t ? &*t : nullptr; }

using CastTransposeResult = std::tuple<optional<Tensor>, optional<Tensor>, Tensor>;

CastTransposeResult cast_transpose(const Tensor& x_in, const Tensor& scale_t, int64_t kind_i, bool rowwise,
                                   bool columnwise, const optional<Tensor>& out_data,
                                   const optional<Tensor>& out_data_t, const optional<Tensor>& out_amax) {
  NoPythonDispatch no_python;
  check_plain(x_in, "x2d");
  in_type(x_in, "x2d");
  TORCH_CHECK_VALUE(x_in.dim() == 2, "x2d: expected a 2D tensor, got ", x_in.dim(), " dims");
  const float scale = *scalar_f32(scale_t, "scale");
  const Fp8Kind kind = fp8_kind(kind_i);
  const int64_t M = x_in.size(0), K = x_in.size(1);
  optional<Tensor> data, data_t;
  if (rowwise) data = output(out_data, {M, K}, fp8_dtype(kind), "out_data");
  if (columnwise) data_t = output(out_data_t, {K, M}, fp8_dtype(kind), "out_data_t");
  Tensor amax_t = output(out_amax, {1}, at::kFloat, "out_amax");
  check_all_disjoint({{&x_in, "x2d"}, {ptr(data), "out_data"}, {ptr(data_t), "out_data_t"}, {&amax_t, "out_amax"}});
  DefaultFpEnv env;
  uint32_t key = 0;
  if (M * K > 0) key = cast_matrix(as_matrix(x_in, M, K, "x2d"), scale, kind, maybe_bytes(data), maybe_bytes(data_t));
  amax_t.data_ptr<float>()[0] = key_to_amax(key);
  return {data, data_t, amax_t};
}

// Per-tensor quantization in one call: (data in x's shape | None, data_t [K, M] | None,
// scale_inv [1] = 1 / scale, amax [1] = max|x|). The scale is the given 1-element `scale`
// (delayed scaling), or the current-scaling rule of x's amax (reference.compute_scale with
// power-of-2 and epsilon options; an inf scale becomes FLT_MAX). With `record_amax`,
// max(record_amax, amax) is written into it (torch.maximum: NaN if either is NaN).
using PerTensorResult = std::tuple<optional<Tensor>, optional<Tensor>, Tensor, Tensor>;

PerTensorResult quantize_per_tensor(const Tensor& x, int64_t kind_i, bool rowwise, bool columnwise,
                                    const optional<Tensor>& scale_t, bool pow2, double amax_epsilon,
                                    const optional<Tensor>& record_amax, const optional<Tensor>& out_data,
                                    const optional<Tensor>& out_data_t, const optional<Tensor>& out_scale_inv,
                                    const optional<Tensor>& out_amax) {
  NoPythonDispatch no_python;
  check_plain(x, "x");
  in_type(x, "x");
  const Fp8Kind kind = fp8_kind(kind_i);
  const float* given = scale_t ? scalar_f32(*scale_t, "scale") : nullptr;
  float* recorded = record_amax ? scalar_f32(*record_amax, "record_amax") : nullptr;
  // the 2D view of reference.as_2d: M = prod(leading dims), K = last dim (a scalar is 1 x 1)
  const int64_t K = x.dim() == 0 ? 1 : x.size(-1);
  int64_t M = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) M *= x.size(d);
  optional<Tensor> data, data_t;
  if (rowwise) data = output(out_data, x.sizes(), fp8_dtype(kind), "out_data");
  if (columnwise) data_t = output(out_data_t, {K, M}, fp8_dtype(kind), "out_data_t");
  Tensor scale_inv = output(out_scale_inv, {1}, at::kFloat, "out_scale_inv");
  Tensor amax_t = output(out_amax, {1}, at::kFloat, "out_amax");
  check_all_disjoint({{&x, "x"},
                      {ptr(data), "out_data"},
                      {ptr(data_t), "out_data_t"},
                      {&scale_inv, "out_scale_inv"},
                      {&amax_t, "out_amax"},
                      {ptr(record_amax), "record_amax"}});

  DefaultFpEnv env;
  float scale = given ? *given : 1.0f;
  uint32_t key = 0;
  if (M * K > 0) {
    const Matrix m = as_matrix(x, M, K, "x");
    if (!given) key = matrix_amax_key(m);
    const Fp8Format f = fp8_format(kind);
    if (!given) scale = compute_scale(key_to_amax(key), ScaleRule{f.max, pow2, static_cast<float>(amax_epsilon),
                                                                  3.4028234663852886e38f});
    key = cast_matrix(m, scale, kind, maybe_bytes(data), maybe_bytes(data_t));
  } else if (!given) {
    const Fp8Format f = fp8_format(kind);  // no elements: amax 0 (epsilon may still apply)
    scale = compute_scale(0.0f, ScaleRule{f.max, pow2, static_cast<float>(amax_epsilon), 3.4028234663852886e38f});
  }
  const float amax = key_to_amax(key);
  scale_inv.data_ptr<float>()[0] = 1.0f / scale;
  amax_t.data_ptr<float>()[0] = amax;
  if (recorded) {
    const float old = *recorded;
    *recorded = (is_nan_f32(old) || is_nan_f32(amax)) ? bits_f32(0x7FC00000u) : (old < amax ? amax : old);
  }
  return {data, data_t, scale_inv, amax_t};
}

// ----------------------------------------------------------------- delayed scaling update
void delayed_update_op(const Tensor& history, const Tensor& scale, double fp8_max, int64_t margin, bool most_recent,
                       const std::vector<int64_t>& held) {
  NoPythonDispatch no_python;
  check_plain(history, "amax_history");
  check_plain(scale, "scale");
  TORCH_CHECK_TYPE(history.scalar_type() == at::kFloat, "amax_history: expected dtype float32, got ",
                   history.scalar_type());
  TORCH_CHECK_TYPE(scale.scalar_type() == at::kFloat, "scale: expected dtype float32, got ", scale.scalar_type());
  TORCH_CHECK_VALUE(history.dim() == 2 && history.size(0) >= 1, "amax_history: expected shape [rows >= 1, n], got ",
                    history.sizes());
  const int64_t rows = history.size(0), n = history.size(1);
  TORCH_CHECK_VALUE(scale.dim() == 1 && scale.size(0) == n, "scale: expected shape [", n,
                    "] (one per amax_history column), got ", scale.sizes());
  TORCH_CHECK_VALUE(history.is_contiguous() && scale.is_contiguous(), "amax_history and scale must be contiguous");
  TORCH_CHECK_VALUE(margin >= 0 && margin <= 126, "margin: expected 0..126, got ", margin);
  check_disjoint(scale, "scale", history, "amax_history");
  std::vector<uint8_t> mask;
  if (!held.empty()) {
    mask.assign(static_cast<size_t>(n), 0);
    for (int64_t j : held) {
      TORCH_CHECK_VALUE(j >= 0 && j < n, "held: slot ", j, " out of range for ", n, " slots");
      mask[static_cast<size_t>(j)] = 1;
    }
  }
  DefaultFpEnv env;
  delayed_update(history.data_ptr<float>(), rows, n, scale.data_ptr<float>(), static_cast<float>(fp8_max),
                 static_cast<int>(margin), most_recent, mask.empty() ? nullptr : mask.data());
}

// ------------------------------------------------------------------------ block scaling
std::tuple<Tensor, Tensor> quantize_block(const Tensor& x_in, int64_t kind_i, int64_t tile_rows, int64_t tile_cols,
                                          bool pow2, double amax_epsilon, double value_for_inf,
                                          const optional<Tensor>& out_data, const optional<Tensor>& out_scale_inv) {
  NoPythonDispatch no_python;
  check_plain(x_in, "x2d");
  in_type(x_in, "x2d");
  TORCH_CHECK_VALUE(x_in.dim() == 2, "x2d: expected a 2D tensor, got ", x_in.dim(), " dims");
  TORCH_CHECK_VALUE(tile_rows >= 1 && tile_cols >= 1, "tile_rows and tile_cols must be >= 1, got ", tile_rows, " and ",
                    tile_cols);
  const Fp8Kind kind = fp8_kind(kind_i);
  const int64_t M = x_in.size(0), K = x_in.size(1);
  const int64_t tm = (M + tile_rows - 1) / tile_rows, tk = (K + tile_cols - 1) / tile_cols;
  Tensor data = output(out_data, {M, K}, fp8_dtype(kind), "out_data");
  Tensor scale_inv = output(out_scale_inv, {tm, tk}, at::kFloat, "out_scale_inv");
  check_disjoint(data, "out_data", x_in, "x2d");
  check_disjoint(scale_inv, "out_scale_inv", x_in, "x2d");
  check_disjoint(scale_inv, "out_scale_inv", data, "out_data");
  if (M * K == 0) return {data, scale_inv};

  const Fp8Format f = fp8_format(kind);
  const ScaleRule rule{f.max, pow2, static_cast<float>(amax_epsilon), static_cast<float>(value_for_inf)};
  const BlockParams p{tile_rows, tile_cols, rule, kind};
  float* sinv = scale_inv.data_ptr<float>();
  uint8_t* out = bytes(data);
  // The vector kernels need every tile scale to be a positive normal number, which holds
  // unless value_for_inf itself is not one.
  const float vfi = p.rule.value_for_inf;
  const bool normal_vfi = vfi >= 1.17549435e-38f && vfi <= 3.4028234663852886e38f;
  const Kernels& kern = normal_vfi ? kernels() : portable_kernels();

  if (column_major(x_in)) {
    // x2d = y^T for a row-major y (A x B = K x M): tiles of x2d are transposed panels of y.
    const Src src{x_in.data_ptr(), in_type(x_in, "x2d"), x_in.stride(1)};
    const int64_t A = K, B = M;
    // columns of y per panel: whole tiles, 128 KiB of input per 128 rows (long row
    // segments to read; the panel and the next one, prefetched, stay in L2)
    const int64_t target = std::min<int64_t>(1024, (128 * 1024 / 128) / x_in.element_size());
    const int64_t width = tile_rows * std::max<int64_t>(1, target / tile_rows);
    const Kernels& k = width <= 1024 ? kern : portable_kernels();
    const int64_t a_panels = tk, b_panels = (B + width - 1) / width;
    parallel_chunks(a_panels * b_panels, std::max<int64_t>(1, kElemGrain / (width * tile_cols)),
                    [&](int64_t b, int64_t e, int) {
                      for (int64_t u = b; u < e; ++u) {
                        // all the row tiles of a column panel in a row: its rows of
                        // scale_inv (one float per tile) fill up while in cache
                        const int64_t a0 = (u % a_panels) * tile_cols, b0 = (u / a_panels) * width;
                        k.block_transposed(src, A, B, p, a0, std::min(A, a0 + tile_cols), b0, std::min(B, b0 + width),
                                           out, sinv);
                      }
                    });
    return {data, scale_inv};
  }
  Tensor x = row_major(x_in).has_value() ? x_in : x_in.contiguous();
  const Src src = *row_major(x);
  const Kernels& k = kern;
  parallel_chunks(tm * tk, std::max<int64_t>(1, kElemGrain / (tile_rows * tile_cols)), [&](int64_t b, int64_t e, int) {
    k.block_rowwise(src, M, K, p, b, e, out, sinv);
  });
  return {data, scale_inv};
}

// --------------------------------------------------------------------------------- MXFP8
std::tuple<Tensor, Tensor> quantize_mxfp8(const Tensor& x_in, int64_t kind_i, bool rceil, bool columnwise,
                                          const optional<Tensor>& out_data, const optional<Tensor>& out_codes) {
  NoPythonDispatch no_python;
  check_plain(x_in, "x");
  in_type(x_in, "x");
  TORCH_CHECK_VALUE(x_in.dim() == 2, "x: expected the 2D view, got ", x_in.dim(), " dims");
  const Fp8Kind kind = fp8_kind(kind_i);
  const int64_t M = x_in.size(0), K = x_in.size(1);
  constexpr int64_t kBlock = 32;
  const int64_t code_rows = columnwise ? (M + kBlock - 1) / kBlock : M;
  const int64_t code_cols = columnwise ? K : (K + kBlock - 1) / kBlock;
  Tensor data = output(out_data, {M, K}, fp8_dtype(kind), "out_data");
  Tensor codes = output(out_codes, {code_rows, code_cols}, at::kByte, "out_scale");
  check_disjoint(data, "out_data", x_in, "x");
  check_disjoint(codes, "out_scale", x_in, "x");
  check_disjoint(codes, "out_scale", data, "out_data");
  if (M * K == 0) return {data, codes};

  Tensor x = row_major(x_in).has_value() ? x_in : x_in.contiguous();
  const Src src = *row_major(x);
  const Kernels& k = kernels();
  uint8_t* out = bytes(data);
  uint8_t* c = bytes(codes);
  if (!columnwise) {
    parallel_chunks(M, std::max<int64_t>(1, kElemGrain / K), [&](int64_t b, int64_t e, int) {
      k.mx_rowwise(src, M, K, kind, rceil, b, e, out, c);
    });
  } else {
    constexpr int64_t kChunk = 512;  // columns per work unit
    const int64_t chunks = (K + kChunk - 1) / kChunk;
    parallel_chunks(code_rows * chunks, std::max<int64_t>(1, kElemGrain / (kBlock * kChunk)),
                    [&](int64_t b, int64_t e, int) {
                      for (int64_t u = b; u < e; ++u) {
                        const int64_t br = u / chunks, c0 = (u % chunks) * kChunk;
                        k.mx_colwise(src, M, K, kind, rceil, br, br + 1, c0, std::min(K, c0 + kChunk), out, c);
                      }
                    });
  }
  return {data, codes};
}

// ------------------------------------------------------------- both usages in one call
// (rowwise data, its scales, columnwise data, its scales), None for a usage not asked for: what the
// Python wrappers' two calls gave, with one call's checks and binding cost (~10 us of a 16x256 Linear's
// step per quantized tensor).
using UsageBuffers = std::tuple<optional<Tensor>, optional<Tensor>, optional<Tensor>, optional<Tensor>>;

// Block scaling: the rowwise usage from x2d, the columnwise one from its transposed view, same tiles.
UsageBuffers quantize_block_usages(const Tensor& x2d, int64_t kind, int64_t tile_rows, int64_t tile_cols, bool pow2,
                                   double amax_epsilon, double value_for_inf, bool rowwise, bool columnwise,
                                   const optional<Tensor>& out_row_data, const optional<Tensor>& out_col_data) {
  UsageBuffers r;
  TORCH_CHECK_VALUE(x2d.dim() == 2, "x2d: expected a 2D tensor, got ", x2d.dim(), " dims");
  if (rowwise) {
    std::tie(std::get<0>(r), std::get<1>(r)) = quantize_block(x2d, kind, tile_rows, tile_cols, pow2, amax_epsilon,
                                                              value_for_inf, out_row_data, c10::nullopt);
  }
  if (columnwise && rowwise && tile_rows == tile_cols) {
    // square tiles: tile (i, j) of x2d^T is tile (j, i) of x2d, with the same amax, scale and cast of each
    // element, so the columnwise usage is the rowwise one transposed, bit for bit (a byte transpose, not a pass)
    const Tensor& row = *std::get<0>(r);
    const int64_t M = row.size(0), K = row.size(1);
    Tensor col = output(out_col_data, {K, M}, row.scalar_type(), "out_col_data");
    check_disjoint(col, "out_col_data", x2d, "x2d");
    check_disjoint(col, "out_col_data", row, "out_row_data");
    const uint8_t* src = bytes(row);
    uint8_t* dst = bytes(col);
    const Kernels& kern = kernels();
    parallel_chunks((M + 63) / 64, std::max<int64_t>(1, kElemGrain / (64 * std::max<int64_t>(1, K))),
                    [&](int64_t b, int64_t e, int) { kern.transpose_bytes(src, M, K, 64 * b, std::min(M, 64 * e), dst); });
    const Tensor& row_scale = *std::get<1>(r);  // [tm, tk], contiguous
    Tensor col_scale = at::empty({row_scale.size(1), row_scale.size(0)}, row_scale.options());
    const float* rs = row_scale.data_ptr<float>();
    float* cs = col_scale.data_ptr<float>();
    for (int64_t i = 0; i < row_scale.size(0); ++i)
      for (int64_t j = 0; j < row_scale.size(1); ++j) cs[j * row_scale.size(0) + i] = rs[i * row_scale.size(1) + j];
    std::get<2>(r) = col;
    std::get<3>(r) = col_scale;
  } else if (columnwise) {
    std::tie(std::get<2>(r), std::get<3>(r)) = quantize_block(x2d.t(), kind, tile_rows, tile_cols, pow2, amax_epsilon,
                                                              value_for_inf, out_col_data, c10::nullopt);
  }
  return r;
}

// MXFP8: 1x32 and 32x1 blocks of x2d, both in x2d's shape.
UsageBuffers quantize_mxfp8_usages(const Tensor& x2d, int64_t kind, bool rceil, bool rowwise, bool columnwise,
                                   const optional<Tensor>& out_row_data, const optional<Tensor>& out_col_data) {
  UsageBuffers r;
  if (rowwise) {
    std::tie(std::get<0>(r), std::get<1>(r)) = quantize_mxfp8(x2d, kind, rceil, false, out_row_data, c10::nullopt);
  }
  if (columnwise) {
    std::tie(std::get<2>(r), std::get<3>(r)) = quantize_mxfp8(x2d, kind, rceil, true, out_col_data, c10::nullopt);
  }
  return r;
}

// --------------------------------------------------------------------------- fp8 -> bf16
Tensor fp8_to_bf16(const Tensor& data_in, const optional<Tensor>& out) {
  NoPythonDispatch no_python;
  check_plain(data_in, "data");
  const auto dt = data_in.scalar_type();
  TORCH_CHECK_TYPE(dt == at::kFloat8_e4m3fn || dt == at::kFloat8_e5m2,
                   "data: expected dtype float8_e4m3fn or float8_e5m2, got ", dt);
  const Fp8Kind kind = dt == at::kFloat8_e4m3fn ? Fp8Kind::E4M3 : Fp8Kind::E5M2;
  Tensor data = data_in.contiguous();
  Tensor result = output(out, data.sizes(), at::kBFloat16, "out");
  check_disjoint(result, "out", data_in, "data");
  const uint8_t* codes = static_cast<const uint8_t*>(data.data_ptr());
  uint16_t* dst = static_cast<uint16_t*>(result.data_ptr());
  const Kernels& k = kernels();
  parallel_chunks(data.numel(), kElemGrain, [&](int64_t b, int64_t e, int) { k.fp8_to_bf16(codes, kind, b, e, dst); });
  return result;
}


// ---------------------------------------------------------- exact bf16 GEMMs of FP8 operands
// The CPU GEMMs of engine/gemm/cpu.py for per-tensor pairs and pairs with power-of-2 tile
// scales, in one call: every FP8 value times a power of two is a bf16 value, so each operand
// is decoded to bf16 exactly and one addmm (fp32 accumulation) runs, with the per-tensor
// scale product as alpha: the Python path's ATen calls, without its per-call cost. The addmm is
// bf16 for a bf16 output where the caller says torch's bf16 GEMM is native (`bf16_gemm`:
// engine/ops/exact_gemm.py's native_bf16_gemm), else fp32 on the same values. Small
// problems on AVX-512 run the kernel of small_gemm.h instead of addmm (see small_gemm below):
// same decode, fp32 accumulation in its own order (numerics: engine/ops/exact_gemm.py).

// One K-major operand: FP8 data [rows, K] (any strides) and its scale_inv: [1] (tile 0 x 0,
// per tensor: not applied here) or one scale per tile_rows x tile_cols tile (fp32 powers of
// two, or uint8 E8M0 codes), shaped [ceil(rows/tile_rows), ceil(K/tile_cols)], any strides.
struct Operand {
  Tensor data, scale_inv;
  int64_t tile_rows, tile_cols;
  bool per_tensor() const { return tile_rows == 0 && tile_cols == 0; }
};

Operand checked_operand(const Tensor& data, const Tensor& scale_inv, int64_t tile_rows, int64_t tile_cols,
                        const char* name) {
  check_plain(data, name);
  check_plain(scale_inv, name);
  const auto dt = data.scalar_type();
  TORCH_CHECK_TYPE(dt == at::kFloat8_e4m3fn || dt == at::kFloat8_e5m2 || dt == at::kBFloat16, name,
                   ": expected float8_e4m3fn or float8_e5m2 data (or bfloat16: decoded 4/6-bit elements), got ", dt);
  TORCH_CHECK_VALUE(data.dim() == 2, name, ": expected 2D data [rows, K], got shape ", data.sizes());
  TORCH_CHECK_VALUE(tile_rows >= 0 && tile_cols >= 0 && (tile_rows == 0) == (tile_cols == 0), name,
                    ": expected tile sizes both 0 (per tensor) or both >= 1, got ", tile_rows, " x ", tile_cols);
  if (tile_rows == 0) {
    scalar_f32(scale_inv, name);
  } else {
    const auto st = scale_inv.scalar_type();
    TORCH_CHECK_TYPE(st == at::kFloat || st == at::kByte, name, ": expected float32 or uint8 (E8M0) tile scales, got ",
                     st);
    const int64_t rows = data.size(0), k = data.size(1);
    const std::vector<int64_t> grid{rows == 0 ? 0 : (rows + tile_rows - 1) / tile_rows,
                                    k == 0 ? 0 : (k + tile_cols - 1) / tile_cols};
    TORCH_CHECK_VALUE(scale_inv.dim() == 2 && (rows == 0 || k == 0 || scale_inv.sizes() == at::IntArrayRef(grid)),
                      name, ": expected tile scales of shape ", at::IntArrayRef(grid), ", got ", scale_inv.sizes());
  }
  return {data, scale_inv, tile_rows, tile_cols};
}

// Decodes an operand's storage rows to exact bf16 words: data times its tile scale (per tensor: the data). Data
// stored column-major (a transposed view) is decoded in its storage order, its rows being the operand's columns.
struct Decoder {
  Tensor data;  // op.data in storage order, contiguous: [rows, K], or [K, rows] when `transposed`
  Operand op;
  bool transposed, decoded;
  Fp8Kind kind;
  int64_t rows, k;  // of `data`
  // tile scales in storage order: tiles of tr x tc, scale (i, j) at sp[i * ss0 + j * ss1] (fp32, or E8M0 codes)
  int64_t tr = 0, tc = 0, tiles = 0, ss0 = 0, ss1 = 0;
  const void* sp = nullptr;
  bool e8m0 = false;

  explicit Decoder(const Operand& o) : op(o) {
    transposed = o.data.size(0) > 1 && o.data.size(1) > 1 && o.data.stride(0) == 1 &&
                 o.data.stride(1) == o.data.size(0);
    data = transposed ? o.data.t() : o.data.contiguous();
    decoded = data.scalar_type() == at::kBFloat16;  // element values already (MXFP4/MXFP6)
    kind = data.scalar_type() == at::kFloat8_e4m3fn ? Fp8Kind::E4M3 : Fp8Kind::E5M2;
    rows = data.size(0);
    k = data.size(1);
    if (!o.per_tensor()) {
      tr = transposed ? o.tile_cols : o.tile_rows;
      tc = transposed ? o.tile_rows : o.tile_cols;
      tiles = (k + tc - 1) / tc;
      ss0 = transposed ? o.scale_inv.stride(1) : o.scale_inv.stride(0);
      ss1 = transposed ? o.scale_inv.stride(0) : o.scale_inv.stride(1);
      sp = o.scale_inv.data_ptr();
      e8m0 = o.scale_inv.scalar_type() == at::kByte;
    }
  }

  // The decode as the small GEMM reads it: the operand [op rows, K], row- or column-major (null pointer).
  SgOperand layout() const {
    return transposed ? SgOperand{nullptr, op.data.size(0), 1, op.data.size(0)}
                      : SgOperand{nullptr, rows, k, 1};
  }

  // One tile row's scales, kept while consecutive storage rows share them. One scale per element (tc 1: MXFP8's
  // columnwise data read transposed) whose every scale is an exponent shift keeping each code normal also holds
  // the words' adds (fp8_to_bf16_shifted) instead of products.
  struct TileRow {
    int64_t index = -1;
    std::vector<float> scales;
    std::vector<int16_t> adds;
    bool shifted = false;
    std::vector<float> batch_scales;  // a batch of rows' scales back to back (decode)
  };

  // fp32 scales of the `count` tiles from scale_inv's element `at` on, `step` elements apart.
  void scales_at(int64_t at, int64_t count, int64_t step, float* out) const {
    if (e8m0) {
      const uint8_t* c = static_cast<const uint8_t*>(sp) + at;
      for (int64_t j = 0; j < count; ++j) out[j] = std::bit_cast<float>(e8m0_f32_bits(c[j * step]));
    } else {
      const float* f = static_cast<const float*>(sp) + at;
      for (int64_t j = 0; j < count; ++j) out[j] = f[j * step];
    }
  }

  void load(int64_t tile_row, TileRow& t) const {
    t.index = tile_row;
    t.scales.resize(static_cast<size_t>(tiles));
    const int64_t at = tile_row * ss0;
    const uint8_t* c = static_cast<const uint8_t*>(sp) + at;  // E8M0 codes
    scales_at(at, tiles, ss1, t.scales.data());
    t.shifted = tc == 1 && !decoded;
    if (!t.shifted) return;
    t.adds.resize(static_cast<size_t>(tiles));
    if (e8m0) {  // code c is 2^(c - 127): normal for c in [1, 254], which the shift range lies within
      const int lo = min_normal_shift(kind), hi = max_normal_shift(kind);
      bool ok = true;
      for (int64_t j = 0; j < tiles; ++j) {
        const int shift = static_cast<int>(c[j * ss1]) - 127;
        ok = ok & (shift >= lo) & (shift <= hi);
        t.adds[j] = static_cast<int16_t>(shift * 128);
      }
      t.shifted = ok;
      return;
    }
    for (int64_t j = 0; j < tiles && t.shifted; ++j) {
      const int shift = pow2_shift(t.scales[j]);
      t.shifted = shift_stays_normal(kind, shift);
      t.adds[j] = static_cast<int16_t>(shift * 128);
    }
  }

  // Storage rows [r0, r1) into dst (row r at dst + (r - r0) * k); `t` carries tile scales from call to call.
  void decode(int64_t r0, int64_t r1, uint16_t* dst, TileRow& t) const {
    const uint8_t* codes = static_cast<const uint8_t*>(data.data_ptr());
    const Kernels& kern = kernels();
    if (op.per_tensor() || decoded) {
      if (decoded) {
        std::memcpy(dst, reinterpret_cast<const uint16_t*>(codes) + r0 * k, static_cast<size_t>((r1 - r0) * k) * 2);
      } else {
        kern.fp8_to_bf16(codes + r0 * k, kind, 0, (r1 - r0) * k, dst);
      }
      if (op.per_tensor()) return;
    }
    if (!decoded && tc > 1 && k % tc == 0) {
      // whole tiles in every row: consecutive rows are one sequence of runs, decoded by one kernel call per batch
      // (the per-call cost is that of a few hundred elements: MXFP8's weight rows are 256)
      const int64_t batch = std::max<int64_t>(1, 8192 / k);
      for (int64_t r = r0; r < r1; r += batch) {
        const int64_t e = std::min(r1, r + batch);
        t.batch_scales.resize(static_cast<size_t>((e - r) * tiles));
        if (tr == 1 && ss1 == 1 && ss0 == tiles) {  // the batch's scales are contiguous: one flat conversion
          scales_at(r * ss0, (e - r) * tiles, 1, t.batch_scales.data());
        } else {
          for (int64_t i = r; i < e; ++i) {
            if (i / tr != t.index) load(i / tr, t);
            std::copy(t.scales.begin(), t.scales.end(), t.batch_scales.begin() + (i - r) * tiles);
          }
        }
        kern.fp8_to_bf16_scaled(codes + r * k, kind, (e - r) * k, dst + (r - r0) * k, t.batch_scales.data(), tc);
      }
      return;
    }
    for (int64_t r = r0; r < r1; ++r) {
      if (r / tr != t.index) load(r / tr, t);
      uint16_t* row = dst + (r - r0) * k;
      if (decoded) {
        kern.scale_bf16(row, t.scales.data(), k, tc);
      } else if (t.shifted) {
        kern.fp8_to_bf16_shifted(codes + r * k, kind, k, row, t.adds.data());
      } else {  // a row at a time: decoded and scaled while in cache
        kern.fp8_to_bf16_scaled(codes + r * k, kind, k, row, t.scales.data(), tc);
      }
    }
  }

  // The whole operand's exact bf16 value [op rows, K] (a transposed view when stored column-major).
  Tensor decode_all() const {
    Tensor out = at::empty({rows, k}, at::TensorOptions().dtype(at::kBFloat16));
    uint16_t* dst = static_cast<uint16_t*>(out.data_ptr());
    if (rows * k > 0) {
      parallel_chunks(rows, std::max<int64_t>(1, kElemGrain / k), [&](int64_t r0, int64_t r1, int) {
        TileRow t;
        decode(r0, r1, dst + r0 * k, t);
      });
    }
    return transposed ? out.t() : out;
  }
};

// ------------------------------------------------------------------ the small exact GEMM
// When the AVX-512 kernel of small_gemm.h replaces addmm. Measured with benchmarks/bench_small_gemm.py (Zen 4 EPYC,
// 1 thread, 2 MiB of other memory traffic between calls as in a training step; time of decode + kernel vs decode +
// addmm):
// * bf16 output: addmm runs oneDNN's bf16 GEMM (vdpbf16ps, twice the fp32 FMA rate, but it flushes subnormals, so
//   the kernel may not use it); below ~2M multiply-adds its per-call cost (primitive setup, allocations, cold caches)
//   dominates: 1.0M MACs 0.54-0.66 (the 16x256x256 Linear GEMMs: 35 vs 58-65 us), 2.1M 0.85, 4.2M 1.06-1.15, 8.4M
//   1.43, 100M+ (the demo's GEMMs) 1.8 -- against a baseline that calls addmm from Python, a few us (7-13% at 4-8M
//   MACs, where exact_gemm runs addmm too) slower than exact_gemm's own addmm: the crossover is near 2M. So up to
//   M * N * K = 2^21.
// * fp32 / fp16 output, and bf16 where the bf16 GEMM is not native (an AVX-512 CPU without BF16): addmm runs an
//   fp32 GEMM, no faster per FMA than the kernel: 1.0M 0.59-0.76, 8.4M 0.83,
//   16.8M-134M with K <= 512 0.86-0.94, 134M with K = 2048 1.65. So for every M and N up to K = 512: the choice then
//   depends on K alone, and a GEMM on a slice of A's or B's rows (a tensor-parallel shard) takes the same path, and
//   gives the same bits, as the whole one.
constexpr int64_t kSmallGemmMaxMacsBf16 = int64_t{1} << 21;
constexpr int64_t kSmallGemmMaxKF32 = 512;

// Which operand the kernel packs as 16-wide k-major vectors (the other is broadcast): the one whose packing and
// lane waste cost less, in zmm FMAs (1 cycle each) plus per-element costs measured on Zen 4: 0.2 cycles to transpose
// an element into panels, 0.05 to widen one, 0.5 per output transposed back (s = B). Either way the bits are the same.
bool sg_pack_a(const SgOperand& a, const SgOperand& b, int64_t K) {
  const int64_t M = a.rows, N = b.rows, Mp = (M + 15) / 16 * 16, Np = (N + 15) / 16 * 16;
  const double rows_cost = static_cast<double>(M) * (Np / 16) * K + 0.2 * N * K * (b.ks == 1) + 0.05 * M * K;
  const double cols_cost = static_cast<double>(Mp / 16) * Np * K + 0.2 * M * K * (a.ks == 1) + 0.05 * N * K +
                           0.5 * static_cast<double>(Mp) * Np;
  return cols_cost < rows_cost;
}

// Whether the kernel of small_gemm.h runs an M x N x K GEMM (else addmm): a problem within the threshold, on the
// AVX-512 kernel set.
bool small_gemm_runs(int64_t M, int64_t N, int64_t K, at::ScalarType gemm_dtype) {
  const bool small = gemm_dtype == at::kBFloat16 ? M * N * K <= kSmallGemmMaxMacsBf16 : K <= kSmallGemmMaxKF32;
  return small && &kernels() == avx512_kernels() && small_gemm_avx512::compiled();
}

// alpha * (decode(a) @ decode(b)^T) (+ bias) by the kernel of small_gemm.h (numerics there). The packed operand
// (v) is decoded whole, then packed; the broadcast one (s) is decoded a few storage rows at a time and widened
// straight into its fp32 pack (its storage rows, widened), so it never exists as a bf16 tensor.
// The bias as the GEMM adds it: rounded to bf16 for a bf16 output (whatever the GEMM's dtype), else to fp32.
Tensor rounded_bias(const Tensor& bias, at::ScalarType out_dtype) {
  const at::ScalarType dt = out_dtype == at::kBFloat16 ? at::kBFloat16 : at::kFloat;
  return bias.scalar_type() == dt ? bias : bias.to(dt);
}

Tensor small_gemm(const Decoder& a, const Decoder& b, float alpha, const optional<Tensor>& bias,
                  at::ScalarType out_dtype) {
  const int64_t M = a.op.data.size(0), N = b.op.data.size(0), K = a.op.data.size(1);
  Tensor out = at::empty({M, N}, at::TensorOptions().dtype(out_dtype));
  if (M * N == 0) return out;
  std::vector<float> bias_f;
  if (bias.has_value()) {  // rounded as addmm's bias is, then exact in fp32
    const Tensor bb = rounded_bias(*bias, out_dtype).to(at::kFloat).contiguous();
    bias_f.resize(static_cast<size_t>(N));
    std::memcpy(bias_f.data(), bb.data_ptr<float>(), static_cast<size_t>(N) * sizeof(float));
  }
  SmallGemmJob job{};
  job.K = K;
  job.out_transposed = sg_pack_a(a.layout(), b.layout(), K);
  const Decoder& s = job.out_transposed ? b : a;
  const Decoder& v = job.out_transposed ? a : b;
  const Tensor v_bf16 = v.decode_all();
  job.s = s.layout();
  job.v = v.layout();
  job.v.x = static_cast<const uint16_t*>(v_bf16.data_ptr());
  job.alpha = alpha;
  job.bias = bias.has_value() ? bias_f.data() : nullptr;
  job.out_type = out_dtype == at::kFloat ? SgOut::F32 : out_dtype == at::kBFloat16 ? SgOut::BF16 : SgOut::F16;
  job.out = out.data_ptr();
  const int64_t v_floats = (job.v.rows + 15) / 16 * 16 * K;
  Tensor scratch = at::empty({job.s.rows * K + v_floats}, at::TensorOptions().dtype(at::kFloat));
  job.s_pack = scratch.data_ptr<float>();
  job.v_pack = job.s_pack + job.s.rows * K;
  namespace sg = small_gemm_avx512;
  if (s.rows * s.k > 0) {  // storage row r of s at s_pack + r * s.k
    const int64_t batch = std::max<int64_t>(1, 4096 / s.k);  // storage rows per decode: a few KiB, in L1
    parallel_chunks(s.rows, std::max<int64_t>(1, kElemGrain / s.k), [&](int64_t r0, int64_t r1, int) {
      std::vector<uint16_t> rows(static_cast<size_t>(std::min(batch, r1 - r0) * s.k));
      Decoder::TileRow t;
      for (int64_t r = r0; r < r1; r += batch) {
        const int64_t e = std::min(r1, r + batch);
        s.decode(r, e, rows.data(), t);
        sg::widen(rows.data(), (e - r) * s.k, job.s_pack + r * s.k);
      }
    });
  }
  parallel_chunks(sg::v_units(job), std::max<int64_t>(1, kElemGrain / std::max<int64_t>(1, 16 * K)),
                  [&](int64_t b0, int64_t e0, int) { sg::pack_v(job, b0, e0); });
  // a tile is 256 outputs: one thread per 2^20 multiply-adds at least
  parallel_chunks(sg::tiles(job), std::max<int64_t>(1, (int64_t{1} << 20) / (256 * std::max<int64_t>(1, K))),
                  [&](int64_t b0, int64_t e0, int) { sg::run_tiles(job, b0, e0); });
  return out;
}

// out = decode(a) @ decode(b)^T * alpha (+ bias), in out_dtype; nullopt for a per-tensor pair
// whose fp32 scale product is not a normal number (the caller rescales in Python).
optional<Tensor> exact_gemm(const Tensor& a_data, const Tensor& a_scale_inv, int64_t a_tile_rows, int64_t a_tile_cols,
                            const Tensor& b_data, const Tensor& b_scale_inv, int64_t b_tile_rows, int64_t b_tile_cols,
                            const optional<Tensor>& bias, at::ScalarType out_dtype, bool bf16_gemm) {
  NoPythonDispatch no_python;
  const Operand a = checked_operand(a_data, a_scale_inv, a_tile_rows, a_tile_cols, "a");
  const Operand b = checked_operand(b_data, b_scale_inv, b_tile_rows, b_tile_cols, "b");
  TORCH_CHECK_VALUE(a.per_tensor() == b.per_tensor(), "exact_gemm: pair per-tensor operands with per-tensor ones");
  TORCH_CHECK_VALUE(a_data.size(1) == b_data.size(1), "exact_gemm: inner dims differ: A is ", a_data.sizes(),
                    ", B is ", b_data.sizes());
  TORCH_CHECK_TYPE(out_dtype == at::kFloat || out_dtype == at::kBFloat16 || out_dtype == at::kHalf,
                   "out_dtype: expected float32, bfloat16 or float16, got ", out_dtype);
  const int64_t m = a_data.size(0), n = b_data.size(0);
  if (bias.has_value()) {
    check_plain(*bias, "bias");
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == n, "bias: expected shape (", n, ",), got ", bias->sizes());
  }
  double alpha = 1.0;
  if (a.per_tensor()) {  // fp32(sa * sb): the double product is exact, one rounding to fp32
    const float product = static_cast<float>(static_cast<double>(*a_scale_inv.data_ptr<float>()) *
                                             static_cast<double>(*b_scale_inv.data_ptr<float>()));
    const float mag = std::fabs(product);
    if (!(mag >= 1.17549435e-38f && mag <= 3.40282347e38f)) return c10::nullopt;
    alpha = product;
  }
  const at::ScalarType gemm_dtype = out_dtype == at::kBFloat16 && bf16_gemm ? at::kBFloat16 : at::kFloat;
  const Decoder da(a), db(b);
  if (small_gemm_runs(m, n, a_data.size(1), gemm_dtype)) {
    return small_gemm(da, db, static_cast<float>(alpha), bias, out_dtype);
  }
  Tensor lhs = da.decode_all(), rhs = db.decode_all();
  if (gemm_dtype != at::kBFloat16) {
    lhs = lhs.to(gemm_dtype);
    rhs = rhs.to(gemm_dtype);
  }
  Tensor result;
  DefaultFpEnv env;  // the caller's flush-to-zero state must not reach oneDNN's fp32 GEMM on this thread
  if (bias.has_value()) {
    result = at::addmm(rounded_bias(*bias, out_dtype).to(gemm_dtype).expand({m, n}), lhs, rhs.t(), 1.0, alpha);
  } else {
    result = at::addmm(at::empty({m, n}, lhs.options()), lhs, rhs.t(), 0.0, alpha);
  }
  return result.scalar_type() == out_dtype ? result : result.to(out_dtype);
}

}  // namespace
}  // namespace engine_native

namespace engine_native {
void register_mx_small(pybind11::module_& m);  // kernels_mx_small.cpp: MXFP4 / MXFP6
void register_nvfp4(pybind11::module_& m);     // kernels_nvfp4.cpp: NVFP4
void register_wo_gemm(pybind11::module_& m);   // kernels_wo_gemm.cpp: weight-only int4 / int8 GEMMs
void register_int8_dynamic(pybind11::module_& m);  // kernels_int8_dynamic.cpp: int8 x quantize / rescale
}  // namespace engine_native

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace engine_native;
  namespace py = pybind11;
  m.doc() = "engine's C++ CPU quantization kernels (see engine/ops/native.py)";
  m.def("isa", &isa, "the kernel set in use: 'avx512' or 'portable'");
  m.def("set_isa", &set_isa, py::arg("name"), "force 'avx512' or 'portable' ('auto' = CPUID)");
  m.def("available_isas", &available_isas);
  m.def("amax", &amax, py::arg("x"), py::arg("out") = py::none());
  m.def("cast_transpose", &cast_transpose, py::arg("x2d"), py::arg("scale"), py::arg("kind"), py::arg("rowwise"),
        py::arg("columnwise"), py::arg("out_data") = py::none(), py::arg("out_data_t") = py::none(),
        py::arg("out_amax") = py::none());
  m.def("quantize_per_tensor", &quantize_per_tensor, py::arg("x"), py::arg("kind"), py::arg("rowwise"),
        py::arg("columnwise"), py::arg("scale"), py::arg("force_pow_2_scales"), py::arg("amax_epsilon"),
        py::arg("record_amax"), py::arg("out_data") = py::none(), py::arg("out_data_t") = py::none(),
        py::arg("out_scale_inv") = py::none(), py::arg("out_amax") = py::none());
  m.def("delayed_update", &delayed_update_op, py::arg("amax_history"), py::arg("scale"), py::arg("fp8_max"),
        py::arg("margin"), py::arg("most_recent"), py::arg("held"));
  m.def("quantize_block", &quantize_block, py::arg("x2d"), py::arg("kind"), py::arg("tile_rows"), py::arg("tile_cols"),
        py::arg("force_pow_2_scales"), py::arg("amax_epsilon"), py::arg("value_for_inf"),
        py::arg("out_data") = py::none(), py::arg("out_scale_inv") = py::none());
  m.def("quantize_mxfp8", &quantize_mxfp8, py::arg("x2d"), py::arg("kind"), py::arg("rceil"), py::arg("columnwise"),
        py::arg("out_data") = py::none(), py::arg("out_scale") = py::none());
  m.def("quantize_block_usages", &quantize_block_usages, py::arg("x2d"), py::arg("kind"), py::arg("tile_rows"),
        py::arg("tile_cols"), py::arg("pow2"), py::arg("amax_epsilon"), py::arg("value_for_inf"), py::arg("rowwise"),
        py::arg("columnwise"), py::arg("out_row_data") = py::none(), py::arg("out_col_data") = py::none());
  m.def("quantize_mxfp8_usages", &quantize_mxfp8_usages, py::arg("x2d"), py::arg("kind"), py::arg("rceil"),
        py::arg("rowwise"), py::arg("columnwise"), py::arg("out_row_data") = py::none(),
        py::arg("out_col_data") = py::none());
  m.def("fp8_to_bf16", &fp8_to_bf16, py::arg("data"), py::arg("out") = py::none());
  m.def("exact_gemm", &exact_gemm, py::arg("a"), py::arg("a_scale_inv"), py::arg("a_tile_rows"),
        py::arg("a_tile_cols"), py::arg("b"), py::arg("b_scale_inv"), py::arg("b_tile_rows"), py::arg("b_tile_cols"),
        py::arg("bias"), py::arg("out_dtype"), py::arg("bf16_gemm"));
  register_mx_small(m);
  register_nvfp4(m);
  register_wo_gemm(m);
  register_int8_dynamic(m);
}
