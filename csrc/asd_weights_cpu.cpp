// ASD un-normalised weights on the CPU (Yashwanth et al., Eq. 10-11), see fedfast/ops/asd_weights.py:
//   alphahat_i = exp(-H(softmax(t_i / entropy_tau))) / prior[s_i, y_i],  0 on ignored rows.
// H = lse - sum_c p_c x_c with x = t / entropy_tau. Bytes: reads R*C*t + 12R, writes 4R.
#include <ATen/Parallel.h>

#include <vector>

#include "fedfast_cpu.h"
#include "row_math.h"

namespace fedfast {
namespace {

// Entropy of softmax(X): H = log s - sum_c e_c (x_c - m) / s. E and U are scratch rows.
template <typename A>
__attribute__((always_inline)) inline A entropy_core(int64_t C, A* __restrict X, A* __restrict E) {
  A m = neg_inf<A>();
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < C; ++j) m = X[j] > m ? X[j] : m;
  if (m == neg_inf<A>()) return A(0);
  for (int64_t j = 0; j < C; ++j) E[j] = fexp(X[j] - m);
  const double s = dsum(E, C);
  for (int64_t j = 0; j < C; ++j) X[j] = E[j] > 0 ? E[j] * (X[j] - m) : A(0);
  const double H = std::log(s) - dsum(X, C) / s;
  return H > 0 ? A(H) : A(0);
}
FEDFAST_MULTIVERSION float entropy_f32(int64_t C, float* X, float* E) { return entropy_core<float>(C, X, E); }
inline float entropy_any(int64_t C, float* X, float* E) { return entropy_f32(C, X, E); }
inline double entropy_any(int64_t C, double* X, double* E) { return entropy_core<double>(C, X, E); }

}  // namespace

at::Tensor asd_weights_cpu(const at::Tensor& teacher_in, const at::Tensor& target_in, const at::Tensor& class_prior,
                           const c10::optional<at::Tensor>& segments_in, double entropy_tau, int64_t ignore_index) {
  TORCH_CHECK(teacher_in.dim() == 2, "teacher must be [R, C]");
  const at::Tensor teacher = teacher_in.contiguous(), target = target_in.contiguous();
  c10::optional<at::Tensor> segments;
  if (segments_in.has_value()) segments = segments_in->contiguous();
  const int64_t R = teacher.size(0), C = teacher.size(1);
  const bool f64 = teacher.scalar_type() == at::kDouble;
  const auto acc = f64 ? at::kDouble : at::kFloat;
  const at::Tensor prior = class_prior.to(acc).contiguous();
  TORCH_CHECK(prior.dim() == 2 && prior.size(1) == C, "class_prior must be [S, C]");
  const int64_t S = prior.size(0);
  auto out = at::empty({R}, teacher.options().dtype(acc));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, teacher.scalar_type(), "asd_weights_cpu", [&] {
    using T = scalar_t;
    auto run = [&](auto zero) {
      using A = decltype(zero);
      const T* tp = teacher.data_ptr<T>();
      const A* pp = prior.data_ptr<A>();
      A* op = out.data_ptr<A>();
      const A inv_tau = A(1) / A(entropy_tau);
      at::parallel_for(0, R, std::max<int64_t>(1, 16384 / C), [&](int64_t b, int64_t e) {
        std::vector<A> buf(2 * C);
        for (int64_t i = b; i < e; ++i) {
          const int64_t y = row_target(target, i, C, ignore_index);
          if (y < 0) { op[i] = 0; continue; }
          const T* ti = tp + i * C;
          for (int64_t j = 0; j < C; ++j) buf[j] = static_cast<A>(ti[j]) * inv_tau;
          const A H = entropy_any(C, buf.data(), buf.data() + C);
          op[i] = std::exp(-H) / pp[row_segment(segments, i, S) * C + y];
        }
      });
    };
    if (f64) run(double(0)); else run(float(0));
  });
  return out;
}

}  // namespace fedfast
