// CPU kernels of fedfast (one op per .cpp); bound to Python in bindings.cpp.
#pragma once
#include <ATen/ATen.h>

#include <tuple>
#include <vector>

namespace fedfast {

std::tuple<at::Tensor, at::Tensor> distill_rows_cpu(
    const at::Tensor& student, const at::Tensor& teacher, const at::Tensor& target,
    const c10::optional<at::Tensor>& teacher_negent, const c10::optional<at::Tensor>& class_alpha,
    const c10::optional<at::Tensor>& row_weight, const c10::optional<at::Tensor>& rho,
    const c10::optional<at::Tensor>& segments, const c10::optional<at::Tensor>& row_scale, double tau,
    double ce_weight, double kd_weight, int64_t ignore_index, bool not_true, bool soft_ce);

std::tuple<at::Tensor, at::Tensor> teacher_mixture_cpu(const at::Tensor& teachers, const at::Tensor& weights,
                                                       const at::Tensor& target, double tau, bool not_true,
                                                       int64_t ignore_index);

at::Tensor asd_weights_cpu(const at::Tensor& teacher, const at::Tensor& target, const at::Tensor& class_prior,
                           const c10::optional<at::Tensor>& segments, double entropy_tau, int64_t ignore_index);

std::tuple<at::Tensor, int64_t> row_scale_cpu(const at::Tensor& target, const c10::optional<at::Tensor>& segments,
                                              int64_t C, int64_t ignore_index, int64_t mode, int64_t limit);

std::vector<at::Tensor> aggregate_cpu(const at::Tensor& X, const at::Tensor& rows, const at::Tensor& g,
                                      const at::Tensor& w, double beta, double scale, double lr,
                                      const c10::optional<at::Tensor>& momentum,
                                      const c10::optional<at::Tensor>& dyn_h,
                                      const c10::optional<at::Tensor>& dyn_hbar, double dyn_K,
                                      const c10::optional<at::Tensor>& scaffold_c,
                                      const c10::optional<at::Tensor>& scaffold_ck,
                                      const c10::optional<at::Tensor>& scaffold_coef, double sc_K,
                                      const c10::optional<at::Tensor>& teacher_buffer, int64_t slot,
                                      int64_t count);

void client_step_cpu(at::Tensor& theta, const std::vector<at::Tensor>& grad, const at::Tensor& lr, double momentum,
                     const c10::optional<at::Tensor>& buf, const at::Tensor& wd, double prox_mu,
                     const c10::optional<at::Tensor>& anchor, const c10::optional<at::Tensor>& dyn_linear,
                     const c10::optional<at::Tensor>& scaffold_c, const c10::optional<at::Tensor>& scaffold_ck,
                     const c10::optional<at::Tensor>& drift, const c10::optional<at::Tensor>& drift_scale, double max_norm,
                     const c10::optional<at::Tensor>& active);

// Helpers shared by the ops.
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

}  // namespace fedfast
