// Instruction-set levels and the one place that picks a kernel variant for them.
//
// Every `*_kernels.cpp` is compiled once per level (see isa_begin.h) into the namespace
// engine_native::<level>; an op's header declares the table of function pointers each variant
// exports with ENGINE_ISA_VARIANTS, and the glue asks for `getter(active_isa())`.
//   baseline  any CPU of the architecture (x86-64: SSE2; aarch64: NEON)
//   avx2      x86-64-v3: AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE
//   avx512    x86-64-v4: AVX-512 F, BW, CD, DQ, VL
// The level in use is the highest the CPU has (CPUID, read once), unless set_active_isa lowers it
// (ENGINE_ISA, tests).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace engine_native {

enum class Isa : int { Baseline = 0, Avx2 = 1, Avx512 = 2 };

#if defined(__x86_64__) || defined(_M_X64)
#define ENGINE_X86_64 1
constexpr Isa kTopIsa = Isa::Avx512;  // the highest level this build has variants for
#else
constexpr Isa kTopIsa = Isa::Baseline;
#endif

const char* isa_name(Isa isa);
// The level named `name` ("baseline", "avx2", "avx512"); a ValueError (c10::ValueError) for another name.
Isa parse_isa(const std::string& name);
// The highest level this CPU runs and this build has.
Isa detected_isa();
// Every level up to detected_isa(), lowest first.
std::vector<std::string> available_isas();
// The level the kernels run at: detected_isa() unless set_active_isa chose a lower one.
Isa active_isa();
// AVX-512 VBMI (vpermb / vpermt2b), which the hand-written AVX-512 FP8 kernels need beyond x86-64-v4.
bool cpu_has_avx512_vbmi();
// "auto" (back to detected_isa()) or a level the CPU has; a ValueError otherwise.
void set_active_isa(const std::string& name);

}  // namespace engine_native

// Declares `const Table& getter()` in every variant namespace of this build and the dispatcher
// `const Table& getter(Isa)` in engine_native, which returns the variant of that level (levels this
// build has no variant for fall back to the next lower one: none on x86-64, all on other machines).
#ifdef ENGINE_X86_64
#define ENGINE_ISA_VARIANTS(Table, getter)                       \
  namespace baseline { const Table& getter(); }                  \
  namespace avx2 { const Table& getter(); }                      \
  namespace avx512 { const Table& getter(); }                    \
  inline const Table& getter(Isa isa) {                          \
    switch (isa) {                                               \
      case Isa::Avx512: return avx512::getter();                 \
      case Isa::Avx2: return avx2::getter();                     \
      default: return baseline::getter();                        \
    }                                                            \
  }
#else
#define ENGINE_ISA_VARIANTS(Table, getter)                       \
  namespace baseline { const Table& getter(); }                  \
  inline const Table& getter(Isa) { return baseline::getter(); }
#endif
