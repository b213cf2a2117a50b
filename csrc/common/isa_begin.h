// Opens one instruction-set variant of a kernel source: the generated wrapper of a `*_kernels.cpp`
// defines ENGINE_ISA_NS (the variant's namespace: baseline, avx2, avx512) and ENGINE_ISA_LEVEL (0, 1, 2),
// includes this, the source, then isa_end.h. The target options apply to everything in between;
// every function there must live in engine_native::ENGINE_ISA_NS (or an anonymous namespace), so
// no two variants share a symbol.
#include "common/prelude.h"

#ifndef ENGINE_ISA_NS
#error "ENGINE_ISA_NS is defined by the generated wrapper of a *_kernels.cpp (engine/ops/native_build.py)"
#endif

#if defined(__x86_64__) || defined(_M_X64)
#if ENGINE_ISA_LEVEL == 1
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,bmi,bmi2,lzcnt,movbe,popcnt"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v3")
#endif
#elif ENGINE_ISA_LEVEL == 2
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512cd,avx512dq,avx512vl,avx2,fma,f16c,bmi,bmi2,lzcnt,movbe,popcnt"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4,prefer-vector-width=512")
#endif
#endif
#endif

// Vector arguments wider than the baseline's registers: the variants never pass them across files.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
