// Fused all-client Adam / AdamW step on the CPU, in place (see fedfast/ops/client_adam_reference.py):
//   g = grad + mu (theta - anchor) + loss_rows ; g *= min(1, max_norm / (||g|| + 1e-6)) ;
//   Adam: g += wd_k theta            AdamW: theta *= 1 - lr_k wd_k
//   m = lerp(m, g, 1 - b1) ; v = b2 v + (1 - b2) g^2 ;
//   theta -= lr_k / (1 - b1^t_k) * m / (sqrt(v) / sqrt(1 - b2^t_k) + eps)        (inactive rows: no-op)
// t_k: client k's own step count (this step included), as torch.optim.Adam's per-parameter `step`.
// Bytes: n*P*(4 theta r/w *2 + grad 4 + 16 m, v r/w + [4 anchor-side]) ; one more grad read with clipping.
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "fedfast_cpu.h"

namespace fedfast {
namespace {
constexpr int64_t kBlock = 4096;

// One row block; the weight-decay form and torch.lerp's branch are compile-time, the pointers unaliased, so the
// loop vectorises (with them as runtime branches: 30 ms for 50 x 199,210 floats on the 2-core EPYC).
template <bool kDecoupled, bool kLerpLow>
void adam_block(const float* __restrict lg, float* __restrict tr, float* __restrict mr, float* __restrict vr,
                int64_t len, float ck, float wdk, float decay, float w1, float w2, float b2, float step_size,
                float bc2_sqrt, float ep) {
  for (int64_t j = 0; j < len; ++j) {
    float g = lg[j] * ck;
    if (kDecoupled)
      tr[j] *= decay;
    else
      g += wdk * tr[j];
    const float m = kLerpLow ? mr[j] + w1 * (g - mr[j]) : g - (g - mr[j]) * (1.f - w1);  // torch.lerp
    const float v = vr[j] * b2 + w2 * g * g;  // mul_(b2).addcmul_(g, g, value=1 - b2)
    mr[j] = m;
    vr[j] = v;
    tr[j] -= step_size * (m / (std::sqrt(v) / bc2_sqrt + ep));
  }
}
}  // namespace

FEDFAST_CLIENT_ADAM(client_adam_cpu) {
  for (const at::Tensor* t : {&theta, &exp_avg, &exp_avg_sq})
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kFloat, "theta and the Adam moments must be "
                "contiguous fp32");
  const int64_t n = theta.size(0), P = theta.size(1);
  TORCH_CHECK(exp_avg.numel() == n * P && exp_avg_sq.numel() == n * P, "the Adam moments must be [n, P]");
  std::vector<at::Tensor> grads;
  const std::vector<GradBlock> blocks = grad_blocks(grad_in, n, P, kBlock, grads);
  const at::Tensor step = step_in.to(at::kDouble).contiguous();
  TORCH_CHECK(step.numel() == n, "step must have one value per row");
  const at::Tensor lr = lr_in.to(at::kFloat).contiguous(), wd = wd_in.to(at::kFloat).contiguous();
  const at::Tensor anchor = anchor_opt.has_value() ? anchor_opt->to(at::kFloat).contiguous() : at::Tensor();
  const at::Tensor lrows = loss_rows_opt.has_value() ? loss_rows_opt->to(at::kFloat).contiguous() : at::Tensor();
  const at::Tensor active = active_opt.has_value() ? active_opt->to(at::kBool).contiguous() : at::Tensor();
  float* th = theta.data_ptr<float>();
  float* mm = exp_avg.data_ptr<float>();
  float* vv = exp_avg_sq.data_ptr<float>();
  const float* an = anchor.defined() ? anchor.data_ptr<float>() : nullptr;
  const float* dy = lrows.defined() ? lrows.data_ptr<float>() : nullptr;
  const bool* act = active.defined() ? active.data_ptr<bool>() : nullptr;
  const float mu = static_cast<float>(prox_mu);
  const int64_t nb = static_cast<int64_t>(blocks.size());
  DeltaNorms delta(delta_from, delta_norm, n, P, nb);  // ||theta' - delta_from|| per row, in the same pass
  const std::vector<float> clip =
      clip_factors(n, blocks, max_norm, kBlock, [&](int64_t k, const GradBlock& bl, float* tmp) {
        return loss_grad_view(bl, k, P, th, mu, an, dy, tmp);
      });
  const double* stp = step.data_ptr<double>();
  const float* lrp = lr.data_ptr<float>();
  const float* wdp = wd.data_ptr<float>();
  const bool lr_row = lr.numel() == n, wd_row = wd.numel() == n;
  const float b2 = static_cast<float>(beta2), ep = static_cast<float>(eps);
  // 1 - beta in double, then fp32: torch.optim.Adam passes these as Python floats to the fp32 kernels
  const float w1 = static_cast<float>(1.0 - beta1), w2 = static_cast<float>(1.0 - beta2);
  at::parallel_for(0, n * nb, 1, [&](int64_t b, int64_t e) {
    std::vector<float> tmp(kBlock);
    for (int64_t t = b; t < e; ++t) {
      const int64_t k = t / nb;
      const GradBlock& bl = blocks[t % nb];
      if (act && !act[k]) continue;
      const float* lg = loss_grad_view(bl, k, P, th, mu, an, dy, tmp.data());
      const int64_t o = k * P + bl.c0;
      float *tr = th + o, *mr = mm + o, *vr = vv + o;
      const float ck = clip[k], wdk = wd_row ? wdp[k] : wdp[0], lrk = lr_row ? lrp[k] : lrp[0];
      // bias corrections in double, as torch.optim.Adam computes them in Python floats
      const double bc1 = 1.0 - std::pow(beta1, stp[k]), bc2 = 1.0 - std::pow(beta2, stp[k]);
      const float step_size = static_cast<float>(lrk / bc1), bc2_sqrt = static_cast<float>(std::sqrt(bc2));
      const float decay = static_cast<float>(1.0 - static_cast<double>(lrk) * wdk);
      auto run = decoupled ? (w1 < 0.5f ? adam_block<true, true> : adam_block<true, false>)
                           : (w1 < 0.5f ? adam_block<false, true> : adam_block<false, false>);
      run(lg, tr, mr, vr, bl.len, ck, wdk, decay, w1, w2, b2, step_size, bc2_sqrt, ep);
      delta.block(t, tr, bl.c0, bl.len);
    }
  });
  delta.finish(n, act);
}

}  // namespace fedfast
