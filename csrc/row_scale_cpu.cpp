// Reduction weights and value validation of targets/segments in one serial pass over R ints (CPU).
//   mode 0: no weights (validation only); 1: s_i = 1 / #valid rows; 2: s_i = 1 / #valid rows of segment(i).
// Returns (s [R] fp32, or None for mode 0; flags: bit 0 = a target outside [0, C) that is not
// ignore_index, bit 1 = segments not sorted / out of [0, limit)). Replaces ~15 small tensor ops per call.
#include <vector>

#include "fedfast_cpu.h"

namespace fedfast {

FEDFAST_ROW_SCALE(row_scale_cpu) {
  TORCH_CHECK(!status.has_value(), "row_scale_cpu: the CPU pass returns its flags; status is a GPU's");
  const at::Tensor target = target_in.contiguous();
  c10::optional<at::Tensor> segments;
  if (segments_in.has_value()) segments = segments_in->contiguous();
  const int64_t R = target.size(0);
  int64_t flags = 0;
  std::vector<int64_t> seg_ids;
  if (segments.has_value()) {
    seg_ids.resize(R);
    int64_t prev = 0;
    for (int64_t i = 0; i < R; ++i) {
      const at::Tensor& s = *segments;
      const int64_t v = s.scalar_type() == at::kLong ? s.data_ptr<int64_t>()[i]
                                                     : static_cast<int64_t>(s.data_ptr<int32_t>()[i]);
      if (v < 0 || v >= limit || (i > 0 && v < prev)) flags |= 2;
      prev = v;
      seg_ids[i] = v < 0 ? 0 : (v >= R ? R - 1 : v);
    }
  }
  std::vector<char> valid(R);
  int64_t n_valid = 0;
  for (int64_t i = 0; i < R; ++i) {
    const int64_t y = target.scalar_type() == at::kLong ? target.data_ptr<int64_t>()[i]
                                                        : static_cast<int64_t>(target.data_ptr<int32_t>()[i]);
    const bool ok = y != ignore_index && y >= 0 && y < C;
    if (!ok && y != ignore_index) flags |= 1;
    valid[i] = ok;
    n_valid += ok;
  }
  if (mode == 0) return {c10::nullopt, flags};
  auto scale = at::empty({R}, target.options().dtype(at::kFloat));
  float* sp = scale.data_ptr<float>();
  if (mode == 1 || !segments.has_value()) {
    const float s = 1.0f / static_cast<float>(n_valid > 0 ? n_valid : 1);
    for (int64_t i = 0; i < R; ++i) sp[i] = s;
  } else {
    std::vector<int64_t> counts(R > 0 ? R : 1, 0);
    for (int64_t i = 0; i < R; ++i) counts[seg_ids[i]] += valid[i];
    for (int64_t i = 0; i < R; ++i) {
      const int64_t n = counts[seg_ids[i]];
      sp[i] = 1.0f / static_cast<float>(n > 0 ? n : 1);
    }
  }
  return {scale, flags};
}

}  // namespace fedfast
