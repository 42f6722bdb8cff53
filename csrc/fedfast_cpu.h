// CPU kernels of fedfast (one op per .cpp); bound to Python in bindings.cpp.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>

#include <tuple>
#include <vector>

#include "op_signatures.h"
#include "row_math.h"

namespace fedfast {

FEDFAST_DISTILL_ROWS(distill_rows_cpu);

FEDFAST_TEACHER_MIXTURE(teacher_mixture_cpu);

FEDFAST_ASD_WEIGHTS(asd_weights_cpu);
FEDFAST_ASD_ROW_WEIGHT(asd_row_weight_cpu);

FEDFAST_ROW_SCALE(row_scale_cpu);

FEDFAST_AGGREGATE(aggregate_cpu);

FEDFAST_UPDATE_NORMS(update_norms_cpu);

FEDFAST_CLIENT_STEP(client_step_cpu);

FEDFAST_CLIENT_ADAM(client_adam_cpu);

// Helpers shared by the ops.

// A block of <= block columns [c0, c0 + len) of one gradient piece: row k's values start at g + k * ld.
struct GradBlock {
  int64_t c0, len;
  const float* g;
  int64_t ld;
};

// The column blocks of a gradient given as one [n, P] tensor or as per-parameter pieces [n, s_p] (sum s_p = P,
// in column order), read in place; `keep` holds the fp32 contiguous pieces the blocks point into.
inline std::vector<GradBlock> grad_blocks(const std::vector<at::Tensor>& grad_in, int64_t n, int64_t P,
                                          int64_t block, std::vector<at::Tensor>& keep) {
  std::vector<GradBlock> blocks;
  int64_t col = 0;
  for (const at::Tensor& gi : grad_in) {
    TORCH_CHECK(gi.dim() >= 1 && gi.size(0) == n, "grad: every piece must have n rows");
    keep.push_back(gi.to(at::kFloat).contiguous());
    const int64_t s = n ? keep.back().numel() / n : 0;
    const float* base = keep.back().data_ptr<float>();
    for (int64_t j = 0; j < s; j += block) blocks.push_back({col + j, std::min(block, s - j), base + j, s});
    col += s;
  }
  TORCH_CHECK(col == P, "grad: the pieces have ", col, " columns, theta has ", P);
  return blocks;
}

// Row k's loss gradient over block bl into out: g + mu (theta - anchor) [+ L_k] (proximal term, loss rows).
inline void loss_grad_into(const GradBlock& bl, int64_t k, int64_t P, const float* th, float mu, const float* an,
                           const float* dy, float* out) {
  const float* g = bl.g + k * bl.ld;
  const float* t = th + k * P + bl.c0;
  for (int64_t j = 0; j < bl.len; ++j) out[j] = g[j];
  if (mu != 0.f)
    for (int64_t j = 0; j < bl.len; ++j) out[j] += mu * (t[j] - an[bl.c0 + j]);
  if (dy) {
    const float* d = dy + k * P + bl.c0;
    for (int64_t j = 0; j < bl.len; ++j) out[j] += d[j];
  }
}

// The same values, read in place when there are no terms (no copy), else summed into tmp.
inline const float* loss_grad_view(const GradBlock& bl, int64_t k, int64_t P, const float* th, float mu,
                                   const float* an, const float* dy, float* tmp) {
  if (mu == 0.f && !dy) return bl.g + k * bl.ld;
  loss_grad_into(bl, k, P, th, mu, an, dy, tmp);
  return tmp;
}

// The client steps' delta_norm [n] (out) with delta_from [P]: each (row, column block) task adds up its block's
// (theta' - from)^2 (sq_dist) right after it updated the block (still in L1) into its own slot, so threads never
// share a sum and the result does not depend on the schedule; finish() writes the active rows' norms.
class DeltaNorms {
 public:
  DeltaNorms(const c10::optional<at::Tensor>& from, const c10::optional<at::Tensor>& out, int64_t n, int64_t P,
             int64_t nb)
      : nb_(nb) {
    TORCH_CHECK(from.has_value() == out.has_value(), "delta_from and delta_norm must be given together");
    if (!out.has_value()) return;
    from_t_ = from->to(at::kFloat).contiguous();
    TORCH_CHECK(from_t_.numel() == P, "delta_from must have one value per column");
    TORCH_CHECK(out->is_contiguous() && out->scalar_type() == at::kFloat && out->numel() == n,
                "delta_norm must be a contiguous fp32 tensor with one value per row");
    from_ = from_t_.data_ptr<float>();
    out_ = out->data_ptr<float>();
    part_.assign(static_cast<size_t>(n * nb), 0.0);
  }
  // task t = k * nb + b wrote row k's columns [c0, c0 + len) at tr
  void block(int64_t t, const float* tr, int64_t c0, int64_t len) {
    if (out_) part_[t] = sq_dist<float>(tr, from_ + c0, len);
  }
  void finish(int64_t n, const bool* act) const {
    if (!out_) return;
    for (int64_t k = 0; k < n; ++k) {
      if (act && !act[k]) continue;
      double s = 0.0;
      for (int64_t b = 0; b < nb_; ++b) s += part_[k * nb_ + b];
      out_[k] = static_cast<float>(std::sqrt(s));
    }
  }

 private:
  int64_t nb_;
  at::Tensor from_t_;
  const float* from_ = nullptr;
  float* out_ = nullptr;
  std::vector<double> part_;
};

// Squared L2 norm of len floats in 8 lanes (vectorised; a serial sum is not).
inline float sum_squares(const float* v, int64_t len) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t j = 0;
  for (; j + 8 <= len; j += 8)
    for (int l = 0; l < 8; ++l) acc[l] += v[j + l] * v[j + l];
  for (; j < len; ++j) acc[0] += v[j] * v[j];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}
inline int64_t row_target(const at::Tensor& target, int64_t i, int64_t C, int64_t ignore_index) {
  int64_t y = target.scalar_type() == at::kLong ? target.data_ptr<int64_t>()[i]
                                                : static_cast<int64_t>(target.data_ptr<int32_t>()[i]);
  return (y == ignore_index || y < 0 || y >= C) ? -1 : y;
}
inline int64_t row_segment(const c10::optional<at::Tensor>& segments, int64_t i, int64_t S) {
  if (!segments.has_value() || S <= 1) return 0;
  const at::Tensor& s = *segments;
  int64_t v = s.scalar_type() == at::kLong ? s.data_ptr<int64_t>()[i]
                                           : static_cast<int64_t>(s.data_ptr<int32_t>()[i]);
  return v < 0 ? 0 : (v >= S ? S - 1 : v);
}

// A row kernel's accumulation type: body(A()) with A = double for fp64 inputs (f64), else float (fp32, bf16 and fp16
// inputs all accumulate in fp32).
template <class F>
inline void with_acc(bool f64, F&& body) {
  if (f64) body(double(0)); else body(float(0));
}

// A row kernel over one logits tensor: body(T(), A()) with T its scalar type (fp32, fp64, bf16 or fp16) and A the
// accumulation type (with_acc). asd_weights_cpu.cpp and teacher_mixture_cpu.cpp dispatch through it (another dtype:
// "fedfast row kernel" not implemented for it; fedfast/ops checks the dtypes before any call).
template <class F>
inline void dispatch_logits(const at::Tensor& logits, F&& body) {
  const bool f64 = logits.scalar_type() == at::kDouble;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "fedfast row kernel", [&] {
    with_acc(f64, [&](auto zero) { body(scalar_t(0), zero); });
  });
}

// Per-row clip factors min(1, max_norm / (||g_k|| + 1e-6)) (torch.nn.utils.clip_grad_norm_), all 1 without
// clipping. value(k, block, tmp) returns a pointer to row k's loss-side gradient over the block (the gradient
// itself, or the block summed into tmp [block floats]). Partial sums per (row, block) in fp32, the row's in fp64.
template <class F>
std::vector<float> clip_factors(int64_t n, const std::vector<GradBlock>& blocks, double max_norm, int64_t block,
                                F value) {
  std::vector<float> clip(n, 1.f);
  if (!(max_norm > 0)) return clip;
  const int64_t nb = static_cast<int64_t>(blocks.size());
  std::vector<double> part(n * nb, 0.0);
  at::parallel_for(0, n * nb, 1, [&](int64_t b, int64_t e) {
    std::vector<float> tmp(block);
    for (int64_t t = b; t < e; ++t) {
      const GradBlock& bl = blocks[t % nb];
      part[t] = sum_squares(value(t / nb, bl, tmp.data()), bl.len);
    }
  });
  for (int64_t k = 0; k < n; ++k) {
    double s = 0;
    for (int64_t b = 0; b < nb; ++b) s += part[k * nb + b];
    const double coef = max_norm / (std::sqrt(s) + 1e-6);
    clip[k] = coef < 1.0 ? static_cast<float>(coef) : 1.f;
  }
  return clip;
}

}  // namespace fedfast
