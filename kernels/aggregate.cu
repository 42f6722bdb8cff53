// Fused server update on the GPU: one thread per column streams the n participating rows once
// (coalesced across the warp), then applies the server rule, the optional per-client state-row update
// R_k' = (R_k + shift) + a_k (X_k - g) with the column sum of its changes, and the ring-buffer write
// (formulas: fedfast/ops/aggregate_reference.py). Bytes: n*P*x + 4P*(2 + 2*[m]) + 8nP with state rows
// + 4P [ring]; the floor for the plain average is 4P(n + 1).
#include "common.cuh"
#include "fedfast_kernels.h"

using namespace fedfast_cuda;

template <typename X>
__global__ void aggregate_kernel(const X* __restrict__ x, const int64_t* __restrict__ rows, int64_t n, int64_t P,
                                 const float* __restrict__ w, const float* __restrict__ g, float beta, float scale,
                                 float lr, const float* __restrict__ m, float* __restrict__ m_out,
                                 const float* __restrict__ r, float* __restrict__ r_out,
                                 const float* __restrict__ coef, const float* __restrict__ shift,
                                 float* __restrict__ change, float* __restrict__ ring, int64_t slot,
                                 float* __restrict__ g_out, float* __restrict__ avg_out, int* __restrict__ bad) {
  const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= P) return;
  float acc = 0.f;
  for (int64_t k = 0; k < n; ++k) {
    const float v = to_f(x[rows[k] * P + j]);
    acc += w[k] * v;
    if (!isfinite(v)) atomicMax(bad + k, 1);
  }
  const float gj = g[j];
  const float mm = (m ? beta * m[j] : 0.f) + scale * (gj - acc);
  if (m_out) m_out[j] = mm;
  const float newg = gj - lr * mm;
  if (r) {  // R_k' = (R_k + shift) + a_k (X_k - g) ; change = sum_k (R_k' - R_k)
    const float sh = shift ? shift[j] : 0.f;
    float dc = 0.f;
    for (int64_t k = 0; k < n; ++k) {
      const float old = r[k * P + j];
      const float v = (shift ? old + sh : old) + coef[k] * (to_f(x[rows[k] * P + j]) - gj);
      r_out[k * P + j] = v;
      dc += v - old;
    }
    change[j] = dc;
  }
  g_out[j] = newg;
  avg_out[j] = acc;
  if (!isfinite(acc)) atomicMax(bad + n, 1);
  if (ring) ring[slot * P + j] = newg;
}

extern "C" int fedfast_aggregate(const void* X, int x_dtype, const int64_t* rows, int64_t n, int64_t P,
                                 const float* w, const float* g, float beta, float scale, float lr, const float* m,
                                 float* m_out, const float* r, float* r_out, const float* coef, const float* shift,
                                 float* change, float* ring, int64_t slot, float* g_out, float* avg_out, int* bad,
                                 cudaStream_t stream) {
  if (P == 0) return 0;
  const int threads = 256;
  const unsigned blocks = (unsigned)((P + threads - 1) / threads);
  FEDFAST_DISPATCH_DTYPE(x_dtype, XT, {
    aggregate_kernel<XT><<<blocks, threads, 0, stream>>>(static_cast<const XT*>(X), rows, n, P, w, g, beta, scale, lr,
                                                         m, m_out, r, r_out, coef, shift, change, ring, slot, g_out,
                                                         avg_out, bad);
  });
  return (int)cudaGetLastError();
}
