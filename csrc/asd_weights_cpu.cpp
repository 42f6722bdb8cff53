// ASD un-normalised weights on the CPU (Yashwanth et al., Eq. 10-11), see fedfast/ops/asd_weights.py:
//   alphahat_i = exp(-H(softmax(t_i / entropy_tau))) / prior[s_i, y_i],  0 on ignored rows.
// H = lse - sum_c p_c x_c with x = t / entropy_tau. Bytes: reads R*C*t + 12R, writes 4R.
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

#include "fedfast_cpu.h"
#include "row_math.h"

namespace fedfast {
namespace {

// Entropy of softmax(X): H = log s - sum_c e_c (x_c - m) / s. E and U are scratch rows.
template <typename A>
__attribute__((always_inline)) inline A entropy_core(int64_t C, A* __restrict X, A* __restrict E) {
  A m;
  const double s = row_exp(C, X, E, &m);
  if (s == 0) return A(0);  // NaN s: a NaN or +inf logit, H NaN
  for (int64_t j = 0; j < C; ++j) X[j] = E[j] != 0 ? E[j] * (X[j] - m) : A(0);
  const double H = std::log(s) - dsum(X, C) / s;
  return H < 0 ? A(0) : A(H);  // rounding below 0 clamped; NaN kept
}
FEDFAST_MULTIVERSION float entropy_f32(int64_t C, float* X, float* E) { return entropy_core<float>(C, X, E); }
inline float entropy_any(int64_t C, float* X, float* E) { return entropy_f32(C, X, E); }
inline double entropy_any(int64_t C, double* X, double* E) { return entropy_core<double>(C, X, E); }

// Narrow rows (C <= 128): 16 rows at once, laid out [C][16] so that every loop runs across rows (as the
// distillation kernel's narrow path, csrc/distill_cpu.cpp); sums in fp32 chunks of 32 classes folded into fp64.
constexpr int64_t kLanes = 16;
template <typename A>
__attribute__((always_inline)) inline void entropy_block(int64_t C, A* __restrict X, A* __restrict E,
                                                        A* __restrict H) {
  alignas(64) A m[kLanes];
  alignas(64) double ds[kLanes], dd[kLanes];
  bool none[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) { m[l] = neg_inf<A>(); ds[l] = 0; dd[l] = 0; }
  for (int64_t j = 0; j < C; ++j)
#pragma omp simd
    for (int64_t l = 0; l < kLanes; ++l) m[l] = X[j * kLanes + l] > m[l] ? X[j * kLanes + l] : m[l];
  for (int64_t l = 0; l < kLanes; ++l) {
    none[l] = m[l] == neg_inf<A>();
    m[l] = none[l] ? A(0) : m[l];
  }
  for (int64_t j = 0; j < C; ++j)
#pragma omp simd
    for (int64_t l = 0; l < kLanes; ++l) {
      X[j * kLanes + l] -= m[l];
      E[j * kLanes + l] = fexp(X[j * kLanes + l]);
    }
  for (int64_t j = 0; j < C; ++j)
#pragma omp simd
    for (int64_t l = 0; l < kLanes; ++l) {
      const int64_t k = j * kLanes + l;
      X[k] = E[k] != 0 ? E[k] * X[k] : A(0);
    }
  lane_sums<kLanes>(C, E, ds);
  lane_sums<kLanes>(C, X, dd);
  for (int64_t l = 0; l < kLanes; ++l) {
    const double h = ds[l] != 0 ? std::log(ds[l]) - dd[l] / ds[l] : 0.0;  // NaN over a NaN or +inf logit
    H[l] = (none[l] || h < 0) ? A(0) : A(h);
  }
}
FEDFAST_MULTIVERSION_WIDE void entropy_block_f32(int64_t C, float* X, float* E, float* H) {
  entropy_block<float>(C, X, E, H);
}
inline void entropy_block_any(int64_t C, float* X, float* E, float* H) { entropy_block_f32(C, X, E, H); }
inline void entropy_block_any(int64_t C, double* X, double* E, double* H) { entropy_block<double>(C, X, E, H); }

}  // namespace

FEDFAST_ASD_WEIGHTS(asd_weights_cpu) {
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
  dispatch_logits(teacher, [&](auto t0, auto a0) {
    using T = decltype(t0);
    using A = decltype(a0);
    const T* tp = teacher.data_ptr<T>();
    const A* pp = prior.data_ptr<A>();
    A* op = out.data_ptr<A>();
    const A inv_tau = A(1) / A(entropy_tau);
    if (C <= 128) {
      const int64_t nb = (R + kLanes - 1) / kLanes;
      at::parallel_for(0, nb, std::max<int64_t>(1, 16384 / (C * kLanes)), [&](int64_t b, int64_t e) {
        std::vector<A> X(C * kLanes), E(C * kLanes);
        alignas(64) A H[kLanes];
        int64_t ys[kLanes];
        for (int64_t blk = b; blk < e; ++blk) {
          for (int64_t l = 0; l < kLanes; ++l) {
            const int64_t i = blk * kLanes + l;
            ys[l] = i < R ? row_target(target, i, C, ignore_index) : -1;
            const T* ti = tp + (ys[l] >= 0 ? i : 0) * C;
            for (int64_t j = 0; j < C; ++j) X[j * kLanes + l] = ys[l] >= 0 ? static_cast<A>(ti[j]) * inv_tau : A(0);
          }
          entropy_block_any(C, X.data(), E.data(), H);
          for (int64_t l = 0; l < kLanes && blk * kLanes + l < R; ++l) {
            const int64_t i = blk * kLanes + l;
            op[i] = ys[l] < 0 ? A(0) : std::exp(-H[l]) / pp[row_segment(segments, i, S) * C + ys[l]];
          }
        }
      });
      return;
    }
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
  });
  return out;
}

// ASD KD row weights in one call (the eager CPU path of fedfast.ops.asd_row_weights): alphahat as above, then
// rw_i = n_seg(i) alphahat_i / sum_{j in seg(i)} alphahat_j on valid rows (0 elsewhere), sums in fp64, with
// segment ids clamped to [0, R) as fedfast/ops/asd_weights.py's asd_row_weight does. status bit 0: class_prior
// has a negative or non-finite entry, or is not > 0 at (segment, target) of a valid row; bit 1: a target outside
// [0, C) that is not ignore_index; bit 2: segments not sorted or outside [0, R).
FEDFAST_ASD_ROW_WEIGHT(asd_row_weight_cpu) {
  const at::Tensor& teacher = teacher_in;
  const at::Tensor target = target_in.contiguous();
  c10::optional<at::Tensor> segments;
  if (segments_in.has_value()) segments = segments_in->contiguous();
  at::Tensor ahat = asd_weights_cpu(teacher, target, class_prior, segments, entropy_tau, ignore_index);
  const int64_t R = teacher.size(0), C = teacher.size(1);
  const at::Tensor prior = class_prior.to(at::kDouble).contiguous();
  const int64_t S = prior.size(0);
  const double* pp = prior.data_ptr<double>();
  int64_t status = 0;
  for (int64_t k = 0; k < S * C; ++k)
    if (!(pp[k] >= 0) || !std::isfinite(pp[k])) status |= 1;
  std::vector<double> sums(R > 0 ? R : 1, 0.0);
  std::vector<int64_t> counts(R > 0 ? R : 1, 0), seg(R), ys(R);
  for (int64_t i = 0; i < R; ++i) {
    ys[i] = row_target(target, i, C, ignore_index);
    const int64_t yr = target.scalar_type() == at::kLong ? target.data_ptr<int64_t>()[i]
                                                         : static_cast<int64_t>(target.data_ptr<int32_t>()[i]);
    if (ys[i] < 0 && yr != ignore_index) status |= 2;
    if (segments.has_value()) {
      const at::Tensor& sg = *segments;
      const int64_t v = sg.scalar_type() == at::kLong ? sg.data_ptr<int64_t>()[i]
                                                      : static_cast<int64_t>(sg.data_ptr<int32_t>()[i]);
      if (v < 0 || v >= R || (i > 0 && v < seg[i - 1])) status |= 4;
    }
    seg[i] = row_segment(segments, i, R);
    if (ys[i] < 0) continue;
    if (!(pp[row_segment(segments, i, S) * C + ys[i]] > 0)) status |= 1;
  }
  AT_DISPATCH_FLOATING_TYPES(ahat.scalar_type(), "asd_row_weight_cpu", [&] {
    scalar_t* a = ahat.data_ptr<scalar_t>();
    for (int64_t i = 0; i < R; ++i) {
      if (ys[i] < 0) continue;
      sums[seg[i]] += static_cast<double>(a[i]);
      counts[seg[i]] += 1;
    }
    const double tiny = std::numeric_limits<scalar_t>::min();
    for (int64_t i = 0; i < R; ++i) {
      const double tot = sums[seg[i]] < tiny ? tiny : sums[seg[i]];  // a NaN sum (a NaN weight) stays NaN
      a[i] = ys[i] < 0 ? scalar_t(0) : static_cast<scalar_t>(static_cast<double>(a[i]) * counts[seg[i]] / tot);
    }
  });
  return {ahat, status};
}

}  // namespace fedfast
