// Fused all-client Adam / AdamW step on the GPU, in place (formulas and order: fedfast/ops/client_adam_reference.py):
// grid-stride over the n*P elements, one thread per element. The per-row scalars (lr / (1 - b1^t_k),
// sqrt(1 - b2^t_k), 1 - lr_k wd_k) are [n] device tensors computed before the launch; clipping uses the SGD step's
// per-row squared-norm kernel. Bytes: 28*n*P (theta r/w, grad r, m r/w, v r/w) + 4nP with FedDyn's term.
#include "common.cuh"
#include "fedfast_kernels.h"

using namespace fedfast_cuda;

__global__ void client_adam_kernel(float* __restrict__ theta, const float* __restrict__ grad, int64_t n, int64_t P,
                                   float* __restrict__ m, float* __restrict__ v, const float* __restrict__ step_size,
                                   const float* __restrict__ bc2_sqrt, const float* __restrict__ wd, int wd_row,
                                   const float* __restrict__ decay, float b2, float w1, float w2, float eps,
                                   float prox_mu, const float* __restrict__ anchor, const float* __restrict__ lrows,
                                   const float* __restrict__ clip, const int8_t* __restrict__ active) {
  const int64_t total = n * P;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t k = i / P, j = i - k * P;
    if (active && !active[k]) continue;
    float t = theta[i];
    float gv = grad[i];
    if (anchor) gv += prox_mu * (t - anchor[j]);
    if (lrows) gv += lrows[i];
    if (clip) gv *= clip[k];
    if (decay)
      t *= decay[k];  // AdamW
    else
      gv += (wd_row ? wd[k] : wd[0]) * t;  // Adam: L2
    const float mo = w1 < 0.5f ? m[i] + w1 * (gv - m[i]) : gv - (gv - m[i]) * (1.f - w1);  // torch.lerp
    const float vo = v[i] * b2 + w2 * gv * gv;
    m[i] = mo;
    v[i] = vo;
    theta[i] = t - step_size[k] * (mo / (sqrtf(vo) / bc2_sqrt[k] + eps));
  }
}

static unsigned adam_grid(int64_t total, int threads) {
  int64_t b = (total + threads - 1) / threads;
  return (unsigned)(b > 65535LL * 32 ? 65535LL * 32 : (b < 1 ? 1 : b));
}

extern "C" int fedfast_client_adam(float* theta, const float* grad, int64_t n, int64_t P, float* m, float* v,
                                   const float* step_size, const float* bc2_sqrt, const float* wd, int wd_row,
                                   const float* decay, float b2, float w1, float w2, float eps, float prox_mu,
                                   const float* anchor, const float* lrows, const float* clip, const int8_t* active,
                                   cudaStream_t stream) {
  if (n * P == 0) return 0;
  client_adam_kernel<<<adam_grid(n * P, 256), 256, 0, stream>>>(theta, grad, n, P, m, v, step_size, bc2_sqrt, wd,
                                                                wd_row, decay, b2, w1, w2, eps, prox_mu, anchor, lrows,
                                                                clip, active);
  return (int)cudaGetLastError();
}
