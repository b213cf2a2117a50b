// Closes what isa_begin.h opened.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#if defined(__x86_64__) || defined(_M_X64)
#if ENGINE_ISA_LEVEL == 1 || ENGINE_ISA_LEVEL == 2
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif
#endif
