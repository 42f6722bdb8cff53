// ASD un-normalised weights on the GPU (Yashwanth et al., Eq. 10-11), one warp per row:
//   out_i = exp(-H(softmax(t_i / entropy_tau))) / prior[s_i, y_i], H = lse - sum_c p_c x_c; 0 on ignored rows.
// Bytes: R*C*t (+ an L1/L2 re-read) + 12R.
#include "common.cuh"
#include "fedfast_kernels.h"

using namespace fedfast_cuda;

template <typename T>
__global__ void __launch_bounds__(kWarp * kRowsPerBlock)
asd_kernel(const T* __restrict__ t, const void* __restrict__ target, int target_i64, const float* __restrict__ prior,
           const void* __restrict__ segments, int seg_i64, int64_t S, float* __restrict__ out, int64_t R, int64_t C,
           float inv_tau, int64_t ignore_index) {
  const int lane = threadIdx.x % kWarp;
  const int64_t row = (int64_t)blockIdx.x * kRowsPerBlock + threadIdx.x / kWarp;
  if (row >= R) return;
  const int64_t y = load_index(target, target_i64, row);
  if (y == ignore_index || y < 0 || y >= C) {
    if (lane == 0) out[row] = 0.f;
    return;
  }
  const T* tr = t + row * C;
  float mx = -CUDART_INF_F;
  bool bad = false;  // a NaN or +inf logit: H and the weight NaN (fmaxf drops NaN)
  for (int64_t j = lane; j < C; j += kWarp) {
    const float x = to_f(tr[j]) * inv_tau;
    mx = fmaxf(mx, x);
    bad = bad || !(x < CUDART_INF_F);
  }
  bad = __any_sync(0xffffffffu, bad);
  mx = safe_max(warp_max(mx));
  float s = 0.f, u = 0.f;
  for (int64_t j = lane; j < C; j += kWarp) {
    const float x = to_f(tr[j]) * inv_tau - mx;
    const float e = expf(x);
    s += e;
    if (e > 0.f) u += e * x;
  }
  s = warp_sum(s);
  u = warp_sum(u);
  if (lane == 0) {
    const float H = bad ? CUDART_NAN_F : fmaxf(logf(s) - u / s, 0.f);
    int64_t sg = (segments != nullptr && S > 1) ? load_index(segments, seg_i64, row) : 0;
    sg = sg < 0 ? 0 : (sg >= S ? S - 1 : sg);
    out[row] = expf(-H) / prior[sg * C + y];
  }
}

extern "C" int fedfast_asd_weights(const void* teacher, int t_dtype, const void* target, int target_i64,
                                   const float* prior, const void* segments, int seg_i64, int64_t S, float* out,
                                   int64_t R, int64_t C, float inv_tau, int64_t ignore_index, cudaStream_t stream) {
  if (R == 0) return 0;
  const dim3 block(kWarp * kRowsPerBlock), grid((unsigned)((R + kRowsPerBlock - 1) / kRowsPerBlock));
  FEDFAST_DISPATCH_DTYPE(t_dtype, TD, {
    asd_kernel<TD><<<grid, block, 0, stream>>>(static_cast<const TD*>(teacher), target, target_i64, prior, segments,
                                               seg_i64, S, out, R, C, inv_tau, ignore_index);
  });
  return (int)cudaGetLastError();
}
