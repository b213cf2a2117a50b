// Delayed scaling's update of an amax history and its scales (engine/recipes/delayed.py), on raw
// memory, on the calling thread. bindings.cpp checks the tensors and calls it.
#pragma once

#include <cstdint>

namespace engine_native {

constexpr float kNotRecorded = -1.0f;  // engine.quantizers.rules.NOT_RECORDED

// In place, for an amax history [L, n] (row-major, contiguous) and scales [n]:
//   row 0: NaN and +-inf become +0;
//   amax[j] = most_recent ? row 0 : the max over the rows (torch.max(dim=0): the first NaN wins);
//   scale[j] = (fp8_max / amax) * 2^-margin (fp32 division, then an exact multiply) where amax is
//              finite and > 0, else the old scale; then values above FLT_MAX become FLT_MAX;
//   history rolled up by one row (row i <- row i + 1, the last row <- row 0), then row 0 = -1
//   (NOT_RECORDED: nothing recorded yet in the next step).
// Held columns keep their scale and their (cleaned) history: those with held[j] != 0 (held may be
// nullptr) and those whose row 0 is below 0 (NOT_RECORDED: nothing recorded since the last update).
void delayed_update(float* history, int64_t rows, int64_t cols, float* scale, float fp8_max, int margin,
                    bool most_recent, const uint8_t* held);

}  // namespace engine_native
