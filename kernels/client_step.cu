// Fused all-client optimizer step on the GPU, in place (formulas and order:
// fedfast/ops/client_step_reference.py): grid-stride over the n*P elements, one thread per element.
// Generic terms: L = lrows [n, P] (loss gradient), v = cvec [P] x s = cscale [n] and C = crows [n, P] x r = rcoef
// (correction, inside momentum), u = svec [P] x o = sscale [n] (step offset, outside momentum).
// Bytes: 20*n*P with momentum (theta r/w, grad r, buffer r/w) + 4nP per optional per-row input.
#include "common.cuh"
#include "fedfast_kernels.h"

using namespace fedfast_cuda;

__device__ __forceinline__ float loss_grad(const float* theta, const float* grad, int64_t i, int64_t j,
                                           float prox_mu, const float* anchor, const float* lrows) {
  float gv = grad[i];
  if (anchor) gv += prox_mu * (theta[i] - anchor[j]);
  if (lrows) gv += lrows[i];
  return gv;
}

__global__ void client_step_kernel(float* __restrict__ theta, const float* __restrict__ grad, int64_t n, int64_t P,
                                   const float* __restrict__ lr, int lr_row, const float* __restrict__ wd, int wd_row,
                                   float prox_mu, const float* __restrict__ anchor, const float* __restrict__ lrows,
                                   const float* __restrict__ clip, const float* __restrict__ cvec,
                                   const float* __restrict__ cscale, const float* __restrict__ crows, float rcoef,
                                   float momentum, float* __restrict__ buf, const float* __restrict__ svec,
                                   const float* __restrict__ sscale, const int8_t* __restrict__ active) {
  const int64_t total = n * P;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t k = i / P, j = i - k * P;
    if (active && !active[k]) continue;
    const float t = theta[i];
    float gv = loss_grad(theta, grad, i, j, prox_mu, anchor, lrows);
    if (clip) gv *= clip[k];
    gv += (wd_row ? wd[k] : wd[0]) * t;
    if (cvec && crows) gv += (cscale ? cscale[k] : 1.f) * cvec[j] + rcoef * crows[i];
    else if (cvec) gv += (cscale ? cscale[k] : 1.f) * cvec[j];
    else if (crows) gv += rcoef * crows[i];
    if (buf) {
      gv = momentum * buf[i] + gv;
      buf[i] = gv;
    }
    if (svec) gv += (sscale ? sscale[k] : 1.f) * svec[j];
    theta[i] = t - (lr_row ? lr[k] : lr[0]) * gv;
  }
}

__global__ void sqnorm_kernel(const float* __restrict__ theta, const float* __restrict__ grad, int64_t P,
                              float prox_mu, const float* __restrict__ anchor, const float* __restrict__ lrows,
                              float* __restrict__ sqnorm) {
  const int64_t k = blockIdx.y;
  float s = 0.f;
  for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < P; j += (int64_t)gridDim.x * blockDim.x) {
    const float gv = loss_grad(theta, grad, k * P + j, j, prox_mu, anchor, lrows);
    s += gv * gv;
  }
  s = warp_sum(s);
  if ((threadIdx.x % kWarp) == 0) atomicAdd(sqnorm + k, s);
}

static unsigned grid_for(int64_t total, int threads) {
  int64_t b = (total + threads - 1) / threads;
  return (unsigned)(b > 65535LL * 32 ? 65535LL * 32 : (b < 1 ? 1 : b));
}

extern "C" int fedfast_client_step(float* theta, const float* grad, int64_t n, int64_t P, const float* lr, int lr_row,
                                   const float* wd, int wd_row, float prox_mu, const float* anchor, const float* lrows,
                                   const float* clip, const float* cvec, const float* cscale, const float* crows,
                                   float rcoef, float momentum, float* buf, const float* svec, const float* sscale,
                                   const int8_t* active, cudaStream_t stream) {
  if (n * P == 0) return 0;
  client_step_kernel<<<grid_for(n * P, 256), 256, 0, stream>>>(theta, grad, n, P, lr, lr_row, wd, wd_row, prox_mu,
                                                               anchor, lrows, clip, cvec, cscale, crows, rcoef,
                                                               momentum, buf, svec, sscale, active);
  return (int)cudaGetLastError();
}

extern "C" int fedfast_client_grad_sqnorm(const float* theta, const float* grad, int64_t n, int64_t P, float prox_mu,
                                          const float* anchor, const float* lrows, float* sqnorm, cudaStream_t stream) {
  if (n * P == 0) return 0;
  unsigned bx = grid_for(P, 256);
  if (bx > 1024) bx = 1024;
  sqnorm_kernel<<<dim3(bx, (unsigned)n), 256, 0, stream>>>(theta, grad, P, prox_mu, anchor, lrows, sqnorm);
  return (int)cudaGetLastError();
}
