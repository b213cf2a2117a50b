// Torch glue of the exact FP8 GEMM (engine/ops/exact_gemm.py): operands decoded exactly (cast/fp8.h's decode
// kernels), then addmm or the small GEMM of gemm/small_gemm.h.
#include "common/glue.h"

#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <bit>

#include "cast/fp8.h"
#include "gemm/exact_gemm_glue.h"
#include "gemm/small_gemm.h"

namespace engine_native {
namespace exact_gemm_glue {

using namespace glue;

const Kernels& kernels() { return fp8_table(active_isa()); }

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
// problems on AVX2 and AVX-512 run the kernel of small_gemm.h instead of addmm (see small_gemm below):
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
// When the kernel of small_gemm.h replaces addmm, per instruction-set level (the kernel's bits are the same at every
// level; only its speed against addmm differs). Measured with benchmarks/bench_small_gemm.py (Zen 4 EPYC, 1 thread,
// 2 MiB of other memory traffic between calls as in a training step; time of decode + kernel vs decode + addmm).
// avx512:
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
// avx2, the same kernel at 8 fp32 lanes (same machine; ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 for torch's
// GEMMs as an AVX2 CPU runs them):
// * fp32 output, and bf16 without native bf16 GEMMs (an AVX2 CPU): 1.0M MACs 0.53-0.81, 8.4M 0.80, 16.8M 0.74,
//   33.5M-134M with K <= 512 0.82-0.91; K = 2048 runs addmm. So, as at avx512, every M and N up to K = 512.
// * bf16 output where the bf16 GEMM is native (a bf16 CPU capped at avx2 by ENGINE_ISA): 1.0M 0.72-0.74 (the
//   16x256x256 Linear GEMMs: 79 vs 110 us), while at 2.1M the kernel takes about twice its 1.0M time, more than
//   addmm's 114 us. So up to 2^20.
// baseline: never on x86-64 (no fma instruction: the kernel's fma is libm's); nor on other machines (not measured).
struct SmallGemmLimits {
  int64_t max_macs_bf16;  // bf16 GEMMs (native bf16 addmm) up to this many multiply-adds
  int64_t max_k_f32;      // fp32 GEMMs up to this K, whatever M and N
};

SmallGemmLimits small_gemm_limits(Isa isa) {
  switch (isa) {
    case Isa::Avx512: return {int64_t{1} << 21, 512};
    case Isa::Avx2: return {int64_t{1} << 20, 512};
    default: return {0, 0};
  }
}

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

// Whether the kernel of small_gemm.h runs an M x N x K GEMM (else addmm): a problem within the active level's limits.
bool small_gemm_runs(int64_t M, int64_t N, int64_t K, at::ScalarType gemm_dtype) {
  const SmallGemmLimits limits = small_gemm_limits(active_isa());
  return gemm_dtype == at::kBFloat16 ? M * N * K <= limits.max_macs_bf16 : K <= limits.max_k_f32;
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
  const SmallGemmKernels& sg = small_gemm_kernels(active_isa());
  if (s.rows * s.k > 0) {  // storage row r of s at s_pack + r * s.k
    const int64_t batch = std::max<int64_t>(1, 4096 / s.k);  // storage rows per decode: a few KiB, in L1
    parallel_chunks(s.rows, std::max<int64_t>(1, kElemGrain / s.k), [&](int64_t r0, int64_t r1, int) {
      std::vector<uint16_t> rows(static_cast<size_t>(std::min(batch, r1 - r0) * s.k));
      Decoder::TileRow t;
      for (int64_t r = r0; r < r1; r += batch) {
        const int64_t e = std::min(r1, r + batch);
        s.decode(r, e, rows.data(), t);
        sg.widen(rows.data(), (e - r) * s.k, job.s_pack + r * s.k);
      }
    });
  }
  parallel_chunks(sg.v_units(job), std::max<int64_t>(1, kElemGrain / std::max<int64_t>(1, 16 * K)),
                  [&](int64_t b0, int64_t e0, int) { sg.pack_v(job, b0, e0); });
  // one thread per 2^20 multiply-adds at least (a tile's outputs depend on the level's blocking)
  const int64_t tiles = sg.tiles(job), tile_outputs = std::max<int64_t>(1, M * N / std::max<int64_t>(1, tiles));
  parallel_chunks(tiles, std::max<int64_t>(1, (int64_t{1} << 20) / (tile_outputs * std::max<int64_t>(1, K))),
                  [&](int64_t b0, int64_t e0, int) { sg.run_tiles(job, b0, e0); });
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

}  // namespace exact_gemm_glue
}  // namespace engine_native
