// CPU detection and the level in use (isa.h). Compiled once, with no target options.
#include "common/isa.h"

#include <c10/util/Exception.h>

#include <atomic>

namespace engine_native {
namespace {

bool cpu_has(Isa isa) {
#if defined(ENGINE_X86_64) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  switch (isa) {
    case Isa::Avx512:
      return cpu_has(Isa::Avx2) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx512vl");
    case Isa::Avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
             __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("lzcnt") &&
             __builtin_cpu_supports("movbe");
    default:
      return true;
  }
#else
  return isa == Isa::Baseline;
#endif
}

// -1: not chosen (detected_isa()); else the level set_active_isa chose. Process-wide on purpose: the
// kernel variant is a property of the machine, lowered only by ENGINE_ISA or a test.
std::atomic<int> g_active{-1};

}  // namespace

bool cpu_has_avx512_vbmi() {
#if defined(ENGINE_X86_64) && (defined(__GNUC__) || defined(__clang__))
  static const bool has = [] {
    __builtin_cpu_init();
    return cpu_has(Isa::Avx512) && __builtin_cpu_supports("avx512vbmi");
  }();
  return has;
#else
  return false;
#endif
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Avx512: return "avx512";
    case Isa::Avx2: return "avx2";
    default: return "baseline";
  }
}

Isa parse_isa(const std::string& name) {
  for (Isa isa : {Isa::Baseline, Isa::Avx2, Isa::Avx512}) {
    if (name == isa_name(isa)) return isa;
  }
  TORCH_CHECK_VALUE(false, "isa: expected 'baseline', 'avx2' or 'avx512', got '", name, "'");
  return Isa::Baseline;
}

Isa detected_isa() {
  static const Isa found = [] {
    Isa best = Isa::Baseline;
    for (Isa isa : {Isa::Avx2, Isa::Avx512}) {
      if (static_cast<int>(isa) <= static_cast<int>(kTopIsa) && cpu_has(isa)) best = isa;
    }
    return best;
  }();
  return found;
}

std::vector<std::string> available_isas() {
  std::vector<std::string> out;
  for (int i = 0; i <= static_cast<int>(detected_isa()); ++i) out.emplace_back(isa_name(static_cast<Isa>(i)));
  return out;
}

Isa active_isa() {
  const int chosen = g_active.load(std::memory_order_relaxed);
  return chosen < 0 ? detected_isa() : static_cast<Isa>(chosen);
}

void set_active_isa(const std::string& name) {
  if (name == "auto") {
    g_active = -1;
    return;
  }
  const Isa isa = parse_isa(name);
  TORCH_CHECK_VALUE(static_cast<int>(isa) <= static_cast<int>(detected_isa()), "isa: this CPU (or build) has no ",
                    name, " kernels; it runs ", isa_name(detected_isa()), " and below");
  g_active = static_cast<int>(isa);
}

}  // namespace engine_native
