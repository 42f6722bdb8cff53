// FedGKD-VOTE teacher mixture on the GPU (Yao et al., Eq. 5), one warp per row:
//   P_i = sum_m w_m softmax(t_mi / tau) (over c != y_i if not_true), negent_i = sum_m w_m sum_c p log p.
// Bytes: 2*M*R*C*t (max/sum pass + accumulate pass per teacher; 2nd read mostly L1/L2) + 4*R*C + 4R.
#include "common.cuh"
#include "fedfast_kernels.h"

using namespace fedfast_cuda;

template <typename T>
__global__ void __launch_bounds__(kWarp * kRowsPerBlock)
mixture_kernel(const T* __restrict__ t, const float* __restrict__ w, int64_t M, const void* __restrict__ target,
               int target_i64, float* __restrict__ P, float* __restrict__ negent, int64_t R, int64_t C, float inv_tau,
               int64_t ignore_index, bool not_true) {
  const int lane = threadIdx.x % kWarp;
  const int64_t row = (int64_t)blockIdx.x * kRowsPerBlock + threadIdx.x / kWarp;
  if (row >= R) return;
  int64_t y = load_index(target, target_i64, row);
  if (y == ignore_index || y < 0 || y >= C) y = -1;
  float* Pr = P + row * C;
  for (int64_t j = lane; j < C; j += kWarp) Pr[j] = 0.f;
  float ne = 0.f;
  bool bad = false;  // a NaN or +inf logit read in the row (any teacher): its P and negent NaN (fmaxf drops NaN)
  for (int64_t m = 0; m < M; ++m) {
    const T* tr = t + (m * R + row) * C;
    float mx = -CUDART_INF_F;
    for (int64_t j = lane; j < C; j += kWarp)
      if (!(not_true && j == y)) {
        const float x = to_f(tr[j]) * inv_tau;
        mx = fmaxf(mx, x);
        bad = bad || !(x < CUDART_INF_F);
      }
    mx = warp_max(mx);
    if (mx == -CUDART_INF_F) continue;
    float s = 0.f;
    for (int64_t j = lane; j < C; j += kWarp)
      if (!(not_true && j == y)) s += expf(to_f(tr[j]) * inv_tau - mx);
    s = warp_sum(s);
    const float ls = logf(s), inv_s = 1.f / s, wm = w[m];  // log p = (x - m) - log s
    float acc = 0.f;
    for (int64_t j = lane; j < C; j += kWarp) {
      if (not_true && j == y) continue;
      const float x = to_f(tr[j]) * inv_tau - mx;
      const float lp = x - ls;
      const float p = expf(x) * inv_s;
      if (p > 0.f) acc += p * lp;
      Pr[j] += wm * p;  // each lane owns its columns: no race
    }
    ne += wm * warp_sum(acc);
  }
  if (__any_sync(0xffffffffu, bad)) {
    for (int64_t j = lane; j < C; j += kWarp) Pr[j] = CUDART_NAN_F;
    ne = CUDART_NAN_F;
  }
  if (lane == 0) negent[row] = ne;
}

extern "C" int fedfast_teacher_mixture(const void* teachers, int t_dtype, const float* weights, int64_t M,
                                       const void* target, int target_i64, float* P, float* negent, int64_t R,
                                       int64_t C, float inv_tau, int64_t ignore_index, int not_true,
                                       cudaStream_t stream) {
  if (R == 0) return 0;
  const dim3 block(kWarp * kRowsPerBlock), grid((unsigned)((R + kRowsPerBlock - 1) / kRowsPerBlock));
  FEDFAST_DISPATCH_DTYPE(t_dtype, TD, {
    mixture_kernel<TD><<<grid, block, 0, stream>>>(static_cast<const TD*>(teachers), weights, M, target, target_i64,
                                                   P, negent, R, C, inv_tau, ignore_index, not_true != 0);
  });
  return (int)cudaGetLastError();
}
