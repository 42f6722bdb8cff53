// One C++ signature per op, declared once. The CPU kernels (fedfast_cpu.h, *_cpu.cpp) and the CUDA extension's
// torch-side launchers (bindings_cuda.cpp) define an op as `FEDFAST_<OP>(name) { ... }`, with these parameter
// names; fedfast/ops/<op>.py passes the arguments in this order to every compiled backend (Triton included).
// The terms are generic (formulas: fedfast/ops/<op>_reference.py); no method's name appears below
// fedfast/methods/.
#pragma once
#include <ATen/ATen.h>

#include <vector>

// Fused server update: the weighted average of the participating rows, m' = beta m + scale (g - avg),
// g' = g - lr m'; state rows R_k' = (R_k + shift) + a_k (X_k - g) with the column sum of their changes; a ring
// buffer write. Returns {global, average, momentum, state_rows, state_change, ring, ring_mean, bad [n + 1]}.
#define FEDFAST_AGGREGATE(name)                                                                                   \
  std::vector<at::Tensor> name(const at::Tensor& X_in, const at::Tensor& rows_in, const at::Tensor& g_in,         \
                               const at::Tensor& w_in, double beta, double scale, double lr,                      \
                               const c10::optional<at::Tensor>& momentum,                                         \
                               const c10::optional<at::Tensor>& state_rows,                                       \
                               const c10::optional<at::Tensor>& state_coef,                                       \
                               const c10::optional<at::Tensor>& state_shift,                                      \
                               const c10::optional<at::Tensor>& ring_in, int64_t slot, int64_t count,          \
                               const c10::optional<at::Tensor>& avg_shift)

// Fused CE + distillation rows: per row i the loss L_i = a_i CE(z_i, y_i) + b_i D_i, D_i the KL divergence of the
// student's softmax(z_i / tau) from the teacher's (all classes or the not-true ones; soft_ce: the cross-entropy),
// and dL/dz, in one pass (a_i, b_i from the weights, class_alpha, row weights, row_scale; FedADC+'s rho: the
// formulas in fedfast/ops/distill_reference.py). teacher: logits
// [R, C], or with teacher_negent [R] the teacher's probabilities [R, C] and their sum p log p, or with mix_weights
// [M] M teachers' logits [M, R, C] mixed row by row (FedGKD-VOTE). class_prior [C] or [S, C] (with entropy_tau):
// ASD's KD row weights computed from the teacher in the same call (instead of row_weight). row_scale [R]: the
// reduction's weights. in_place: dL/dz written over the (contiguous) student. Returns {loss [R], dL/dz [R, C],
// status}: status is ASD's prior check (0: the prior holds every target class).
#define FEDFAST_DISTILL_ROWS(name)                                                                                \
  std::tuple<at::Tensor, at::Tensor, int64_t> name(                                                               \
      const at::Tensor& student, const at::Tensor& teacher, const at::Tensor& target,                             \
      const c10::optional<at::Tensor>& teacher_negent, const c10::optional<at::Tensor>& mix_weights,              \
      const c10::optional<at::Tensor>& class_alpha, const c10::optional<at::Tensor>& row_weight,                  \
      const c10::optional<at::Tensor>& class_prior, double entropy_tau, const c10::optional<at::Tensor>& rho,     \
      const c10::optional<at::Tensor>& segments, const c10::optional<at::Tensor>& row_scale, double tau,          \
      double ce_weight, double kd_weight, int64_t ignore_index, bool not_true, bool soft_ce, bool in_place)

// FedGKD-VOTE's teacher mixture: for M teachers' logits [M, R, C] and weights [M], P_i = sum_m w_m
// softmax(t_mi / tau) (over the not-true classes with not_true) and negent_i = sum_m w_m sum_c p log p. Returns
// {P [R, C], negent [R]}.
#define FEDFAST_TEACHER_MIXTURE(name)                                                                             \
  std::tuple<at::Tensor, at::Tensor> name(const at::Tensor& teachers_in, const at::Tensor& weights,               \
                                          const at::Tensor& target_in, double tau, bool not_true,                 \
                                          int64_t ignore_index)

// ASD's per-row weights alphahat_i = exp(-H(softmax(t_i / entropy_tau))) / class_prior[s_i, y_i] (class_prior [C]
// or [S, C], by the row's segment). Returns alphahat [R] (0 on ignored rows).
#define FEDFAST_ASD_WEIGHTS(name)                                                                                 \
  at::Tensor name(const at::Tensor& teacher_in, const at::Tensor& target_in, const at::Tensor& class_prior,      \
                  const c10::optional<at::Tensor>& segments_in, double entropy_tau, int64_t ignore_index)

// ASD's KD row weights: asd_weights' alphahat normalised to sum 1 within each segment, times the segment's
// valid rows (n_s alpha_i), with the prior's checks. Returns {weights [R], flags}: bit 0 the prior has a negative
// or non-finite entry or is not > 0 at a valid row's (segment, target); bit 1 a target outside [0, C) that is not
// ignore_index; bit 2 segments unsorted or outside [0, R).
#define FEDFAST_ASD_ROW_WEIGHT(name)                                                                              \
  std::tuple<at::Tensor, int64_t> name(const at::Tensor& teacher_in, const at::Tensor& target_in,                 \
                                       const at::Tensor& class_prior,                                             \
                                       const c10::optional<at::Tensor>& segments_in, double entropy_tau,          \
                                       int64_t ignore_index)

// The distillation op's backward: grad_loss_in[:, None] * grad_in in fp32, stored in grad_in's dtype.
#define FEDFAST_SCALE_ROWS(name) at::Tensor name(const at::Tensor& grad_in, const at::Tensor& grad_loss_in)

// Each row's reduction weight and the checks of the targets and segments, in one pass: mode 0 no weights (checks
// only), 1 one mean over the valid rows (1/n), 2 one mean per segment (1/n_s; sorted client ids < limit). status:
// a GPU's int32 flags [>= 2] the launch ORs its findings into (deferred checks, no host sync; the CPU pass takes
// none and returns them). Flags: bit 0 a target outside [0, C) that is not ignore_index, bit 1 segments unsorted or
// out of range. Returns {row_scale [R] fp32 (None for mode 0), the flags found on the host (0 on a GPU)}.
#define FEDFAST_ROW_SCALE(name)                                                                                   \
  std::tuple<c10::optional<at::Tensor>, int64_t> name(const at::Tensor& target_in,                                \
                                                      const c10::optional<at::Tensor>& segments_in, int64_t C,    \
                                                      int64_t ignore_index, int64_t mode, int64_t limit,          \
                                                      const c10::optional<at::Tensor>& status)

// The update norms ||X_k - g|| [n] fp32 of the rows rows_in [n] of X_in [N, P] (fp32, bf16 or fp16) from g_in [P],
// squares summed in double (DP-FedAvg's clipping when the last local steps did not measure them).
#define FEDFAST_UPDATE_NORMS(name) \
  at::Tensor name(const at::Tensor& X_in, const at::Tensor& rows_in, const at::Tensor& g_in)

// Fused all-client optimizer step, in place: theta [n, P] and the momentum buffer. grad_in: one [n, P] tensor or
// the per-parameter pieces [n, *shape] in column order. Generic terms: prox_mu with anchor [P], loss_rows [n, P]
// (clipped with the gradient), corr_vec [P] x corr_vec_scale [n] + corr_rows_coef x corr_rows [n, P] (inside
// momentum), step_vec [P] x step_vec_scale [n] (outside momentum); max_norm <= 0: no clipping. delta_norm [n] fp32
// (out, with delta_from [P]): each active row's ||theta'_k - delta_from|| from the step's own pass over the row.
#define FEDFAST_CLIENT_STEP(name)                                                                                 \
  void name(at::Tensor& theta, const std::vector<at::Tensor>& grad_in, const at::Tensor& lr_in, double momentum,  \
            const c10::optional<at::Tensor>& buf_opt, const at::Tensor& wd_in, double prox_mu,                    \
            const c10::optional<at::Tensor>& anchor, const c10::optional<at::Tensor>& loss_rows,                   \
            const c10::optional<at::Tensor>& corr_vec, const c10::optional<at::Tensor>& corr_vec_scale,            \
            const c10::optional<at::Tensor>& corr_rows, double corr_rows_coef,                                     \
            const c10::optional<at::Tensor>& step_vec, const c10::optional<at::Tensor>& step_vec_scale,            \
            double max_norm, const c10::optional<at::Tensor>& active_opt,                                          \
            const c10::optional<at::Tensor>& delta_from, const c10::optional<at::Tensor>& delta_norm)

// Fused all-client Adam / AdamW step, in place: theta, exp_avg, exp_avg_sq [n, P] fp32 contiguous. grad_in as
// client_step's. step_in [n]: each client's own step count, this step included (bias corrections 1 - b^t_k are the
// backend's: the CPU takes the C library's pow in double, as torch.optim.Adam's Python floats; the GPU launchers
// compute them on the device from the same counts, no host sync); lr_in, wd_in: [1] or [n]; decoupled: AdamW's
// decay theta *= 1 - lr_k wd_k, else Adam's L2 term wd_k theta in the gradient. prox_mu with anchor_opt [P],
// loss_rows_opt [n, P], max_norm (<= 0: off), active_opt [n], delta_from / delta_norm: as client_step's.
#define FEDFAST_CLIENT_ADAM(name)                                                                                 \
  void name(at::Tensor& theta, const std::vector<at::Tensor>& grad_in, at::Tensor& exp_avg,                      \
            at::Tensor& exp_avg_sq, const at::Tensor& step_in, const at::Tensor& lr_in, double beta1,             \
            double beta2, double eps, const at::Tensor& wd_in, bool decoupled, double prox_mu,                    \
            const c10::optional<at::Tensor>& anchor_opt, const c10::optional<at::Tensor>& loss_rows_opt,          \
            double max_norm, const c10::optional<at::Tensor>& active_opt,                                          \
            const c10::optional<at::Tensor>& delta_from, const c10::optional<at::Tensor>& delta_norm)
