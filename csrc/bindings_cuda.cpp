// The one Python binding file of the CUDA extension fedfast._C_cuda: checks tensors and forwards raw
// pointers and the current stream to the torch-free launchers in kernels/*.cu.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <tuple>
#include <vector>

#include "fedfast_kernels.h"
#include "op_signatures.h"

namespace {

int dtype_code(const at::Tensor& x, const char* name) {
  switch (x.scalar_type()) {
    case at::kFloat: return FEDFAST_F32;
    case at::kBFloat16: return FEDFAST_BF16;
    case at::kHalf: return FEDFAST_F16;
    default: TORCH_CHECK(false, name, ": the cuda backend takes fp32, bf16 or fp16, got ", x.scalar_type());
  }
  return -1;
}
void check_cuda(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.is_cuda(), name, ": expected a CUDA tensor");
}
const float* fptr(const c10::optional<at::Tensor>& x, at::Tensor& keep) {
  if (!x.has_value()) return nullptr;
  keep = x->to(at::kFloat).contiguous();
  return keep.data_ptr<float>();
}
void check_launch(int err, const char* op) {
  TORCH_CHECK(err == 0, "fedfast ", op, " kernel launch failed: ", cudaGetErrorString((cudaError_t)err));
}

FEDFAST_DISTILL_ROWS(distill_rows_cuda) {
  // fedfast.ops.distill mixes FedGKD-VOTE's teachers (teacher_mixture) and computes ASD's row weights (asd_weights)
  // in ops of their own before this one on the GPU, and keeps the logits it differentiates
  TORCH_CHECK(!mix_weights.has_value() && !class_prior.has_value() && !in_place, "distill_rows_cuda: mix_weights, "
              "class_prior and in_place are the CPU kernel's; fedfast.ops.distill passes none of them here");
  check_cuda(student, "student");
  check_cuda(teacher, "teacher");
  check_cuda(target, "target");
  TORCH_CHECK(student.dim() == 2 && teacher.sizes() == student.sizes(), "student/teacher shape mismatch");
  c10::cuda::CUDAGuard guard(student.device());
  const at::Tensor z = student.contiguous(), t = teacher.contiguous();
  const at::Tensor y = target.contiguous();
  at::Tensor seg;
  if (segments.has_value()) seg = segments->contiguous();
  const int64_t R = z.size(0), C = z.size(1);
  auto loss = at::empty({R}, z.options().dtype(at::kFloat));
  auto grad = at::empty_like(z);
  at::Tensor k_neg, k_al, k_rw, k_rs, k_rho, l1p;
  const float* neg = fptr(teacher_negent, k_neg);
  const float* al = fptr(class_alpha, k_al);
  const float* rw = fptr(row_weight, k_rw);
  const float* rs = fptr(row_scale, k_rs);
  const float* rh = fptr(rho, k_rho);
  if (rh) l1p = at::log1p(-k_rho).contiguous();
  check_launch(fedfast_distill_rows(
                   z.data_ptr(), dtype_code(z, "student"), t.data_ptr(), neg ? FEDFAST_F32 : dtype_code(t, "teacher"),
                   y.data_ptr(), y.scalar_type() == at::kLong, neg, al, rw, rs, rh,
                   rh ? l1p.data_ptr<float>() : nullptr, seg.defined() ? seg.data_ptr() : nullptr,
                   seg.defined() && seg.scalar_type() == at::kLong, rh ? k_rho.size(0) : 1,
                   loss.data_ptr<float>(), grad.data_ptr(), R, C, (float)(1.0 / tau), (float)ce_weight,
                   (float)kd_weight, ignore_index, not_true, soft_ce, c10::cuda::getCurrentCUDAStream().stream()),
               "distill_rows");
  return {loss, grad, 0};
}

FEDFAST_SCALE_ROWS(scale_rows_cuda) {
  check_cuda(grad_in, "grad");
  c10::cuda::CUDAGuard guard(grad_in.device());
  const at::Tensor grad = grad_in.contiguous(), gl = grad_loss_in.to(at::kFloat).contiguous();
  auto out = at::empty_like(grad);
  check_launch(fedfast_scale_rows(grad.data_ptr(), dtype_code(grad, "grad"), gl.data_ptr<float>(), out.data_ptr(),
                                  grad.size(0), grad.size(1), c10::cuda::getCurrentCUDAStream().stream()),
               "scale_rows");
  return out;
}

FEDFAST_TEACHER_MIXTURE(teacher_mixture_cuda) {
  check_cuda(teachers_in, "teachers");
  c10::cuda::CUDAGuard guard(teachers_in.device());
  const at::Tensor teachers = teachers_in.contiguous(), target = target_in.contiguous();
  const at::Tensor w = weights.to(at::kFloat).contiguous();
  const int64_t M = teachers.size(0), R = teachers.size(1), C = teachers.size(2);
  auto P = at::empty({R, C}, teachers.options().dtype(at::kFloat));
  auto neg = at::empty({R}, teachers.options().dtype(at::kFloat));
  check_launch(fedfast_teacher_mixture(teachers.data_ptr(), dtype_code(teachers, "teachers"), w.data_ptr<float>(), M,
                                       target.data_ptr(), target.scalar_type() == at::kLong, P.data_ptr<float>(),
                                       neg.data_ptr<float>(), R, C, (float)(1.0 / tau), ignore_index, not_true,
                                       c10::cuda::getCurrentCUDAStream().stream()),
               "teacher_mixture");
  return {P, neg};
}

FEDFAST_ASD_WEIGHTS(asd_weights_cuda) {
  check_cuda(teacher_in, "teacher");
  c10::cuda::CUDAGuard guard(teacher_in.device());
  const at::Tensor teacher = teacher_in.contiguous(), target = target_in.contiguous();
  const at::Tensor prior = class_prior.to(at::kFloat).contiguous();
  at::Tensor segments;
  if (segments_in.has_value()) segments = segments_in->contiguous();
  const int64_t R = teacher.size(0), C = teacher.size(1);
  auto out = at::empty({R}, teacher.options().dtype(at::kFloat));
  check_launch(fedfast_asd_weights(teacher.data_ptr(), dtype_code(teacher, "teacher"), target.data_ptr(),
                                   target.scalar_type() == at::kLong, prior.data_ptr<float>(),
                                   segments.defined() ? segments.data_ptr() : nullptr,
                                   segments.defined() && segments.scalar_type() == at::kLong, prior.size(0),
                                   out.data_ptr<float>(), R, C, (float)(1.0 / entropy_tau), ignore_index,
                                   c10::cuda::getCurrentCUDAStream().stream()),
               "asd_weights");
  return out;
}

// (row_scale [R] fp32, or None for mode 0; 0); status: the deferred-validation flags, or None (no checks).
FEDFAST_ROW_SCALE(row_scale_cuda) {
  check_cuda(target_in, "target");
  c10::cuda::CUDAGuard guard(target_in.device());
  const at::Tensor target = target_in.contiguous();
  at::Tensor segments;
  if (segments_in.has_value()) segments = segments_in->contiguous();
  if (mode == 2 && !segments.defined()) mode = 1;
  TORCH_CHECK(mode >= 0 && mode <= 2, "row_scale: mode must be 0, 1 or 2");
  if (status.has_value())
    TORCH_CHECK(status->is_cuda() && status->scalar_type() == at::kInt && status->is_contiguous() &&
                    status->numel() >= 2, "row_scale: status must be a contiguous int32 CUDA tensor of >= 2 flags");
  const int64_t R = target.size(0);
  at::Tensor rs, counts;
  if (mode) rs = at::empty({R}, target.options().dtype(at::kFloat));
  if (mode == 2) counts = at::empty({R}, target.options().dtype(at::kInt));
  if (mode == 0 && !status.has_value()) return {c10::nullopt, 0};
  check_launch(fedfast_row_scale(target.data_ptr(), target.scalar_type() == at::kLong,
                                 segments.defined() ? segments.data_ptr() : nullptr,
                                 segments.defined() && segments.scalar_type() == at::kLong,
                                 counts.defined() ? counts.data_ptr<int>() : nullptr,
                                 rs.defined() ? rs.data_ptr<float>() : nullptr,
                                 status.has_value() ? status->data_ptr<int>() : nullptr, R, C, ignore_index, limit,
                                 (int)mode, c10::cuda::getCurrentCUDAStream().stream()),
               "row_scale");
  if (!mode) return {c10::nullopt, 0};
  return {rs, 0};
}

FEDFAST_AGGREGATE(aggregate_cuda) {
  TORCH_CHECK(!avg_shift.has_value(), "aggregate: avg_shift (DP-FedAvg's clipped average) is not on the CUDA "
              "backend yet; use backend='triton'");
  check_cuda(X_in, "clients");
  c10::cuda::CUDAGuard guard(X_in.device());
  const at::Tensor X = X_in.contiguous(), rows = rows_in.to(at::kLong).contiguous();
  const at::Tensor g = g_in.to(at::kFloat).contiguous(), w = w_in.to(at::kFloat).contiguous();
  const int64_t n = rows.size(0), P = X.size(1);
  auto opts = g.options();
  at::Tensor keep[4];  // the fp32 contiguous copies the pointers below read
  const float *m = fptr(momentum, keep[0]), *r = fptr(state_rows, keep[1]), *coef = fptr(state_coef, keep[2]);
  const float* shift = fptr(state_shift, keep[3]);
  TORCH_CHECK(!r || (coef && keep[2].numel() == n), "state_coef must have one value per row");
  at::Tensor g_out = at::empty({P}, opts), avg_out = at::empty({P}, opts);
  const bool keep_m = m != nullptr || beta != 0.0;
  at::Tensor m_out = keep_m ? at::empty({P}, opts) : at::Tensor();
  at::Tensor r_out = r ? at::empty_like(keep[1]) : at::Tensor(), change = r ? at::empty({P}, opts) : at::Tensor();
  at::Tensor ring = ring_in.has_value() ? ring_in->to(at::kFloat).clone() : at::Tensor();
  at::Tensor bad = at::zeros({n + 1}, opts.dtype(at::kInt));
  auto mp = [](at::Tensor& t) -> float* { return t.defined() ? t.data_ptr<float>() : nullptr; };
  check_launch(fedfast_aggregate(X.data_ptr(), dtype_code(X, "clients"), rows.data_ptr<int64_t>(), n, P,
                                 w.data_ptr<float>(), g.data_ptr<float>(), (float)beta, (float)scale, (float)lr, m,
                                 mp(m_out), r, mp(r_out), coef, shift, mp(change), mp(ring), slot,
                                 g_out.data_ptr<float>(), avg_out.data_ptr<float>(), bad.data_ptr<int>(),
                                 c10::cuda::getCurrentCUDAStream().stream()),
               "aggregate");
  at::Tensor ring_mean = ring.defined() ? ring.narrow(0, 0, count).mean(0) : at::Tensor();
  return {g_out, avg_out, m_out, r_out, change, ring, ring_mean, bad.to(at::kBool)};
}

// Per-row clip factors min(1, max_norm / (||g_k|| + 1e-6)) of the loss gradient (undefined: no clipping).
at::Tensor clip_factors(const at::Tensor& theta, const at::Tensor& grad, double prox_mu, const float* anchor,
                        const float* lrows, double max_norm, cudaStream_t stream) {
  if (!(max_norm > 0)) return at::Tensor();
  const int64_t n = theta.size(0), P = theta.size(1);
  at::Tensor sq = at::zeros({n}, theta.options());
  check_launch(fedfast_client_grad_sqnorm(theta.data_ptr<float>(), grad.data_ptr<float>(), n, P, (float)prox_mu,
                                          prox_mu != 0.0 ? anchor : nullptr, lrows, sq.data_ptr<float>(), stream),
               "client_grad_sqnorm");
  return at::clamp_max(max_norm / (sq.sqrt() + 1e-6), 1.0).contiguous();
}

FEDFAST_CLIENT_STEP(client_step_cuda) {
  check_cuda(theta, "theta");
  // the update norms on this backend: fedfast.ops.client_step, one Triton (or tensor-op) pass after the step
  TORCH_CHECK(!delta_from.has_value() && !delta_norm.has_value(), "client_step_cuda: delta_norm is computed by "
              "fedfast.ops.client_step after the step on this backend");
  TORCH_CHECK(theta.is_contiguous() && theta.scalar_type() == at::kFloat, "theta must be contiguous fp32");
  c10::cuda::CUDAGuard guard(theta.device());
  const int64_t n = theta.size(0), P = theta.size(1);
  std::vector<at::Tensor> flat;  // the per-parameter pieces [n, *shape] side by side: one [n, P] gradient
  for (const at::Tensor& gi : grad_in) flat.push_back(gi.reshape({n, -1}));
  const at::Tensor grad = (flat.size() == 1 ? flat[0] : at::cat(flat, 1)).to(at::kFloat).contiguous();
  TORCH_CHECK(grad.size(1) == P, "grad: the pieces have ", grad.size(1), " columns, theta has ", P);
  const at::Tensor lr = lr_in.to(at::kFloat).contiguous(), wd = wd_in.to(at::kFloat).contiguous();
  at::Tensor keep[7];  // the fp32 contiguous copies the pointers below read
  const float *a = fptr(anchor, keep[0]), *lrows = fptr(loss_rows, keep[1]), *cvec = fptr(corr_vec, keep[2]);
  const float *cscale = fptr(corr_vec_scale, keep[3]), *crows = fptr(corr_rows, keep[4]);
  const float *svec = fptr(step_vec, keep[5]), *sscale = fptr(step_vec_scale, keep[6]);
  float* buf = nullptr;
  if (buf_opt.has_value()) {
    TORCH_CHECK(buf_opt->is_contiguous() && buf_opt->scalar_type() == at::kFloat, "momentum_buf must be contiguous fp32");
    buf = buf_opt->data_ptr<float>();
  }
  at::Tensor active = active_opt.has_value() ? active_opt->to(at::kChar).contiguous() : at::Tensor();
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  const at::Tensor clip = clip_factors(theta, grad, prox_mu, a, lrows, max_norm, stream);
  check_launch(fedfast_client_step(theta.data_ptr<float>(), grad.data_ptr<float>(), n, P, lr.data_ptr<float>(),
                                   lr.numel() == n && n > 1, wd.data_ptr<float>(), wd.numel() == n && n > 1,
                                   (float)prox_mu, prox_mu != 0.0 ? a : nullptr, lrows,
                                   clip.defined() ? clip.data_ptr<float>() : nullptr, cvec, cscale, crows,
                                   (float)corr_rows_coef, (float)momentum, buf, svec, sscale,
                                   active.defined() ? active.data_ptr<int8_t>() : nullptr, stream),
               "client_step");
}

FEDFAST_CLIENT_ADAM(client_adam_cuda) {
  check_cuda(theta, "theta");
  TORCH_CHECK(!delta_from.has_value() && !delta_norm.has_value(), "client_adam_cuda: delta_norm is computed by "
              "fedfast.ops.client_adam after the step on this backend");
  for (const at::Tensor* t : {&theta, &exp_avg, &exp_avg_sq})
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kFloat, "theta and the Adam moments must be "
                "contiguous fp32");
  c10::cuda::CUDAGuard guard(theta.device());
  const int64_t n = theta.size(0), P = theta.size(1);
  std::vector<at::Tensor> flat;  // the per-parameter pieces [n, *shape] side by side: one [n, P] gradient
  for (const at::Tensor& gi : grad_in) flat.push_back(gi.reshape({n, -1}));
  const at::Tensor grad = (flat.size() == 1 ? flat[0] : at::cat(flat, 1)).to(at::kFloat).contiguous();
  TORCH_CHECK(grad.size(1) == P, "grad: the pieces have ", grad.size(1), " columns, theta has ", P);
  TORCH_CHECK(step_in.numel() == n, "step must have one value per row");
  // the per-row scalars on the device in double (torch.optim.Adam's Python floats): lr_k / (1 - b1^t_k),
  // sqrt(1 - b2^t_k) and (AdamW) 1 - lr_k wd_k, as the Triton backend's adam_row_scalars
  const at::Tensor t64 = step_in.to(at::kDouble).reshape({n});
  const at::Tensor lr64 = lr_in.to(at::kDouble).reshape({-1}).expand({n});
  const at::Tensor step_size = (lr64 / (1.0 - at::pow(beta1, t64))).to(at::kFloat).contiguous();
  const at::Tensor bc2 = at::sqrt(1.0 - at::pow(beta2, t64)).to(at::kFloat).contiguous();
  const at::Tensor wd = wd_in.to(at::kFloat).contiguous();
  at::Tensor kdec;
  if (decoupled) kdec = (1.0 - lr64 * wd_in.to(at::kDouble).reshape({-1}).expand({n})).to(at::kFloat).contiguous();
  const float* decay = decoupled ? kdec.data_ptr<float>() : nullptr;
  at::Tensor ka, kd;
  const float* a = fptr(anchor_opt, ka);
  const float* d = fptr(loss_rows_opt, kd);
  at::Tensor active = active_opt.has_value() ? active_opt->to(at::kChar).contiguous() : at::Tensor();
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  const at::Tensor clip = clip_factors(theta, grad, prox_mu, a, d, max_norm, stream);
  check_launch(fedfast_client_adam(theta.data_ptr<float>(), grad.data_ptr<float>(), n, P, exp_avg.data_ptr<float>(),
                                   exp_avg_sq.data_ptr<float>(), step_size.data_ptr<float>(), bc2.data_ptr<float>(),
                                   wd.data_ptr<float>(), wd.numel() == n && n > 1, decay, (float)beta2,
                                   (float)(1.0 - beta1), (float)(1.0 - beta2), (float)eps, (float)prox_mu,
                                   prox_mu != 0.0 ? a : nullptr, d, clip.defined() ? clip.data_ptr<float>() : nullptr,
                                   active.defined() ? active.data_ptr<int8_t>() : nullptr, stream),
               "client_adam");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fedfast CUDA kernels";
  m.def("distill_rows", &distill_rows_cuda, "fused CE + distillation rows: (loss [R], dL/dz [R, C], 0)");
  m.def("scale_rows", &scale_rows_cuda, "grad * grad_loss[:, None]");
  m.def("row_scale", &row_scale_cuda, "reduction weights + deferred target/segment checks, one launch");
  m.def("teacher_mixture", &teacher_mixture_cuda, "FedGKD-VOTE mixture: (P [R, C], negent [R])");
  m.def("asd_weights", &asd_weights_cuda, "ASD alphahat [R]");
  m.def("aggregate", &aggregate_cuda, "fused server update");
  m.def("client_step", &client_step_cuda, "fused all-client optimizer step, in place");
  m.def("client_adam", &client_adam_cuda, "fused all-client Adam / AdamW step, in place");
}
