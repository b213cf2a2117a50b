// The NVFP4 kernels of nvfp4_kernels.h compiled for AVX-512 (F, BW, DQ, VL) by the target
// pragma below, whatever flags the build uses; called only after a CPUID check (kernels_nvfp4.cpp).
#include <cstdint>

#include "nvfp4.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,prefer-vector-width=512")
#endif

#define NVFP4_NAMESPACE nvfp4_avx512
#include "nvfp4_kernels.h"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace engine_native {
namespace nvfp4_avx512 {
bool compiled() { return true; }  // outside the target pragma: callable on any CPU
}  // namespace nvfp4_avx512
}  // namespace engine_native

#else  // no AVX-512 build on this compiler / architecture

namespace engine_native {
namespace nvfp4_avx512 {
bool compiled() { return false; }
void nvfp4_amax_tiles(const Nvfp4Job&, int64_t, int64_t, uint32_t*, uint32_t*) {}
void nvfp4_quantize_tiles(const Nvfp4Job&, int64_t, int64_t) {}
}  // namespace nvfp4_avx512
}  // namespace engine_native

#endif
