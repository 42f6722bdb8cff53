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
  // the KL (a logit teacher, not soft_ce) needs the sums of expm1 too, for its row constant (below): U, V
  const bool kl = !PROB && !r.soft_ce;
  if (kl) {
    for (int64_t j = 0; j < C; ++j) EQ[j] = fexp_m1(ZQ[j] - mq, &U[j]);
    for (int64_t j = 0; j < C; ++j) ET[j] = fexp_m1(TT[j] - mt, &V[j]);
  } else {
    for (int64_t j = 0; j < C; ++j) EQ[j] = fexp(ZQ[j] - mq);
    if (!PROB)
      for (int64_t j = 0; j < C; ++j) ET[j] = fexp(TT[j] - mt);
  }
  const double dq = kl ? dsum64(U, C) : 0.0, dt = kl ? dsum64(V, C) : 0.0;
  const double s1 = dsum(E1, C), sq = dsum(EQ, C), st = PROB ? 0.0 : dsum(ET, C);
  const A W = PROB ? A(dsum(TT, C)) : A(1);
  // log q_j = (zq_j - mq) - log(sq): never form mq + log(sq) (loses digits for |logits| ~ 1e4)
  const A inv_s1 = A(1 / s1), inv_sq = A(1 / sq), lsq = A(std::log(sq));
  // st is 0 (every class excluded), >= 1, or NaN (a NaN or +inf teacher logit: the row's P, loss and gradient NaN)
  const A inv_st = st != 0 ? A(1 / st) : A(0);
  A mvd = 0;  // FedADC+: mass moved to the true class, sum_{c != y} rho_c p_c
  if (RHO) {
    const A* rho = r.rho;
    for (int64_t j = 0; j < C; ++j) U[j] = rho[j] * ET[j];  // (U's expm1 terms are summed already)
    U[y] = 0;
    mvd = A(dsum(U, C)) * inv_st;
  }
  const A a = r.a, kb = r.b * r.inv_tau;
  // True class y first (its terms are overwritten after the elementwise loops): P_y is the teacher prob,
  // plus the moved mass for FedADC+, and 0 for not-true.
  A Py;
  if (r.not_true) Py = 0;
  else if (PROB) Py = TT[y];
  else Py = RHO ? ET[y] * inv_st + mvd : ET[y] * inv_st;
  const A logqy = (ZQ[y] - mq) - lsq, qy = EQ[y] * inv_sq, smy = E1[y] * inv_s1;
  // In place: EQ <- q, E1 <- softmax(z), and (logit teacher) ET <- P.
  for (int64_t j = 0; j < C; ++j) EQ[j] *= inv_sq;
  for (int64_t j = 0; j < C; ++j) E1[j] *= inv_s1;
  if (!PROB) {
    if (RHO) {
      const A* __restrict rho = r.rho;
      for (int64_t j = 0; j < C; ++j) ET[j] = (A(1) - rho[j]) * (ET[j] * inv_st);
    } else {
      for (int64_t j = 0; j < C; ++j) ET[j] *= inv_st;
    }
  }
  const A* __restrict P = PROB ? TT : ET;
  // 0 * log 0 = 0: select the log (not the product) so the loops stay branch-free selects; P != 0, not P > 0, so
  // that a NaN P stays NaN.
  A D;  // the row's distillation term
  if (!kl) {  // the soft cross-entropy -sum P log q (plus a given mixture's negent)
    for (int64_t j = 0; j < C; ++j) ZQ[j] = (ZQ[j] - mq) - lsq;  // log q
    for (int64_t j = 0; j < C; ++j) U[j] = -P[j] * (P[j] != 0 ? ZQ[j] : A(0));
    U[y] = Py != 0 ? -Py * logqy : A(0);
    D = A(dsum(U, C)) + ((PROB && !r.soft_ce) ? r.negent_in : A(0));
  } else {  // KL(P || q) = sum_c P_c (log P_c - log q_c), the log ratio formed before the sum:
    // log p_c - log q_c = (tt_c - mt) - (zq_c - mq) - K, K = log(st / sq) from expm1 sums (see fexpm1)
    const A K = A(std::log1p((dt - dq) / (double(C) + dq)));
    if (RHO) {
      const A* __restrict l1p = r.l1p;
      for (int64_t j = 0; j < C; ++j)
        V[j] = P[j] != 0 ? P[j] * ((l1p[j] + ((TT[j] - mt) - (ZQ[j] - mq))) - K) : A(0);
      V[y] = Py != 0 ? Py * (A(std::log(Py)) - logqy) : A(0);
    } else {
      for (int64_t j = 0; j < C; ++j) V[j] = P[j] != 0 ? P[j] * (((TT[j] - mt) - (ZQ[j] - mq)) - K) : A(0);
    }
    D = A(dsum64(V, C));
  }
  for (int64_t j = 0; j < C; ++j) G[j] = a * E1[j] + kb * (W * EQ[j] - P[j]);
  G[y] = a * (smy - A(1)) + kb * (W * qy - Py);
  const A ce = (m1 - Z[y]) + A(std::log(s1));
  return a * ce + r.b * D;
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

// ---- Narrow rows (C <= kBlockMaxC): kBlock rows at once, laid out [C][kBlock] so that every loop runs across rows
// (a whole number of SIMD vectors, no remainder) and the per-row scalars (maxima, sums, logs) are vectors too.
// The same formula and order of operations as row_core; sums over classes as in dsum (A partials, fp64 total).
constexpr int64_t kBlock = 16;
constexpr int64_t kBlockMaxC = 128;  // the scratch, 11 x C x kBlock values (90 KB), stays in L2

template <typename A>
struct BlockArgs {
  int64_t C;
  int64_t y[kBlock];                  // target per lane (0 on lanes without a row)
  A a[kBlock], b[kBlock], negent_in[kBlock];
  A *Z, *ZQ, *TT, *E1, *EQ, *ET, *G, *U, *V, *RH, *L1P;  // scratch [C][kBlock]; RH, L1P: FedADC+ per lane
  A inv_tau;
  bool not_true, soft_ce;
};

#define FF_LANES for (int64_t l = 0; l < kBlock; ++l)
#define FF_EACH for (int64_t j = 0; j < C; ++j) _Pragma("omp simd") FF_LANES
// The exp pass's sums (fused with the pass itself; sums of stored arrays go through lane_sums): as lane_sums does,
// A partials over chunks of kLaneSumChunk classes folded into fp64 per lane.
#define FF_CHUNKS for (int64_t j0 = 0; j0 < C; j0 += kLaneSumChunk)
#define FF_CHUNK \
  for (int64_t j = j0, j1 = C < j0 + kLaneSumChunk ? C : j0 + kLaneSumChunk; j < j1; ++j) _Pragma("omp simd") FF_LANES

// Writes L into out[kBlock] and the gradient rows into G ([C][kBlock]).
template <typename A, bool PROB, bool RHO, bool KL>  // KL: a logit teacher, not soft_ce
__attribute__((always_inline)) inline void block_core(const BlockArgs<A>& r, A* __restrict out) {
  const int64_t C = r.C;
  A *__restrict Z = r.Z, *__restrict ZQ = r.ZQ, *__restrict TT = r.TT, *__restrict E1 = r.E1;
  A *__restrict EQ = r.EQ, *__restrict ET = r.ET, *__restrict G = r.G, *__restrict U = r.U, *__restrict V = r.V;
  const A ninf = neg_inf<A>();
  const int64_t* y = r.y;
  if (r.not_true) FF_LANES {
    ZQ[y[l] * kBlock + l] = ninf;
    TT[y[l] * kBlock + l] = PROB ? A(0) : ninf;
  }
  alignas(64) A m1[kBlock], mq[kBlock], mt[kBlock], s1[kBlock], sq[kBlock], st[kBlock], W[kBlock], mvd[kBlock];
  alignas(64) double d1[kBlock], dq[kBlock], dt[kBlock], dw[kBlock], dm[kBlock], dc[kBlock];
  FF_LANES { m1[l] = ninf; mq[l] = ninf; mt[l] = ninf; }
  FF_EACH {
    const int64_t k = j * kBlock + l;
    m1[l] = Z[k] > m1[l] ? Z[k] : m1[l];
    mq[l] = ZQ[k] > mq[l] ? ZQ[k] : mq[l];
    if (!PROB) mt[l] = TT[k] > mt[l] ? TT[k] : mt[l];
  }
#pragma omp simd
  FF_LANES {
    m1[l] = m1[l] == ninf ? A(0) : m1[l];
    mq[l] = mq[l] == ninf ? A(0) : mq[l];
    mt[l] = mt[l] == ninf ? A(0) : mt[l];
    d1[l] = 0; dq[l] = 0; dt[l] = 0; dw[l] = 0; dm[l] = 0; dc[l] = 0;
  }
  FF_CHUNKS {
    FF_LANES { s1[l] = 0; sq[l] = 0; st[l] = 0; W[l] = 0; }
    FF_CHUNK {
      const int64_t k = j * kBlock + l;
      E1[k] = fexp(Z[k] - m1[l]);
      EQ[k] = KL ? fexp_m1(ZQ[k] - mq[l], &U[k]) : fexp(ZQ[k] - mq[l]);
      s1[l] += E1[k];
      sq[l] += EQ[k];
      if (!PROB) {
        ET[k] = KL ? fexp_m1(TT[k] - mt[l], &V[k]) : fexp(TT[k] - mt[l]);
        st[l] += ET[k];
      } else {
        W[l] += TT[k];
      }
    }
    FF_LANES { d1[l] += s1[l]; dq[l] += sq[l]; dt[l] += st[l]; dw[l] += W[l]; }
  }
  FF_LANES { s1[l] = A(d1[l]); sq[l] = A(dq[l]); st[l] = A(dt[l]); W[l] = PROB ? A(dw[l]) : A(1); }
  alignas(64) A K[kBlock];  // the KL's row constant log(st / sq), from the expm1 sums of the exp pass (U, V)
  if (KL) {
    alignas(64) double ekq[kBlock], ekt[kBlock];
    FF_LANES { ekq[l] = 0; ekt[l] = 0; }
    lane_sums64<kBlock>(C, U, ekq);
    lane_sums64<kBlock>(C, V, ekt);
    FF_LANES K[l] = A(std::log1p((ekt[l] - ekq[l]) / (double(C) + ekq[l])));
  }
  alignas(64) A inv_s1[kBlock], inv_sq[kBlock], lsq[kBlock], ls1[kBlock], inv_st[kBlock];
#pragma omp simd
  FF_LANES {  // s1, sq >= 1 (the maximum's term is exp(0)); st is 0 or >= 1; each is NaN over a NaN or +inf logit
    inv_s1[l] = A(1) / s1[l];
    inv_sq[l] = A(1) / sq[l];
    lsq[l] = flog(sq[l]);
    ls1[l] = flog(s1[l]);
    inv_st[l] = st[l] != 0 ? A(1) / st[l] : A(0);
  }
  if (RHO) {
    FF_EACH {
      const int64_t k = j * kBlock + l;
      U[k] = r.RH[k] * ET[k];
    }
    FF_LANES U[y[l] * kBlock + l] = 0;
    lane_sums<kBlock>(C, U, dm);
#pragma omp simd
    FF_LANES mvd[l] = A(dm[l]) * inv_st[l];
  }
  // True class per lane (overwritten after the elementwise loops, as in row_core).
  alignas(64) A Py[kBlock], logqy[kBlock], qy[kBlock], smy[kBlock];
  FF_LANES {
    const int64_t k = y[l] * kBlock + l;
    if (r.not_true) Py[l] = 0;
    else if (PROB) Py[l] = TT[k];
    else Py[l] = RHO ? ET[k] * inv_st[l] + mvd[l] : ET[k] * inv_st[l];
    logqy[l] = (ZQ[k] - mq[l]) - lsq[l];
    qy[l] = EQ[k] * inv_sq[l];
    smy[l] = E1[k] * inv_s1[l];
  }
  const A kb_scale = r.inv_tau;
  // KL(P || q) with the log ratio formed before the sum (row_core); the soft cross-entropy otherwise
  FF_EACH {
    const int64_t k = j * kBlock + l;
    EQ[k] *= inv_sq[l];
    E1[k] *= inv_s1[l];
    if (!PROB) ET[k] = RHO ? (A(1) - r.RH[k]) * (ET[k] * inv_st[l]) : ET[k] * inv_st[l];
    const A P = PROB ? TT[k] : ET[k];
    G[k] = r.a[l] * E1[k] + (r.b[l] * kb_scale) * (W[l] * EQ[k] - P);
  }
  if (KL) {
    FF_EACH {
      const int64_t k = j * kBlock + l;
      const A lr = ((TT[k] - mt[l]) - (ZQ[k] - mq[l])) - K[l];
      V[k] = ET[k] != 0 ? ET[k] * (RHO ? r.L1P[k] + lr : lr) : A(0);
    }
  } else {
    FF_EACH {
      const int64_t k = j * kBlock + l;
      const A P = PROB ? TT[k] : ET[k];
      U[k] = -P * (P != 0 ? (ZQ[k] - mq[l]) - lsq[l] : A(0));
    }
  }
  FF_LANES {
    const int64_t k = y[l] * kBlock + l;
    if (!KL) U[k] = Py[l] != 0 ? -Py[l] * logqy[l] : A(0);
    else if (RHO) V[k] = Py[l] != 0 ? Py[l] * (A(std::log(Py[l])) - logqy[l]) : A(0);
    G[k] = r.a[l] * (smy[l] - A(1)) + (r.b[l] * kb_scale) * (W[l] * qy[l] - Py[l]);
  }
  if (KL) lane_sums64<kBlock>(C, V, dc);
  else lane_sums<kBlock>(C, U, dc);
  FF_LANES {
    const A ce = (m1[l] - Z[y[l] * kBlock + l]) + ls1[l];
    const A D = A(dc[l]) + ((PROB && !r.soft_ce) ? r.negent_in[l] : A(0));
    out[l] = r.a[l] * ce + r.b[l] * D;
  }
}
#undef FF_EACH
#undef FF_CHUNKS
#undef FF_CHUNK
#undef FF_LANES

template <typename A>
__attribute__((always_inline)) inline void block_dispatch(const BlockArgs<A>& r, bool prob, bool rho, A* out) {
  if (prob) return block_core<A, true, false, false>(r, out);
  if (r.soft_ce) return rho ? block_core<A, false, true, false>(r, out) : block_core<A, false, false, false>(r, out);
  return rho ? block_core<A, false, true, true>(r, out) : block_core<A, false, false, true>(r, out);
}

FEDFAST_MULTIVERSION_WIDE void block_f32(const BlockArgs<float>& r, bool prob, bool rho, float* out) {
  block_dispatch<float>(r, prob, rho, out);
}
void block_f64(const BlockArgs<double>& r, bool prob, bool rho, double* out) {
  block_dispatch<double>(r, prob, rho, out);
}
inline void block_any(const BlockArgs<float>& r, bool prob, bool rho, float* out) { block_f32(r, prob, rho, out); }
inline void block_any(const BlockArgs<double>& r, bool prob, bool rho, double* out) { block_f64(r, prob, rho, out); }

// FedGKD-VOTE inside the row op: the M teachers' mixture row P_i = sum_m w_m softmax(t_mi / tau) (over c != y with
// not_true) and its negent_i, as fedfast/ops/teacher_mixture.py computes them, into P [C]; X, E, U are scratch.
// The [R, C] mixture is never stored (one logits-sized buffer fewer than the two-op path).
template <typename A>
struct Mix {
  int64_t M = 0;  // 0: no mixture (the teacher is logits or a precomputed P)
  int64_t R = 0;
  const A* w = nullptr;
};

template <typename T, typename A>
__attribute__((always_inline)) inline A mixture_row_core(const T* tp, const Mix<A>& mix, int64_t C, int64_t i,
                                                         int64_t y, bool not_true, A inv_tau, A* X, A* E, A* P,
                                                         A* U) {
  for (int64_t j = 0; j < C; ++j) P[j] = 0;
  A ne = 0;
  for (int64_t m = 0; m < mix.M; ++m) {
    const T* ti = tp + (m * mix.R + i) * C;
    for (int64_t j = 0; j < C; ++j) X[j] = static_cast<A>(ti[j]) * inv_tau;
    if (not_true) X[y] = neg_inf<A>();
    ne += mix_core(C, X, E, P, U, mix.w[m]);
  }
  return ne;
}
template <typename T>
FEDFAST_MULTIVERSION float mixture_row_f32(const T* tp, const Mix<float>& mix, int64_t C, int64_t i, int64_t y,
                                           bool not_true, float inv_tau, float* X, float* E, float* P, float* U) {
  return mixture_row_core<T, float>(tp, mix, C, i, y, not_true, inv_tau, X, E, P, U);
}
template <typename T>
inline float mixture_row(const T* tp, const Mix<float>& mix, int64_t C, int64_t i, int64_t y, bool not_true,
                         float inv_tau, float* X, float* E, float* P, float* U) {
  return mixture_row_f32<T>(tp, mix, C, i, y, not_true, inv_tau, X, E, P, U);
}
template <typename T>
inline double mixture_row(const T* tp, const Mix<double>& mix, int64_t C, int64_t i, int64_t y, bool not_true,
                          double inv_tau, double* X, double* E, double* P, double* U) {
  return mixture_row_core<T, double>(tp, mix, C, i, y, not_true, inv_tau, X, E, P, U);
}

// FedGKD-VOTE's mixture for kBlock rows at once: X [C][kBlock] holds t_m / tau of one teacher (-inf at masked
// entries); adds w * softmax(X) into P and w * sum p log p into ne, per lane (mix_core across rows).
template <typename A>
__attribute__((always_inline)) inline void mix_block_core(int64_t C, A* __restrict X, A* __restrict E,
                                                          A* __restrict P, A* __restrict ne, A w) {
  alignas(64) A m[kBlock], inv[kBlock], ls[kBlock];
  alignas(64) double ds[kBlock], dd[kBlock];
  for (int64_t l = 0; l < kBlock; ++l) { m[l] = neg_inf<A>(); ds[l] = 0; dd[l] = 0; }
  for (int64_t j = 0; j < C; ++j)
#pragma omp simd
    for (int64_t l = 0; l < kBlock; ++l) m[l] = X[j * kBlock + l] > m[l] ? X[j * kBlock + l] : m[l];
  for (int64_t l = 0; l < kBlock; ++l) m[l] = m[l] == neg_inf<A>() ? A(0) : m[l];  // an all -inf row adds nothing
  for (int64_t j = 0; j < C; ++j)
#pragma omp simd
    for (int64_t l = 0; l < kBlock; ++l) {
      X[j * kBlock + l] -= m[l];
      E[j * kBlock + l] = fexp(X[j * kBlock + l]);
    }
  lane_sums<kBlock>(C, E, ds);
  for (int64_t l = 0; l < kBlock; ++l) {
    inv[l] = ds[l] != 0 ? A(1 / ds[l]) : A(0);  // NaN over a NaN or +inf logit: the row's P and negent NaN
    ls[l] = ds[l] != 0 ? A(std::log(ds[l])) : A(0);
  }
  for (int64_t j = 0; j < C; ++j)
#pragma omp simd
    for (int64_t l = 0; l < kBlock; ++l) {
      const int64_t k = j * kBlock + l;
      const A p = E[k] * inv[l];
      X[k] = p != 0 ? p * (X[k] - ls[l]) : A(0);  // p log p, log p = (x - m) - log s
      P[k] += w * p;
    }
  lane_sums<kBlock>(C, X, dd);
  for (int64_t l = 0; l < kBlock; ++l) ne[l] += w * A(dd[l]);
}
FEDFAST_MULTIVERSION_WIDE void mix_block_f32(int64_t C, float* X, float* E, float* P, float* ne, float w) {
  mix_block_core<float>(C, X, E, P, ne, w);
}
inline void mix_block(int64_t C, float* X, float* E, float* P, float* ne, float w) { mix_block_f32(C, X, E, P, ne, w); }
inline void mix_block(int64_t C, double* X, double* E, double* P, double* ne, double w) {
  mix_block_core<double>(C, X, E, P, ne, w);
}

// The op's terms as the row loops read them, in the accumulation type A: the targets and segments, the teacher as
// probabilities with its negative entropy (negent; prob) or as M teachers to mix (mix), the class weights alpha, the
// KD row weights, the reduction weights rscale, FedADC+'s rho with log1p(-rho) (S_rows rows), 1 / tau and the weights.
template <typename A>
struct Terms {
  const at::Tensor* target = nullptr;
  const c10::optional<at::Tensor>* segments = nullptr;
  const A *negent = nullptr, *alpha = nullptr, *roww = nullptr, *rscale = nullptr, *rho = nullptr, *l1p = nullptr;
  int64_t S_rows = 1, ignore_index = -100;
  A inv_tau = 1, ce_w = 0, kd_w = 0;
  bool not_true = false, soft_ce = false, prob = false;
  Mix<A> mix;
};

// A Terms record's fields as locals of the same names: the row loops read them from registers, not through the
// reference (which stores through the float pointers could alias).
#define FF_TERMS_AS_LOCALS(t)                                                                                      \
  const at::Tensor& target = *(t).target;                                                                          \
  const c10::optional<at::Tensor>& segments = *(t).segments;                                                       \
  const A *negent = (t).negent, *alpha = (t).alpha, *roww = (t).roww, *rscale = (t).rscale, *rho = (t).rho;       \
  const A* l1p = (t).l1p;                                                                                          \
  const int64_t S_rows = (t).S_rows, ignore_index = (t).ignore_index;                                              \
  const A inv_tau = (t).inv_tau, ce_w = (t).ce_w, kd_w = (t).kd_w;                                                 \
  const bool not_true = (t).not_true, soft_ce = (t).soft_ce, prob = (t).prob;                                      \
  const Mix<A>& mix = (t).mix

// Narrow rows: kBlock rows per step, gathered into [C][kBlock] scratch and scattered back (see block_core).
template <typename S, typename T, typename A>
void distill_blocks(const S* zp, const T* tp, S* gp, A* lp, int64_t R, int64_t C, const Terms<A>& t) {
  FF_TERMS_AS_LOCALS(t);
  const int64_t nblocks = (R + kBlock - 1) / kBlock;
  const int64_t grain = std::max<int64_t>(1, 16384 / (kBlock * C));
  at::parallel_for(0, nblocks, grain, [&](int64_t begin, int64_t end) {
    const int64_t n = C * kBlock;
    std::vector<A> buf((rho ? 11 : 9) * n);
    BlockArgs<A> r;
    r.C = C;
    r.Z = buf.data(); r.ZQ = r.Z + n; r.TT = r.ZQ + n; r.E1 = r.TT + n; r.EQ = r.E1 + n; r.ET = r.EQ + n;
    r.G = r.ET + n; r.U = r.G + n; r.V = r.U + n;
    r.RH = rho ? r.V + n : nullptr;
    r.L1P = rho ? r.RH + n : nullptr;
    r.inv_tau = inv_tau;
    r.not_true = not_true;
    r.soft_ce = soft_ce;
    alignas(64) A out[kBlock];
    bool live[kBlock];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t i0 = blk * kBlock;
      for (int64_t l = 0; l < kBlock; ++l) {
        const int64_t i = i0 + l;
        const int64_t y = i < R ? row_target(target, i, C, ignore_index) : -1;
        live[l] = y >= 0;
        r.y[l] = live[l] ? y : 0;
        if (!live[l]) {  // a lane without a row (tail, ignored target): zeros, weights 0, output not used
          for (int64_t j = 0; j < C; ++j) r.Z[j * kBlock + l] = r.ZQ[j * kBlock + l] = r.TT[j * kBlock + l] = 0;
          if (rho)
            for (int64_t j = 0; j < C; ++j) r.RH[j * kBlock + l] = r.L1P[j * kBlock + l] = 0;
          r.a[l] = r.b[l] = r.negent_in[l] = 0;
          if (prob) r.TT[l] = 1;  // a probability row summing to 1
          continue;
        }
        const S* zi = zp + i * C;
        const T* ti = tp + i * C;
        for (int64_t j = 0; j < C; ++j) {
          const A zj = static_cast<A>(zi[j]);
          r.Z[j * kBlock + l] = zj;
          r.ZQ[j * kBlock + l] = zj * inv_tau;
        }
        if (!mix.M) {
          for (int64_t j = 0; j < C; ++j)
            r.TT[j * kBlock + l] = prob ? static_cast<A>(ti[j]) : static_cast<A>(ti[j]) * inv_tau;
          r.negent_in[l] = prob ? negent[i] : A(0);
        }
        if (rho) {
          const int64_t s = row_segment(segments, i, S_rows);
          for (int64_t j = 0; j < C; ++j) {
            r.RH[j * kBlock + l] = rho[s * C + j];
            r.L1P[j * kBlock + l] = l1p[s * C + j];
          }
        }
        const A al = alpha ? alpha[y] : A(0);
        const A sc = rscale ? rscale[i] : A(1);
        r.a[l] = (alpha ? ce_w * (A(1) - al) : ce_w) * sc;
        r.b[l] = (alpha ? kd_w * al : kd_w) * (roww ? roww[i] : A(1)) * sc;
      }
      if (mix.M) {  // the teachers' mixture into TT and negent_in, all lanes at once (E1, EQ as scratch)
        for (int64_t k = 0; k < n; ++k) r.TT[k] = 0;
        for (int64_t l = 0; l < kBlock; ++l) r.negent_in[l] = 0;
        for (int64_t m = 0; m < mix.M; ++m) {
          for (int64_t l = 0; l < kBlock; ++l) {
            const int64_t i = i0 + l;
            const T* ti = tp + (m * mix.R + (live[l] ? i : 0)) * C;
            for (int64_t j = 0; j < C; ++j) r.E1[j * kBlock + l] = live[l] ? static_cast<A>(ti[j]) * inv_tau : A(0);
            if (not_true) r.E1[r.y[l] * kBlock + l] = neg_inf<A>();
          }
          mix_block(C, r.E1, r.EQ, r.TT, r.negent_in, mix.w[m]);
        }
      }
      block_any(r, prob, rho != nullptr, out);
      for (int64_t l = 0; l < kBlock && i0 + l < R; ++l) {
        S* gi = gp + (i0 + l) * C;
        if (!live[l]) {
          for (int64_t j = 0; j < C; ++j) gi[j] = S(0);
          lp[i0 + l] = 0;
          continue;
        }
        for (int64_t j = 0; j < C; ++j) gi[j] = static_cast<S>(r.G[j * kBlock + l]);
        lp[i0 + l] = out[l];
      }
    }
  });
}

template <typename S, typename T, typename A>
void distill_impl(const at::Tensor& student, const at::Tensor& teacher, const Terms<A>& t, at::Tensor& loss,
                  at::Tensor& grad) {
  const int64_t R = student.size(0), C = student.size(1);
  const S* zp = student.data_ptr<S>();
  const T* tp = teacher.data_ptr<T>();
  S* gp = grad.data_ptr<S>();
  A* lp = loss.data_ptr<A>();
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(C, 1));
  if (C <= kBlockMaxC) {
    distill_blocks<S, T, A>(zp, tp, gp, lp, R, C, t);
    return;
  }
  FF_TERMS_AS_LOCALS(t);
  at::parallel_for(0, R, grain, [&](int64_t begin, int64_t end) {
    std::vector<A> buf((mix.M ? 12 : 9) * C);
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
      A ne = prob && !mix.M ? negent[i] : A(0);
      if (mix.M) {
        A* X = r.V + C;
        ne = mixture_row(tp, mix, C, i, y, not_true, inv_tau, X, X + C, r.TT, X + 2 * C);
      } else if (prob) {
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
      r.negent_in = ne;
      lp[i] = row_any(r, prob);
      for (int64_t j = 0; j < C; ++j) gi[j] = static_cast<S>(r.G[j]);
    }
  });
}

}  // namespace

namespace {
std::tuple<at::Tensor, at::Tensor> distill_run(
    const at::Tensor& student_in, const at::Tensor& teacher_in, const at::Tensor& target_in,
    const c10::optional<at::Tensor>& teacher_negent, const c10::optional<at::Tensor>& mix_weights,
    const c10::optional<at::Tensor>& class_alpha, const c10::optional<at::Tensor>& row_weight,
    const c10::optional<at::Tensor>& rho, const c10::optional<at::Tensor>& segments_in,
    const c10::optional<at::Tensor>& row_scale, double tau, double ce_weight, double kd_weight, int64_t ignore_index,
    bool not_true, bool soft_ce, bool in_place = false) {
  const bool mixing = mix_weights.has_value();
  TORCH_CHECK(student_in.dim() == 2, "student must be [R, C]");
  if (mixing) {
    TORCH_CHECK(teacher_in.dim() == 3 && teacher_in.size(1) == student_in.size(0) &&
                    teacher_in.size(2) == student_in.size(1) && mix_weights->dim() == 1 &&
                    mix_weights->size(0) == teacher_in.size(0),
                "teachers must be [M, R, C] with weights [M]");
  } else {
    TORCH_CHECK(teacher_in.sizes() == student_in.sizes(), "student/teacher shape mismatch");
  }
  TORCH_CHECK(target_in.dim() == 1 && target_in.size(0) == student_in.size(0), "target shape mismatch");
  TORCH_CHECK(student_in.size(1) >= 2, "need C >= 2");
  const at::Tensor student = student_in.contiguous(), teacher = teacher_in.contiguous();
  const at::Tensor target = target_in.contiguous();
  c10::optional<at::Tensor> segments;
  if (segments_in.has_value()) segments = segments_in->contiguous();
  const bool f64 = student.scalar_type() == at::kDouble;
  const auto acc = f64 ? at::kDouble : at::kFloat;
  auto loss = at::empty({student.size(0)}, student.options().dtype(acc));
  // in place: each row (or block of rows) is read whole into the scratch before its gradient is written over it
  TORCH_CHECK(!in_place || student.is_same(student_in), "in place: the student must be contiguous");
  auto grad = in_place ? student : at::empty_like(student);
  auto as_acc = [&](const c10::optional<at::Tensor>& x) -> at::Tensor {
    return x.has_value() ? x->to(acc).contiguous() : at::Tensor();
  };
  at::Tensor neg = as_acc(teacher_negent), al = as_acc(class_alpha), rw = as_acc(row_weight), rh = as_acc(rho);
  at::Tensor rs = as_acc(row_scale), mw = as_acc(mix_weights);
  at::Tensor l1p = rh.defined() ? at::log1p(-rh) : at::Tensor();
  const int64_t S_rows = rh.defined() ? rh.size(0) : 1;
  const bool prob = neg.defined() || mixing;
  if (prob) TORCH_CHECK(!rh.defined(), "rho needs teacher logits");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, student.scalar_type(), "distill_rows_cpu_s", [&] {
    using S = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, teacher.scalar_type(), "distill_rows_cpu_t", [&] {
      using T = scalar_t;
      with_acc(f64, [&](auto zero) {
        using A = decltype(zero);
        auto ptr = [](const at::Tensor& x) -> const A* { return x.defined() ? x.data_ptr<A>() : nullptr; };
        Terms<A> t;
        t.target = &target;
        t.segments = &segments;
        t.negent = ptr(neg); t.alpha = ptr(al); t.roww = ptr(rw); t.rscale = ptr(rs); t.rho = ptr(rh);
        t.l1p = ptr(l1p);
        t.S_rows = S_rows;
        t.ignore_index = ignore_index;
        t.inv_tau = A(1) / A(tau);
        t.ce_w = A(ce_weight);
        t.kd_w = A(kd_weight);
        t.not_true = not_true; t.soft_ce = soft_ce; t.prob = prob;
        if (mixing) {
          t.mix.M = teacher.size(0);
          t.mix.R = teacher.size(1);
          t.mix.w = ptr(mw);
        }
        distill_impl<S, T, A>(student, teacher, t, loss, grad);
      });
    });
  });
  return {loss, grad};
}
}  // namespace

// The op's one entry point (op_signatures.h): plain, FedGKD-VOTE's mixture (mix_weights; teacher [M, R, C]), ASD's
// KD row weights from the teacher in the same call (class_prior [C] or [S, C], entropy_tau; status: the prior check's
// result, asd_row_weight_cpu's), and in place (dL/dz over the contiguous student; a chunked caller's logits).
FEDFAST_DISTILL_ROWS(distill_rows_cpu) {
  c10::optional<at::Tensor> rw = row_weight;
  int64_t status = 0;
  if (class_prior.has_value()) {
    TORCH_CHECK(!row_weight.has_value() && !teacher_negent.has_value() && !mix_weights.has_value(),
                "class_prior: ASD's row weights come from one teacher's logits (no row_weight, teacher_negent or "
                "mix_weights)");
    TORCH_CHECK(teacher.sizes() == student.sizes(), "student/teacher shape mismatch");
    auto [w, st] = asd_row_weight_cpu(teacher, target, *class_prior, segments, entropy_tau, ignore_index);
    rw = w;
    status = st;
  }
  auto [loss, grad] = distill_run(student, teacher, target, teacher_negent, mix_weights, class_alpha, rw, rho, segments,
                                  row_scale, tau, ce_weight, kd_weight, ignore_index, not_true, soft_ce, in_place);
  return {loss, grad, status};
}

}  // namespace fedfast
