// FedGKD-VOTE teacher mixture on the CPU (Yao et al., Eq. 5), see fedfast/ops/teacher_mixture.py:
//   P_i = sum_m w_m softmax(t_mi / tau)  (over c != y_i if not_true),  negent_i = sum_m w_m sum_c p log p.
// Bytes: reads M*R*C*t + 4M, writes 4*R*C + 4R.
#include <ATen/Parallel.h>

#include <vector>

#include "fedfast_cpu.h"
#include "row_math.h"

namespace fedfast {
namespace {

FEDFAST_MULTIVERSION float mix_f32(int64_t C, float* X, float* E, float* P, float* U, float w) {
  return mix_core<float>(C, X, E, P, U, w);
}
inline double mix_any(int64_t C, double* X, double* E, double* P, double* U, double w) {
  return mix_core<double>(C, X, E, P, U, w);
}
inline float mix_any(int64_t C, float* X, float* E, float* P, float* U, float w) {
  return mix_f32(C, X, E, P, U, w);
}

}  // namespace

FEDFAST_TEACHER_MIXTURE(teacher_mixture_cpu) {
  TORCH_CHECK(teachers_in.dim() == 3, "teachers must be [M, R, C]");
  const at::Tensor teachers = teachers_in.contiguous(), target = target_in.contiguous();
  const int64_t M = teachers.size(0), R = teachers.size(1), C = teachers.size(2);
  const bool f64 = teachers.scalar_type() == at::kDouble;
  const auto acc = f64 ? at::kDouble : at::kFloat;
  auto P = at::empty({R, C}, teachers.options().dtype(acc));
  auto neg = at::empty({R}, teachers.options().dtype(acc));
  const at::Tensor w = weights.to(acc).contiguous();
  dispatch_logits(teachers, [&](auto t0, auto a0) {
    using T = decltype(t0);
    using A = decltype(a0);
    const T* tp = teachers.data_ptr<T>();
    const A* wp = w.data_ptr<A>();
    A* Pp = P.data_ptr<A>();
    A* np = neg.data_ptr<A>();
    const A inv_tau = A(1) / A(tau);
    at::parallel_for(0, R, std::max<int64_t>(1, 16384 / (C * M)), [&](int64_t b, int64_t e) {
      std::vector<A> buf(3 * C);
      A *X = buf.data(), *E = X + C, *U = E + C;
      for (int64_t i = b; i < e; ++i) {
        const int64_t y = row_target(target, i, C, ignore_index);
        A* Pi = Pp + i * C;
        for (int64_t j = 0; j < C; ++j) Pi[j] = 0;
        A ne = 0;
        for (int64_t m = 0; m < M; ++m) {
          const T* ti = tp + (m * R + i) * C;
          for (int64_t j = 0; j < C; ++j) X[j] = static_cast<A>(ti[j]) * inv_tau;
          if (not_true && y >= 0) X[y] = neg_inf<A>();
          ne += mix_any(C, X, E, Pi, U, wp[m]);
        }
        np[i] = ne;
      }
    });
  });
  return {P, neg};
}

}  // namespace fedfast
