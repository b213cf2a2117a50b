// The fused Adam step's glue: argument checks, the tensor split over OpenMP threads in 256-element chunks (whole
// state blocks), and the kernel of the level in use (optim/adam_kernels.cpp, chosen by active_isa()). Threads run
// with round-to-nearest and without flush-to-zero / denormals-are-zero (MXCSR set per thread).
#include "optim/adam_glue.h"

#include "common/glue.h"
#include "optim/adam.h"

#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

namespace engine_native {
namespace adam_glue {
namespace {

using glue::check_plain;
using glue::DefaultFpEnv;
using glue::NoPythonDispatch;

int64_t block_of(StateKind kind) {
  switch (kind) {
    case StateKind::E4M3_128:
    case StateKind::E5M2_128: return 128;
    case StateKind::INT8_256: return 256;
    default: return 0;
  }
}

at::ScalarType dtype_of(StateKind kind) {
  switch (kind) {
    case StateKind::F32: return at::kFloat;
    case StateKind::BF16:
    case StateKind::BF16_SR: return at::kBFloat16;
    case StateKind::E4M3_128: return at::kFloat8_e4m3fn;
    case StateKind::E5M2_128: return at::kFloat8_e5m2;
    default: return at::kByte;
  }
}

float f32_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint32_t u32_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// The kernel's int8 code rule (adam.h) in scalar form: what the glue proves against the decision points.
int32_t region_of(const Int8Map& t, float v) {
  const int32_t r0 = t.bin_region[int8_bin(u32_of(v))];
  return r0 + (t.lower[r0 + 1] < v ? 1 : 0);
}
int32_t linear_code(const Int8Map& t, int32_t r, float v, bool upper) {
  const float p = v * t.a[r];
  const float x = p + (upper ? t.b2[r] : t.b1[r]);
  const int32_t c = static_cast<int32_t>(x);  // truncation, as the kernel's conversion (|x| < 2^31 here)
  return std::min(std::max(c, t.first[r]), t.last[r]);
}

// The int8 map's code-search tables (adam.h: Int8Map), built from its codes and decision points, and the proof
// that the kernel's rule gives torch.bucketize's code for every value in [-1, 1] (else a ValueError: a map the
// rule does not fit).
struct Int8Tables {
  Int8Map map;

  Int8Tables(const float* codes, const float* mids) {
    std::memcpy(map.codes, codes, 256 * 4);
    std::memcpy(map.mids, mids, 255 * 4);
    map.mids[255] = INFINITY;
    for (int i = 1; i < 255; ++i) {
      TORCH_CHECK_VALUE(mids[i - 1] < mids[i], "mids: expected increasing decision points");
    }
    // regions: runs of codes of one step (to 1e-3 of it, in double)
    int regions = 0;
    for (int k = 0; k < 256;) {
      int j = k;
      if (k + 1 < 256) {
        const double h = static_cast<double>(codes[k + 1]) - codes[k];
        j = k + 1;
        while (j + 1 < 256 && std::abs((static_cast<double>(codes[j + 1]) - codes[j]) - h) <= 1e-3 * h) ++j;
      }
      TORCH_CHECK_VALUE(regions < kInt8Regions - 1, "codes: more than ", kInt8Regions - 1,
                        " runs of equally spaced codes; the int8 kernel's code search does not fit this map");
      const int r = regions++;
      map.lower[r] = r == 0 ? -INFINITY : mids[k - 1];
      map.first[r] = k;
      map.last[r] = j;
      map.a[r] = map.b1[r] = map.b2[r] = 0.0f;
      if (j > k) {
        const double h = (static_cast<double>(codes[j]) - codes[k]) / (j - k);
        const double b = k + 0.5 - codes[k] / h;
        constexpr double kMargin = 1.0 / 4096;
        map.a[r] = static_cast<float>(1.0 / h);
        map.b1[r] = static_cast<float>(b - kMargin);
        map.b2[r] = static_cast<float>(b + kMargin);
      }
      k = j + 1;
    }
    for (int r = regions; r < kInt8Regions; ++r) {
      map.lower[r] = INFINITY;
      map.first[r] = map.last[r] = 255;
      map.a[r] = map.b1[r] = map.b2[r] = 0.0f;
    }
    // the bucket table (adam.h: int8_bucket): per bucket, the decision points below its smallest value; two
    // pointers sweep the buckets in value order
    int32_t below_min = 0, below_max = 0;
    for (int k = 0; k < kInt8Buckets; ++k) {
      const bool neg = k < kInt8Half;
      const uint32_t b = neg ? static_cast<uint32_t>(kInt8Half - 1 - k) : static_cast<uint32_t>(k - kInt8Half);
      const float small = b == 0 ? 0.0f : f32_of(kInt8LoMag + (b << kInt8Shift));  // smallest magnitude
      const float large = b + 1 == static_cast<uint32_t>(kInt8Half)
                              ? INFINITY
                              : f32_of(kInt8LoMag + ((b + 1) << kInt8Shift) - 1u);
      const float vmin = neg ? -large : small, vmax = neg ? -small : large;
      while (below_min < 255 && mids[below_min] < vmin) ++below_min;
      while (below_max < 255 && mids[below_max] < vmax) ++below_max;
      TORCH_CHECK_VALUE(below_max - below_min <= kInt8Probes, "mids: more than ", kInt8Probes,
                        " decision points in one bucket of the int8 search table (adam.h); the map is too fine");
      map.bucket_lo[k] = below_min;
    }
    // bins: the region of the lowest value, and no second region boundary inside
    const auto exact_region = [&](float v) {
      int r = 0;
      while (r + 1 < regions && map.lower[r + 1] < v) ++r;
      return r;
    };
    for (int bin = 0; bin < kInt8Bins; ++bin) {
      const bool neg = bin >= 32;
      const uint32_t e = static_cast<uint32_t>(bin % 32 + kInt8ExpBase);
      const float small = bin % 32 == 0 ? 0.0f : f32_of(e << 23);
      const float large = bin % 32 == 31 ? INFINITY : f32_of(((e + 1) << 23) - 1u);
      const float vmin = neg ? -large : small, vmax = neg ? -small : large;
      map.bin_region[bin] = exact_region(vmin);
      TORCH_CHECK_VALUE(exact_region(vmax) - map.bin_region[bin] <= 1, "mids: two region boundaries in one "
                        "binade; the int8 kernel's code search does not fit this map");
    }
    // the rule, one ulp either side of every decision point (both sides monotone in v: that covers the rest)
    for (int k = 0; k < 255; ++k) {
      for (const float v : {mids[k], std::nextafter(mids[k], INFINITY)}) {
        const int32_t want = v <= mids[k] ? k : k + 1;
        const int32_t r = region_of(map, v);
        const int32_t c1 = linear_code(map, r, v, false), c2 = linear_code(map, r, v, true);
        TORCH_CHECK_VALUE(r == exact_region(v) && c1 <= want && want <= c2 && c2 - c1 <= 1,
                          "codes, mids: the int8 kernel's code search does not fit this map at decision point ", k);
      }
    }
  }
};

// A map's tables as handed back by adam_int8_tables (checked: uint8 bytes of an Int8Map whose indices stay in
// range), or null for None.
const Int8Map* tables_of(const std::optional<Tensor>& t, const char* name) {
  if (!t.has_value()) return nullptr;
  check_plain(*t, name);
  TORCH_CHECK_TYPE(t->scalar_type() == at::kByte && t->is_contiguous() &&
                       t->numel() == static_cast<int64_t>(sizeof(Int8Map)) &&
                       reinterpret_cast<uintptr_t>(t->data_ptr()) % 64 == 0,
                   name, ": expected the 64-byte aligned uint8 tensor of adam_int8_tables (", sizeof(Int8Map),
                   " bytes), got ", t->scalar_type(), " of ", t->numel(), " elements");
  const Int8Map* map = reinterpret_cast<const Int8Map*>(t->data_ptr());
  bool ok = true;
  for (int b = 0; b < kInt8Bins; ++b) ok &= map->bin_region[b] >= 0 && map->bin_region[b] < kInt8Regions - 1;
  for (int r = 0; r < kInt8Regions; ++r) ok &= map->first[r] >= 0 && map->last[r] <= 255 && map->first[r] <= map->last[r];
  for (int k = 0; k < kInt8Buckets; ++k) ok &= map->bucket_lo[k] >= 0 && map->bucket_lo[k] <= 255;
  TORCH_CHECK_VALUE(ok, name, ": not the tables of adam_int8_tables (an index out of range); build them with it");
  return map;
}

StateRef state_ref(const Tensor& data, const std::optional<Tensor>& scale, int64_t kind_code, int64_t n,
                   const char* name, bool sqrt_form, const Tensor& codes, const Tensor& mids,
                   std::optional<Int8Tables>& search, const Int8Map* built) {
  TORCH_CHECK_VALUE(kind_code >= 0 && kind_code <= 5, name, ": expected a state kind 0..5, got ", kind_code);
  const StateKind kind = static_cast<StateKind>(kind_code);
  check_plain(data, name);
  TORCH_CHECK_VALUE(data.is_contiguous(), name, ": expected a contiguous state");
  TORCH_CHECK_TYPE(data.scalar_type() == dtype_of(kind), name, ": expected ", dtype_of(kind), ", got ",
                   data.scalar_type());
  TORCH_CHECK_VALUE(data.numel() == n, name, ": expected ", n, " elements (the parameter's), got ", data.numel());
  StateRef ref{kind, data.data_ptr(), nullptr, codes.data_ptr<float>(), nullptr, sqrt_form, 0u, 0u};
  if (kind == StateKind::INT8_256) {
    if (built == nullptr) {
      if (!search.has_value()) search.emplace(codes.data_ptr<float>(), mids.data_ptr<float>());
      built = &search->map;
    }
    ref.codes = built->codes;
    ref.map = built;
  }
  const int64_t block = block_of(kind);
  if (block) {
    TORCH_CHECK_VALUE(scale.has_value(), name, ": a blocked state needs its scales");
    check_plain(*scale, name);
    TORCH_CHECK_VALUE(scale->is_contiguous(), name, " scales: expected a contiguous tensor");
    TORCH_CHECK_TYPE(scale->scalar_type() == at::kFloat, name, " scales: expected float32, got ", scale->scalar_type());
    TORCH_CHECK_VALUE(scale->numel() == (n + block - 1) / block, name, " scales: expected ", (n + block - 1) / block,
                      " blocks, got ", scale->numel());
    ref.scale = scale->data_ptr<float>();
  }
  return ref;
}

uint32_t lowbias32(uint32_t v) {
  v ^= v >> 16;
  v *= 0x7FEB352Du;
  v ^= v >> 15;
  v *= 0x846CA68Bu;
  return v ^ (v >> 16);
}

// Binds the stochastic bf16 states of (m, v) to the state's random-bit counter (int64 [2] = seed, offset: the
// reference's `state_counter`) and advances it as the reference does: m's bits at the offset, then v's after
// `global_n` more (the whole tensor's count: a shard's counter starts at its position), offset += global_n per
// stochastic state.
void bind_counter(StateRef& m, StateRef& v, const std::optional<Tensor>& counter, int64_t global_n) {
  const bool msr = m.kind == StateKind::BF16_SR, vsr = v.kind == StateKind::BF16_SR;
  if (!msr && !vsr) return;
  TORCH_CHECK_VALUE(counter.has_value(), "counters: a stochastically rounded bf16 state needs its (seed, offset) "
                    "counter, got None");
  check_plain(*counter, "counters");
  TORCH_CHECK_TYPE(counter->scalar_type() == at::kLong && counter->numel() == 2 && counter->is_contiguous(),
                   "counters: expected contiguous int64 tensors of 2 elements (seed, offset), got ",
                   counter->scalar_type(), " of ", counter->numel(), " elements");
  TORCH_CHECK_VALUE(global_n >= 0, "global_numels: expected counts >= 0, got ", global_n);
  int64_t* c = counter->data_ptr<int64_t>();
  const uint64_t seed = static_cast<uint64_t>(c[0]);
  uint64_t offset = static_cast<uint64_t>(c[1]);
  const uint32_t key = lowbias32(static_cast<uint32_t>(seed)) ^ static_cast<uint32_t>(seed >> 32);
  for (StateRef* s : {&m, &v}) {
    if (s->kind != StateKind::BF16_SR) continue;
    s->sr_key = key;
    s->sr_offset = offset;
    offset += static_cast<uint64_t>(global_n);
  }
  c[1] = static_cast<int64_t>(offset);
}

struct Job {
  float* w;
  const void* grad;
  bool grad_bf16;
  uint16_t* w_bf16;
  StateRef m, v;
  AdamScalars s;
  int64_t n;
};

void check_tables(const Tensor& signed_codes, const Tensor& signed_mids, const Tensor& unsigned_codes,
                  const Tensor& unsigned_mids) {
  for (const Tensor* t : {&signed_codes, &unsigned_codes}) {
    check_plain(*t, "codes");
    TORCH_CHECK_VALUE(t->scalar_type() == at::kFloat && t->numel() == 256, "codes: expected 256 float32 values");
  }
  for (const Tensor* t : {&signed_mids, &unsigned_mids}) {
    check_plain(*t, "mids");
    TORCH_CHECK_VALUE(t->scalar_type() == at::kFloat && t->numel() == 255, "mids: expected 255 float32 values");
  }
}

// One tensor's arguments checked and bound (the int8 search tables built into `msearch` / `vsearch` on first use).
Job make_job(const Tensor& w, const Tensor& grad, const std::optional<Tensor>& w_bf16, const Tensor& m,
             const std::optional<Tensor>& m_scale, int64_t m_kind, const Tensor& v,
             const std::optional<Tensor>& v_scale, int64_t v_kind, bool v_sqrt, const Tensor& signed_codes,
             const Tensor& signed_mids, const Tensor& unsigned_codes, const Tensor& unsigned_mids,
             std::optional<Int8Tables>& msearch, std::optional<Int8Tables>& vsearch,
             const Int8Map* mbuilt = nullptr, const Int8Map* vbuilt = nullptr) {
  check_plain(w, "w");
  check_plain(grad, "grad");
  TORCH_CHECK_TYPE(w.scalar_type() == at::kFloat, "w: expected float32, got ", w.scalar_type());
  TORCH_CHECK_TYPE(grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kBFloat16,
                   "grad: expected float32 or bfloat16, got ", grad.scalar_type());
  TORCH_CHECK_VALUE(w.is_contiguous() && grad.is_contiguous(), "w, grad: expected contiguous tensors");
  const int64_t n = w.numel();
  TORCH_CHECK_VALUE(grad.numel() == n, "grad: expected ", n, " elements, got ", grad.numel());
  Job job{w.data_ptr<float>(), grad.data_ptr(), grad.scalar_type() == at::kBFloat16, nullptr,
          state_ref(m, m_scale, m_kind, n, "m", false, signed_codes, signed_mids, msearch, mbuilt),
          state_ref(v, v_scale, v_kind, n, "v", v_sqrt, unsigned_codes, unsigned_mids, vsearch, vbuilt), AdamScalars{},
          n};
  if (w_bf16.has_value()) {
    check_plain(*w_bf16, "w_bf16");
    TORCH_CHECK_TYPE(w_bf16->scalar_type() == at::kBFloat16, "w_bf16: expected bfloat16, got ", w_bf16->scalar_type());
    TORCH_CHECK_VALUE(w_bf16->numel() == n, "w_bf16: expected ", n, " elements, got ", w_bf16->numel());
    job.w_bf16 = static_cast<uint16_t*>(w_bf16->data_ptr());
  }
  return job;
}

// The jobs' 256-element chunks (whole state blocks) as one sequence, split evenly over up to
// (total elements / 2^15) OpenMP threads: a thread may run the end of one tensor and the start of the next.
void run_jobs(const std::vector<Job>& jobs) {
  const AdamKernels& kernels = adam_kernels(active_isa());
  std::vector<int64_t> first(jobs.size() + 1, 0);  // the first global chunk of each job
  int64_t total_n = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    first[i + 1] = first[i] + (jobs[i].n + 255) / 256;
    total_n += jobs[i].n;
  }
  const int64_t chunks = first.back();
  const auto run = [&](int64_t c0, int64_t c1) {
    for (size_t i = 0; i < jobs.size(); ++i) {
      const int64_t a = std::max(c0, first[i]), b = std::min(c1, first[i + 1]);
      if (a >= b) continue;
      const Job& j = jobs[i];
      kernels.step(j.w, j.grad, j.grad_bf16, j.w_bf16, j.m, j.v, j.s, j.n, (a - first[i]) * 256,
                   std::min<int64_t>((b - first[i]) * 256, j.n));
    }
  };
  const int threads = static_cast<int>(std::min<int64_t>({static_cast<int64_t>(omp_get_max_threads()),
                                                          std::max<int64_t>(1, total_n / (1 << 15)),
                                                          std::max<int64_t>(1, chunks)}));
  if (threads <= 1 || omp_in_parallel()) {
    DefaultFpEnv env;
    run(0, chunks);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    DefaultFpEnv env;
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    run(chunks * t / nt, chunks * (t + 1) / nt);
  }
}

}  // namespace

void adam_step(const Tensor& w, const Tensor& grad, const std::optional<Tensor>& w_bf16, const Tensor& m,
               const std::optional<Tensor>& m_scale, int64_t m_kind, const Tensor& v,
               const std::optional<Tensor>& v_scale, int64_t v_kind, bool v_sqrt, const Tensor& signed_codes,
               const Tensor& signed_mids, const Tensor& unsigned_codes, const Tensor& unsigned_mids, double beta1,
               double one_minus_beta1, double beta2, double one_minus_beta2, double step_size, double inv_bc2_sqrt,
               double eps, double decay, double wd, bool maximize) {
  NoPythonDispatch no_python;
  check_tables(signed_codes, signed_mids, unsigned_codes, unsigned_mids);
  std::optional<Int8Tables> msearch, vsearch;
  TORCH_CHECK_VALUE(m_kind != 5 && v_kind != 5, "m_kind, v_kind: stochastically rounded bf16 states (kind 5) "
                    "need their random-bit counters: call adam_step_group");
  Job job = make_job(w, grad, w_bf16, m, m_scale, m_kind, v, v_scale, v_kind, v_sqrt, signed_codes, signed_mids,
                     unsigned_codes, unsigned_mids, msearch, vsearch);
  job.s = AdamScalars{static_cast<float>(beta1), static_cast<float>(one_minus_beta1), static_cast<float>(beta2),
                      static_cast<float>(one_minus_beta2), static_cast<float>(step_size),
                      static_cast<float>(inv_bc2_sqrt), static_cast<float>(eps), static_cast<float>(decay),
                      static_cast<float>(wd), maximize};
  run_jobs(std::vector<Job>{job});
}

void adam_step_group(const std::vector<Tensor>& ws, const std::vector<Tensor>& grads, const std::vector<Tensor>& ms,
                     const std::vector<std::optional<Tensor>>& m_scales, int64_t m_kind, const std::vector<Tensor>& vs,
                     const std::vector<std::optional<Tensor>>& v_scales, int64_t v_kind, bool v_sqrt,
                     const std::vector<Tensor>& steps, const Tensor& signed_codes, const Tensor& signed_mids,
                     const Tensor& unsigned_codes, const Tensor& unsigned_mids, double lr, double beta1, double beta2,
                     double eps, double weight_decay, bool decoupled, bool maximize,
                     const std::vector<std::optional<Tensor>>& counters, const std::vector<int64_t>& global_numels,
                     const std::optional<Tensor>& signed_tables, const std::optional<Tensor>& unsigned_tables) {
  NoPythonDispatch no_python;
  const size_t count = ws.size();
  const bool stochastic = m_kind == 5 || v_kind == 5;
  TORCH_CHECK_VALUE(!stochastic || (counters.size() == count && global_numels.size() == count),
                    "counters, global_numels: stochastically rounded bf16 states need one counter and one count per "
                    "tensor (", count, "), got ", counters.size(), " and ", global_numels.size());
  TORCH_CHECK_VALUE(grads.size() == count && ms.size() == count && m_scales.size() == count && vs.size() == count &&
                        v_scales.size() == count && steps.size() == count,
                    "adam_step_group: expected lists of one length (ws has ", count, "), got grads ", grads.size(),
                    ", ms ", ms.size(), ", m_scales ", m_scales.size(), ", vs ", vs.size(), ", v_scales ",
                    v_scales.size(), ", steps ", steps.size());
  check_tables(signed_codes, signed_mids, unsigned_codes, unsigned_mids);
  for (const Tensor& t : steps) {
    check_plain(t, "steps");
    TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat && t.numel() == 1,
                     "steps: expected one-element float32 step counters (torch.optim's), got ", t.scalar_type(),
                     " of ", t.numel(), " elements");
  }
  // the int8 search tables once for the group (every parameter's state of a kind shares its map)
  std::optional<Int8Tables> msearch, vsearch;
  const Int8Map* mbuilt = tables_of(signed_tables, "signed_tables");
  const Int8Map* vbuilt = tables_of(unsigned_tables, "unsigned_tables");
  std::vector<Job> jobs;
  jobs.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    jobs.push_back(make_job(ws[i], grads[i], std::nullopt, ms[i], m_scales[i], m_kind, vs[i], v_scales[i], v_kind,
                            v_sqrt, signed_codes, signed_mids, unsigned_codes, unsigned_mids, msearch, vsearch,
                            mbuilt, vbuilt));
  }
  for (size_t i = 0; stochastic && i < count; ++i) bind_counter(jobs[i].m, jobs[i].v, counters[i], global_numels[i]);
  // the scalars of Adam.scalars, in double as Python computes them (pow / sqrt of the C library, as Python's
  // float ** float and math.sqrt), after the step counter's float32 increment (torch's `step += 1`)
  for (size_t i = 0; i < count; ++i) {
    float* counter = steps[i].data_ptr<float>();
    *counter = *counter + 1.0f;
    const double step = *counter;
    jobs[i].s = AdamScalars{static_cast<float>(beta1), static_cast<float>(1.0 - beta1), static_cast<float>(beta2),
                            static_cast<float>(1.0 - beta2), static_cast<float>(lr / (1.0 - std::pow(beta1, step))),
                            static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(beta2, step))),
                            static_cast<float>(eps), static_cast<float>(decoupled ? 1.0 - lr * weight_decay : 1.0),
                            static_cast<float>(decoupled ? 0.0 : weight_decay), maximize};
  }
  run_jobs(jobs);
}

Tensor adam_int8_tables(const Tensor& codes, const Tensor& mids) {
  check_plain(codes, "codes");
  check_plain(mids, "mids");
  TORCH_CHECK_VALUE(codes.scalar_type() == at::kFloat && codes.numel() == 256 && codes.is_contiguous(),
                    "codes: expected 256 contiguous float32 values");
  TORCH_CHECK_VALUE(mids.scalar_type() == at::kFloat && mids.numel() == 255 && mids.is_contiguous(),
                    "mids: expected 255 contiguous float32 values");
  const Int8Tables tables(codes.data_ptr<float>(), mids.data_ptr<float>());
  Tensor out = at::empty({static_cast<int64_t>(sizeof(Int8Map))}, codes.options().dtype(at::kByte));
  TORCH_CHECK(reinterpret_cast<uintptr_t>(out.data_ptr()) % 64 == 0, "adam_int8_tables: an unaligned allocation");
  std::memcpy(out.data_ptr(), &tables.map, sizeof(Int8Map));
  return out;
}

}  // namespace adam_glue
}  // namespace engine_native
