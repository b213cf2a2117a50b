// The standard headers the kernel sources use, included by isa_begin.h BEFORE any target option:
// inline functions of the standard library then keep the baseline instruction set, so the copies
// the variants' objects share (the linker keeps one) run on every CPU.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
