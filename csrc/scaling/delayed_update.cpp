// Delayed scaling's update (see delayed_update.h), bit for bit the torch ops of
// DelayedScalingState.update in engine/recipes/delayed.py for the built-in algorithms.
#include "scaling/delayed_update.h"

#include <cstring>
#include <vector>

#include "common/fp8_scalar.h"

namespace engine_native {

namespace {

constexpr float kFltMax = 3.4028234663852886e38f;

bool is_finite_f32(float f) { return (f32_bits(f) & 0x7F800000u) != 0x7F800000u; }

// torch.max(dim=0) of each column: start at row 0, take a value that is not <= the running
// max, and stop at the first NaN (whose bits are kept as they are).
void column_max_in_order(const float* h, int64_t rows, int64_t cols, float* out) {
  for (int64_t j = 0; j < cols; ++j) {
    float m = h[j];
    for (int64_t i = 0; i < rows; ++i) {
      const float v = h[i * cols + j];
      if (!(v <= m)) {
        m = v;
        if (is_nan_f32(v)) break;
      }
    }
    out[j] = m;
  }
}

// The same without NaN in the history: then the order of the rows only decides between +0
// and -0 (the first zero wins when the max is zero), so blocks of 16 rows are reduced
// element-wise (a loop the compiler vectorizes) and zeros are settled afterwards.
void column_max_no_nan(const float* h, int64_t rows, int64_t cols, float* out) {
  constexpr int64_t kRows = 16;
  const int64_t blocks = rows / kRows, width = kRows * cols;
  for (int64_t j = 0; j < cols; ++j) out[j] = h[j];
  if (blocks > 0) {
    std::vector<float> acc(h, h + width);
    for (int64_t b = 1; b < blocks; ++b) {
      const float* block = h + b * width;
      for (int64_t k = 0; k < width; ++k) acc[k] = block[k] > acc[k] ? block[k] : acc[k];
    }
    for (int64_t k = 0; k < width; ++k) {
      float& m = out[k % cols];
      m = acc[k] > m ? acc[k] : m;
    }
  }
  for (int64_t i = blocks * kRows; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) out[j] = h[i * cols + j] > out[j] ? h[i * cols + j] : out[j];
  }
  for (int64_t j = 0; j < cols; ++j) {
    if (out[j] != 0.0f) continue;
    for (int64_t i = 0; i < rows; ++i) {
      if (h[i * cols + j] == 0.0f) {
        out[j] = h[i * cols + j];
        break;
      }
    }
  }
}

bool has_nan(const float* h, int64_t count) {
  uint32_t largest = 0;
  for (int64_t k = 0; k < count; ++k) {
    const uint32_t magnitude = f32_bits(h[k]) & 0x7FFFFFFFu;
    largest = magnitude > largest ? magnitude : largest;
  }
  return largest > 0x7F800000u;
}

}  // namespace

void delayed_update(float* h, int64_t rows, int64_t cols, float* scale, float fp8_max, int margin,
                    bool most_recent, const uint8_t* held_in) {
  // held: asked for, or nothing recorded since the last update (row 0 still NOT_RECORDED, below every amax)
  std::vector<uint8_t> held(static_cast<size_t>(cols));
  bool any_held = false;
  for (int64_t j = 0; j < cols; ++j) {
    held[static_cast<size_t>(j)] = (held_in && held_in[j]) || h[j] < 0.0f;  // NaN < 0 is false: a NaN batch ran
    any_held = any_held || held[static_cast<size_t>(j)];
  }
  // torch.nan_to_num_(history[0], nan=0, posinf=0, neginf=0): every column, held ones too
  for (int64_t j = 0; j < cols; ++j) {
    if (!is_finite_f32(h[j])) h[j] = 0.0f;
  }
  std::vector<float> amaxes(static_cast<size_t>(cols));
  if (most_recent) {
    std::memcpy(amaxes.data(), h, static_cast<size_t>(cols) * sizeof(float));
  } else {
    if (has_nan(h, rows * cols)) {
      column_max_in_order(h, rows, cols, amaxes.data());
    } else {
      column_max_no_nan(h, rows, cols, amaxes.data());
    }
  }
  const float multiplier = bits_f32(static_cast<uint32_t>(127 - margin) << 23);  // 2^-margin, margin in [0, 126]
  for (int64_t j = 0; j < cols; ++j) {
    if (held[static_cast<size_t>(j)]) continue;
    const float amax = amaxes[static_cast<size_t>(j)];
    float s = fp8_max / amax;  // a true fp32 division
    if (margin) s = s * multiplier;
    if (!(is_finite_f32(amax) && amax > 0.0f)) s = scale[j];
    if (s > kFltMax) s = kFltMax;  // clamp_max(FLT_MAX): inf -> FLT_MAX, NaN kept
    scale[j] = s;
  }
  // roll(-1) then row 0 = NOT_RECORDED: row i <- row i + 1 for 1 <= i < rows - 1, last row <- row 0
  if (rows > 1) {
    if (!any_held) {  // whole rows: rows 2.. move up one, then row 0 goes last (row 0 is not moved)
      std::memmove(h + cols, h + 2 * cols, static_cast<size_t>((rows - 2) * cols) * sizeof(float));
      std::memcpy(h + (rows - 1) * cols, h, static_cast<size_t>(cols) * sizeof(float));
    } else {
      for (int64_t j = 0; j < cols; ++j) {
        if (held[static_cast<size_t>(j)]) continue;
        const float row0 = h[j];
        for (int64_t i = 1; i + 1 < rows; ++i) h[i * cols + j] = h[(i + 1) * cols + j];
        h[(rows - 1) * cols + j] = row0;
      }
    }
  }
  for (int64_t j = 0; j < cols; ++j) {
    if (!held[static_cast<size_t>(j)]) h[j] = kNotRecorded;
  }
}

}  // namespace engine_native
