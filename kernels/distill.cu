// Fused CE + distillation rows on the GPU: loss and d(loss)/d(student) in one pass; one warp per row.
// Formula (FedNTD Eq. 10-11, FedGKD Eq. 3-5, ASD Eq. 5-11, FedCAD Eq. 5, FedADC+ Eq. 7-9): see
// fedfast/ops/distill_reference.py. Pass 1: row maxima; pass 2: sum-exps (re-read from L1/L2);
// pass 3: gradient store + loss terms. HBM bytes: R*C*(s + t + g) + 12R (s, t, g: element sizes).
#include "common.cuh"
#include "fedfast_kernels.h"

using namespace fedfast_cuda;

template <typename S, typename T, bool PROB, bool RHO>
__global__ void __launch_bounds__(kWarp * kRowsPerBlock)
distill_rows_kernel(const S* __restrict__ z, const T* __restrict__ t, const void* __restrict__ target, int target_i64,
                    const float* __restrict__ negent_in, const float* __restrict__ alpha,
                    const float* __restrict__ roww, const float* __restrict__ rscale, const float* __restrict__ rho_tab,
                    const float* __restrict__ l1p_tab, const void* __restrict__ segments, int seg_i64, int64_t S_rows,
                    float* __restrict__ loss, S* __restrict__ grad, int64_t R, int64_t C, float inv_tau, float ce_w,
                    float kd_w, int64_t ignore_index, bool not_true, bool soft_ce) {
  const int lane = threadIdx.x % kWarp;
  const int64_t row = (int64_t)blockIdx.x * kRowsPerBlock + threadIdx.x / kWarp;
  if (row >= R) return;
  const S* zr = z + row * C;
  const T* tr = t + row * C;
  S* gr = grad + row * C;
  int64_t y = load_index(target, target_i64, row);
  if (y == ignore_index || y < 0 || y >= C) {
    for (int64_t j = lane; j < C; j += kWarp) gr[j] = from_f<S>(0.f);
    if (lane == 0) loss[row] = 0.f;
    return;
  }
  const float* rho = nullptr;
  const float* l1p = nullptr;
  if (RHO) {
    int64_t s = (segments != nullptr && S_rows > 1) ? load_index(segments, seg_i64, row) : 0;
    s = s < 0 ? 0 : (s >= S_rows ? S_rows - 1 : s);
    rho = rho_tab + s * C;
    l1p = l1p_tab + s * C;
  }
  const float NINF = -CUDART_INF_F;
  // pass 1: maxima (and W = sum P in prob mode); bad: a NaN or +inf logit of the student, or of the teacher in a class
  // the loss reads, which makes the row's loss and gradient NaN (IEEE arithmetic on the formula; fmaxf drops NaN)
  float m1 = NINF, mq = NINF, mt = NINF, W = 0.f;
  bool bad = false;
  for (int64_t j = lane; j < C; j += kWarp) {
    const float zj = to_f(zr[j]);
    const bool drop = not_true && j == y;
    m1 = fmaxf(m1, zj);
    if (!drop) mq = fmaxf(mq, zj * inv_tau);
    const float tj = to_f(tr[j]);
    bad = bad || !(zj < CUDART_INF_F) || (!drop && !(tj < CUDART_INF_F));
    if (PROB) W += drop ? 0.f : tj;
    else if (!drop) mt = fmaxf(mt, tj * inv_tau);
  }
  bad = __any_sync(0xffffffffu, bad);
  m1 = safe_max(warp_max(m1));
  mq = safe_max(warp_max(mq));
  if (PROB) W = warp_sum(W);
  else { mt = safe_max(warp_max(mt)); W = 1.f; }
  // pass 2: sum-exps (and the FedADC+ moved mass); for the KL (a logit teacher, not soft_ce) the sums of expm1 too,
  // for its row constant log(st / sq) = log1p((et - eq) / (C + eq)) (excluded classes count -1): near-uniform rows at
  // a large tau keep their digits (fedfast/ops/distill_reference.py, _log_ratio)
  const bool kl = !PROB && !soft_ce;
  float s1 = 0.f, sq = 0.f, st = 0.f, mv = 0.f;
  double eq = 0.0, et = 0.0;  // fp64: fp32 sums of expm1 cost 1e-4 of the KL at tau = 1000
  for (int64_t j = lane; j < C; j += kWarp) {
    const float zj = to_f(zr[j]);
    const bool drop = not_true && j == y;
    s1 += expf(zj - m1);
    if (!drop) sq += expf(zj * inv_tau - mq);
    if (!PROB && !drop) {
      const float e = expf(to_f(tr[j]) * inv_tau - mt);
      st += e;
      if (RHO && j != y) mv += rho[j] * e;
    }
    if (kl) {
      eq += drop ? -1.0 : (double)expm1f(zj * inv_tau - mq);
      et += drop ? -1.0 : (double)expm1f(to_f(tr[j]) * inv_tau - mt);
    }
  }
  s1 = warp_sum(s1);
  sq = warp_sum(sq);
  if (!PROB) st = warp_sum(st);
  if (RHO) mv = warp_sum(mv);
  float K = 0.f;
  if (kl) {
    eq = warp_sum(eq);
    et = warp_sum(et);
    K = (float)log1p((et - eq) / ((double)C + eq));
  }
  // log q = (zq - mq) - log(sq): never form mq + log(sq) (digits lost for |logits| ~ 1e4)
  const float inv_s1 = 1.f / s1, inv_sq = 1.f / sq, lsq = logf(sq);
  const float inv_st = st > 0.f ? 1.f / st : 0.f;
  const float zy = to_f(zr[y]);
  float Py;
  if (not_true) Py = 0.f;
  else if (PROB) Py = to_f(tr[y]);
  else Py = expf(to_f(tr[y]) * inv_tau - mt) * inv_st + (RHO ? mv * inv_st : 0.f);
  float a = ce_w, b = kd_w;
  if (alpha) { const float al = alpha[y]; a *= 1.f - al; b *= al; }
  if (roww) b *= roww[row];
  if (rscale) { a *= rscale[row]; b *= rscale[row]; }
  const float kb = b * inv_tau;
  // pass 3: gradient and loss terms (D: the KL, or the soft cross-entropy)
  double D = 0.0;  // fp64: the KL's terms cancel
  for (int64_t j = lane; j < C; j += kWarp) {
    const float zj = to_f(zr[j]);
    const bool is_y = j == y;
    const bool drop = not_true && is_y;
    const float logq = drop ? NINF : (zj * inv_tau - mq) - lsq;
    const float q = drop ? 0.f : expf(zj * inv_tau - mq) * inv_sq;
    float P;
    if (is_y) P = Py;
    else if (PROB) P = to_f(tr[j]);
    else {
      const float p = expf(to_f(tr[j]) * inv_tau - mt) * inv_st;
      P = RHO ? (1.f - rho[j]) * p : p;
    }
    if (P > 0.f) {
      if (kl) {  // P (log P - log q), the log ratio formed before the sum
        float lr;
        if (RHO && is_y) lr = logf(P) - logq;
        else lr = ((to_f(tr[j]) * inv_tau - mt) - (zj * inv_tau - mq)) - K + (RHO ? l1p[j] : 0.f);
        D += (double)(P * lr);
      } else {
        D -= (double)(P * logq);
      }
    }
    const float g = a * (expf(zj - m1) * inv_s1 - (is_y ? 1.f : 0.f)) + kb * (W * q - P);
    gr[j] = from_f<S>(bad ? CUDART_NAN_F : g);
  }
  D = warp_sum(D);
  if (lane == 0) {
    if (PROB && !soft_ce) D += negent_in[row];
    const float ce = (m1 - zy) + logf(s1);
    loss[row] = bad ? CUDART_NAN_F : a * ce + b * (float)D;
  }
}

extern "C" int fedfast_distill_rows(const void* student, int s_dtype, const void* teacher, int t_dtype,
                                    const void* target, int target_i64, const float* negent, const float* class_alpha,
                                    const float* row_weight, const float* row_scale, const float* rho,
                                    const float* l1p, const void* segments,
                                    int seg_i64, int64_t S, float* loss, void* grad, int64_t R, int64_t C,
                                    float inv_tau, float ce_weight, float kd_weight, int64_t ignore_index,
                                    int not_true, int soft_ce, cudaStream_t stream) {
  if (R == 0) return 0;
  const dim3 block(kWarp * kRowsPerBlock), grid((unsigned)((R + kRowsPerBlock - 1) / kRowsPerBlock));
  const bool prob = negent != nullptr, has_rho = rho != nullptr;
  FEDFAST_DISPATCH_DTYPE(s_dtype, SD, FEDFAST_DISPATCH_DTYPE(t_dtype, TD, {
    auto args = [&](auto kern) {
      kern<<<grid, block, 0, stream>>>(static_cast<const SD*>(student), static_cast<const TD*>(teacher), target,
                                       target_i64, negent, class_alpha, row_weight, row_scale, rho, l1p, segments,
                                       seg_i64, S,
                                       loss, static_cast<SD*>(grad), R, C, inv_tau, ce_weight, kd_weight,
                                       ignore_index, not_true != 0, soft_ce != 0);
    };
    if (prob) args(distill_rows_kernel<SD, TD, true, false>);
    else if (has_rho) args(distill_rows_kernel<SD, TD, false, true>);
    else args(distill_rows_kernel<SD, TD, false, false>);
  }));
  return (int)cudaGetLastError();
}

template <typename G>
__global__ void scale_rows_kernel(const G* __restrict__ g, const float* __restrict__ s, G* __restrict__ out,
                                  int64_t N, int64_t C) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < N; i += (int64_t)gridDim.x * blockDim.x)
    out[i] = from_f<G>(to_f(g[i]) * s[i / C]);
}

extern "C" int fedfast_scale_rows(const void* grad, int g_dtype, const float* grad_loss, void* out, int64_t R,
                                  int64_t C, cudaStream_t stream) {
  const int64_t N = R * C;
  if (N == 0) return 0;
  const int threads = 256;
  int64_t blocks = (N + threads - 1) / threads;
  if (blocks > 65535LL * 16) blocks = 65535LL * 16;
  FEDFAST_DISPATCH_DTYPE(g_dtype, GD, {
    scale_rows_kernel<GD><<<(unsigned)blocks, threads, 0, stream>>>(static_cast<const GD*>(grad), grad_loss,
                                                                    static_cast<GD*>(out), N, C);
  });
  return (int)cudaGetLastError();
}
