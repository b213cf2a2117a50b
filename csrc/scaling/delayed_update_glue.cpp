// Torch glue of delayed scaling's update (scaling/delayed_update.h).
#include "common/glue.h"

#include <cmath>
#include <cstring>
#include <string>
#include <tuple>

#include "scaling/delayed_update.h"
#include "scaling/delayed_update_glue.h"

namespace engine_native {
namespace delayed_update_glue {

using namespace glue;

// ----------------------------------------------------------------- delayed scaling update
void delayed_update_op(const Tensor& history, const Tensor& scale, double fp8_max, int64_t margin, bool most_recent,
                       const std::vector<int64_t>& held) {
  NoPythonDispatch no_python;
  check_plain(history, "amax_history");
  check_plain(scale, "scale");
  TORCH_CHECK_TYPE(history.scalar_type() == at::kFloat, "amax_history: expected dtype float32, got ",
                   history.scalar_type());
  TORCH_CHECK_TYPE(scale.scalar_type() == at::kFloat, "scale: expected dtype float32, got ", scale.scalar_type());
  TORCH_CHECK_VALUE(history.dim() == 2 && history.size(0) >= 1, "amax_history: expected shape [rows >= 1, n], got ",
                    history.sizes());
  const int64_t rows = history.size(0), n = history.size(1);
  TORCH_CHECK_VALUE(scale.dim() == 1 && scale.size(0) == n, "scale: expected shape [", n,
                    "] (one per amax_history column), got ", scale.sizes());
  TORCH_CHECK_VALUE(history.is_contiguous() && scale.is_contiguous(), "amax_history and scale must be contiguous");
  TORCH_CHECK_VALUE(margin >= 0 && margin <= 126, "margin: expected 0..126, got ", margin);
  check_disjoint(scale, "scale", history, "amax_history");
  std::vector<uint8_t> mask;
  if (!held.empty()) {
    mask.assign(static_cast<size_t>(n), 0);
    for (int64_t j : held) {
      TORCH_CHECK_VALUE(j >= 0 && j < n, "held: slot ", j, " out of range for ", n, " slots");
      mask[static_cast<size_t>(j)] = 1;
    }
  }
  DefaultFpEnv env;
  delayed_update(history.data_ptr<float>(), rows, n, scale.data_ptr<float>(), static_cast<float>(fp8_max),
                 static_cast<int>(margin), most_recent, mask.empty() ? nullptr : mask.data());
}

}  // namespace delayed_update_glue
}  // namespace engine_native
