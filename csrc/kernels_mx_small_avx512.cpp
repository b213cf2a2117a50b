// The MXFP4 / MXFP6 kernels of mx_small_kernels.h compiled for AVX-512 (F, BW, DQ, VL) by the target
// pragma below, whatever flags the build uses; called only after a CPUID check (kernels_mx_small.cpp).
#include <cstdint>

#include "mx_small.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,prefer-vector-width=512")
#endif

#define MX_SMALL_NAMESPACE mx_small_avx512
#include "mx_small_kernels.h"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace engine_native {
namespace mx_small_avx512 {
bool compiled() { return true; }  // outside the target pragma: callable on any CPU
}  // namespace mx_small_avx512
}  // namespace engine_native

#else  // no AVX-512 build on this compiler / architecture

namespace engine_native {
namespace mx_small_avx512 {
bool compiled() { return false; }
void mx_small_tiles(const MxSmallJob&, int64_t, int64_t) {}
}  // namespace mx_small_avx512
}  // namespace engine_native

#endif
