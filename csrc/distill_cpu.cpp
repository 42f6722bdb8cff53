// Fused CE + distillation row op on the CPU: loss and d(loss)/d(student) in one pass over each row.
// Formula (FedNTD Eq. 10-11, FedGKD Eq. 3-5, ASD Eq. 5-11, FedCAD Eq. 5, FedADC+ Eq. 7-9): see
// fedfast/ops/distill_reference.py. Per row i, kept classes K_i (all, or c != y_i for not-true):
//   L_i = a_i CE_i + b_i D_i,  dL_i/dz_i = a_i (softmax(z_i) - e_y) + (b_i/tau) (W q_i - P_i) on K_i.
// Rows are split across threads (at::parallel_for); each row is converted once to an fp32 (fp64 for
// fp64 inputs) scratch row, then three branch-free passes (max, exp+sum, loss+grad) run from L1/L2.
// Bytes: reads R*C*(s+t), writes R*C*g + 4R (s, t, g = element sizes); no [R, C] temporaries.
#include <ATen/Parallel.h>

#include <vector>

#include "fedfast_cpu.h"
#include "row_math.h"

namespace fedfast {
namespace {

template <typename A>
struct RowArgs {
  int64_t C, y;
  A *Z, *ZQ, *TT, *E1, *EQ, *ET, *G, *U, *V;  // scratch rows
  const A *rho, *l1p;                         // FedADC+: rho_c and log(1 - rho_c) for this row's segment, or null
  A negent_in, a, b, inv_tau;
  bool not_true, soft_ce;
};

// Returns L_i; writes dL_i/dz_i into G. Z = z, ZQ = z/tau, TT = t/tau (or P in prob mode).
// Every loop is an elementwise map or a max (both vectorise); sums go through dsum (fp64).
template <typename A, bool PROB, bool RHO>
__attribute__((always_inline)) inline A row_core(const RowArgs<A>& r) {
  const int64_t C = r.C, y = r.y;
  A *__restrict Z = r.Z, *__restrict ZQ = r.ZQ, *__restrict TT = r.TT, *__restrict E1 = r.E1;
  A *__restrict EQ = r.EQ, *__restrict ET = r.ET, *__restrict G = r.G, *__restrict U = r.U, *__restrict V = r.V;
  const A ninf = neg_inf<A>();
  if (r.not_true) {
    ZQ[y] = ninf;
    TT[y] = PROB ? A(0) : ninf;
  }
  A m1 = ninf, mq = ninf, mt = ninf;
#pragma omp simd reduction(max : m1, mq)
  for (int64_t j = 0; j < C; ++j) {
    m1 = Z[j] > m1 ? Z[j] : m1;
    mq = ZQ[j] > mq ? ZQ[j] : mq;
  }
  if (!PROB) {
#pragma omp simd reduction(max : mt)
    for (int64_t j = 0; j < C; ++j) mt = TT[j] > mt ? TT[j] : mt;
  }
  if (m1 == ninf) m1 = 0;
  if (mq == ninf) mq = 0;
  if (mt == ninf) mt = 0;  // teacher row all -inf: p = 0 everywhere, D_i = 0
  for (int64_t j = 0; j < C; ++j) E1[j] = fexp(Z[j] - m1);
  for (int64_t j = 0; j < C; ++j) EQ[j] = fexp(ZQ[j] - mq);
  if (!PROB)
    for (int64_t j = 0; j < C; ++j) ET[j] = fexp(TT[j] - mt);
  const double s1 = dsum(E1, C), sq = dsum(EQ, C), st = PROB ? 0.0 : dsum(ET, C);
  const A W = PROB ? A(dsum(TT, C)) : A(1);
  // log q_j = (zq_j - mq) - log(sq): never form mq + log(sq) (loses digits for |logits| ~ 1e4)
  const A inv_s1 = A(1 / s1), inv_sq = A(1 / sq), lsq = A(std::log(sq));
  const A inv_st = st > 0 ? A(1 / st) : A(0), lst = st > 0 ? A(std::log(st)) : A(0);
  A mvd = 0;  // FedADC+: mass moved to the true class, sum_{c != y} rho_c p_c
  if (RHO) {
    const A* rho = r.rho;
    for (int64_t j = 0; j < C; ++j) U[j] = rho[j] * ET[j];
    U[y] = 0;
    mvd = A(dsum(U, C)) * inv_st;
  }
  const A a = r.a, kb = r.b * r.inv_tau;
  // True class y first (its terms are overwritten after the elementwise loops): P_y is the teacher prob,
  // plus the moved mass for FedADC+, and 0 for not-true.
  A Py, logPy;
  if (r.not_true) {
    Py = 0;
    logPy = 0;
  } else if (PROB) {
    Py = TT[y];
    logPy = 0;
  } else {
    const A py = ET[y] * inv_st;
    Py = RHO ? py + mvd : py;
    logPy = RHO ? std::log(Py) : (TT[y] - mt) - lst;
  }
  const A logqy = (ZQ[y] - mq) - lsq, qy = EQ[y] * inv_sq, smy = E1[y] * inv_s1;
  // In place: ZQ <- log q, EQ <- q, E1 <- softmax(z), and (logit teacher) ET <- P, TT <- log P.
  for (int64_t j = 0; j < C; ++j) ZQ[j] = (ZQ[j] - mq) - lsq;
  for (int64_t j = 0; j < C; ++j) EQ[j] *= inv_sq;
  for (int64_t j = 0; j < C; ++j) E1[j] *= inv_s1;
  if (!PROB) {
    if (RHO) {
      const A *__restrict rho = r.rho, *__restrict l1p = r.l1p;
      for (int64_t j = 0; j < C; ++j) ET[j] = (A(1) - rho[j]) * (ET[j] * inv_st);
      for (int64_t j = 0; j < C; ++j) TT[j] = l1p[j] + ((TT[j] - mt) - lst);
    } else {
      for (int64_t j = 0; j < C; ++j) ET[j] *= inv_st;
      for (int64_t j = 0; j < C; ++j) TT[j] = (TT[j] - mt) - lst;
    }
  }
  const A* __restrict P = PROB ? TT : ET;
  // 0 * log 0 = 0: select the log (not the product) so the loops stay branch-free selects.
  for (int64_t j = 0; j < C; ++j) U[j] = -P[j] * (P[j] > 0 ? ZQ[j] : A(0));  // cross-entropy terms
  if (!PROB)
    for (int64_t j = 0; j < C; ++j) V[j] = ET[j] * (ET[j] > 0 ? TT[j] : A(0));  // negative-entropy terms
  for (int64_t j = 0; j < C; ++j) G[j] = a * E1[j] + kb * (W * EQ[j] - P[j]);
  U[y] = Py > 0 ? -Py * logqy : A(0);
  if (!PROB) V[y] = Py > 0 ? Py * logPy : A(0);
  G[y] = a * (smy - A(1)) + kb * (W * qy - Py);
  const A cross = A(dsum(U, C)), negent = PROB ? r.negent_in : A(dsum(V, C));
  const A ce = (m1 - Z[y]) + A(std::log(s1));
  return a * ce + r.b * (cross + (r.soft_ce ? A(0) : negent));
}

template <typename A>
__attribute__((always_inline)) inline A row_dispatch(const RowArgs<A>& r, bool prob) {
  if (prob) return row_core<A, true, false>(r);
  if (r.rho) return row_core<A, false, true>(r);
  return row_core<A, false, false>(r);
}

FEDFAST_MULTIVERSION float row_f32(const RowArgs<float>& r, bool prob) { return row_dispatch<float>(r, prob); }
double row_f64(const RowArgs<double>& r, bool prob) { return row_dispatch<double>(r, prob); }
inline float row_any(const RowArgs<float>& r, bool prob) { return row_f32(r, prob); }
inline double row_any(const RowArgs<double>& r, bool prob) { return row_f64(r, prob); }

template <typename S, typename T, typename A>
void distill_impl(const at::Tensor& student, const at::Tensor& teacher, const at::Tensor& target,
                  const A* negent, const A* alpha, const A* roww, const A* rscale, const A* rho, const A* l1p,
                  int64_t S_rows,
                  const c10::optional<at::Tensor>& segments, A tau, A ce_w, A kd_w, int64_t ignore_index,
                  bool not_true, bool soft_ce, bool prob, at::Tensor& loss, at::Tensor& grad) {
  const int64_t R = student.size(0), C = student.size(1);
  const S* zp = student.data_ptr<S>();
  const T* tp = teacher.data_ptr<T>();
  S* gp = grad.data_ptr<S>();
  A* lp = loss.data_ptr<A>();
  const A inv_tau = A(1) / tau;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(C, 1));
  at::parallel_for(0, R, grain, [&](int64_t begin, int64_t end) {
    std::vector<A> buf(9 * C);
    RowArgs<A> r;
    r.C = C;
    r.Z = buf.data(); r.ZQ = r.Z + C; r.TT = r.ZQ + C; r.E1 = r.TT + C; r.EQ = r.E1 + C; r.ET = r.EQ + C;
    r.G = r.ET + C;
    r.U = r.G + C;
    r.V = r.U + C;
    r.inv_tau = inv_tau;
    r.not_true = not_true;
    r.soft_ce = soft_ce;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t y = row_target(target, i, C, ignore_index);
      S* gi = gp + i * C;
      if (y < 0) {
        for (int64_t j = 0; j < C; ++j) gi[j] = S(0);
        lp[i] = 0;
        continue;
      }
      const S* zi = zp + i * C;
      const T* ti = tp + i * C;
      for (int64_t j = 0; j < C; ++j) {
        const A zj = static_cast<A>(zi[j]);
        r.Z[j] = zj;
        r.ZQ[j] = zj * inv_tau;
      }
      if (prob) {
        for (int64_t j = 0; j < C; ++j) r.TT[j] = static_cast<A>(ti[j]);
      } else {
        for (int64_t j = 0; j < C; ++j) r.TT[j] = static_cast<A>(ti[j]) * inv_tau;
      }
      r.y = y;
      const int64_t s = rho ? row_segment(segments, i, S_rows) : 0;
      r.rho = rho ? rho + s * C : nullptr;
      r.l1p = rho ? l1p + s * C : nullptr;
      const A al = alpha ? alpha[y] : A(0);
      const A sc = rscale ? rscale[i] : A(1);  // reduction weight: scales the loss row and its gradient
      r.a = (alpha ? ce_w * (A(1) - al) : ce_w) * sc;
      r.b = (alpha ? kd_w * al : kd_w) * (roww ? roww[i] : A(1)) * sc;
      r.negent_in = prob ? negent[i] : A(0);
      lp[i] = row_any(r, prob);
      for (int64_t j = 0; j < C; ++j) gi[j] = static_cast<S>(r.G[j]);
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> distill_rows_cpu(
    const at::Tensor& student_in, const at::Tensor& teacher_in, const at::Tensor& target_in,
    const c10::optional<at::Tensor>& teacher_negent, const c10::optional<at::Tensor>& class_alpha,
    const c10::optional<at::Tensor>& row_weight, const c10::optional<at::Tensor>& rho,
    const c10::optional<at::Tensor>& segments_in, const c10::optional<at::Tensor>& row_scale, double tau,
    double ce_weight, double kd_weight, int64_t ignore_index, bool not_true, bool soft_ce) {
  TORCH_CHECK(student_in.dim() == 2 && teacher_in.sizes() == student_in.sizes(), "student/teacher shape mismatch");
  TORCH_CHECK(target_in.dim() == 1 && target_in.size(0) == student_in.size(0), "target shape mismatch");
  TORCH_CHECK(student_in.size(1) >= 2, "need C >= 2");
  const at::Tensor student = student_in.contiguous(), teacher = teacher_in.contiguous();
  const at::Tensor target = target_in.contiguous();
  c10::optional<at::Tensor> segments;
  if (segments_in.has_value()) segments = segments_in->contiguous();
  const bool f64 = student.scalar_type() == at::kDouble;
  const auto acc = f64 ? at::kDouble : at::kFloat;
  auto loss = at::empty({student.size(0)}, student.options().dtype(acc));
  auto grad = at::empty_like(student);
  auto as_acc = [&](const c10::optional<at::Tensor>& x) -> at::Tensor {
    return x.has_value() ? x->to(acc).contiguous() : at::Tensor();
  };
  at::Tensor neg = as_acc(teacher_negent), al = as_acc(class_alpha), rw = as_acc(row_weight), rh = as_acc(rho);
  at::Tensor rs = as_acc(row_scale);
  at::Tensor l1p = rh.defined() ? at::log1p(-rh) : at::Tensor();
  const int64_t S_rows = rh.defined() ? rh.size(0) : 1;
  const bool prob = neg.defined();
  if (prob) TORCH_CHECK(!rh.defined(), "rho needs teacher logits");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, student.scalar_type(), "distill_rows_cpu_s", [&] {
    using S = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, teacher.scalar_type(), "distill_rows_cpu_t", [&] {
      using T = scalar_t;
      auto run = [&](auto zero) {
        using A = decltype(zero);
        auto ptr = [](const at::Tensor& x) -> const A* { return x.defined() ? x.data_ptr<A>() : nullptr; };
        distill_impl<S, T, A>(student, teacher, target, ptr(neg), ptr(al), ptr(rw), ptr(rs), ptr(rh), ptr(l1p),
                              S_rows,
                              segments, A(tau), A(ce_weight), A(kd_weight), ignore_index, not_true, soft_ce, prob,
                              loss, grad);
      };
      if (f64) run(double(0)); else run(float(0));
    });
  });
  return {loss, grad};
}

}  // namespace fedfast
