// Fused server update on the GPU: one thread per column streams the n participating rows once
// (coalesced across the warp), then applies the server rule, FedDyn / SCAFFOLD state and the FedGKD buffer
// write (formulas: fedfast/ops/aggregate_reference.py). Bytes: n*P*x + 4P*(2 + 2*[m]) + 8nP per kept
// per-client state + 4P [buffer]; the floor for plain FedAvg is 4P(n + 1).
#include "common.cuh"
#include "fedfast_kernels.h"

using namespace fedfast_cuda;

template <typename X>
__global__ void aggregate_kernel(const X* __restrict__ x, const int64_t* __restrict__ rows, int64_t n, int64_t P,
                                 const float* __restrict__ w, const float* __restrict__ g, float beta, float scale,
                                 float lr, const float* __restrict__ m, float* __restrict__ m_out,
                                 const float* __restrict__ h, float* __restrict__ h_out,
                                 const float* __restrict__ hbar, float* __restrict__ hbar_out, float inv_dynK,
                                 const float* __restrict__ c, float* __restrict__ c_out,
                                 const float* __restrict__ ck, float* __restrict__ ck_out,
                                 const float* __restrict__ coef, float inv_scK, float* __restrict__ tb, int64_t slot,
                                 float* __restrict__ g_out, float* __restrict__ avg_out, int* __restrict__ bad) {
  const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= P) return;
  float acc = 0.f, tot = 0.f;
  for (int64_t k = 0; k < n; ++k) {
    const float v = to_f(x[rows[k] * P + j]);
    acc += w[k] * v;
    tot += v;
    if (!isfinite(v)) atomicMax(bad + k, 1);
  }
  const float gj = g[j];
  float newg;
  if (h) {  // FedDyn
    for (int64_t k = 0; k < n; ++k) h_out[k * P + j] = h[k * P + j] + (to_f(x[rows[k] * P + j]) - gj);
    const float hb = hbar[j] + (tot - (float)n * gj) * inv_dynK;
    hbar_out[j] = hb;
    newg = acc + hb;
  } else {
    const float mm = (m ? beta * m[j] : 0.f) + scale * (gj - acc);
    if (m_out) m_out[j] = mm;
    newg = gj - lr * mm;
  }
  if (c) {  // SCAFFOLD
    float dc = 0.f;
    for (int64_t k = 0; k < n; ++k) {
      const float old = ck[k * P + j];
      const float v = old - c[j] + coef[k] * (gj - to_f(x[rows[k] * P + j]));
      ck_out[k * P + j] = v;
      dc += v - old;
    }
    c_out[j] = c[j] + dc * inv_scK;
  }
  g_out[j] = newg;
  avg_out[j] = acc;
  if (!isfinite(acc)) atomicMax(bad + n, 1);
  if (tb) tb[slot * P + j] = newg;
}

extern "C" int fedfast_aggregate(const void* X, int x_dtype, const int64_t* rows, int64_t n, int64_t P,
                                 const float* w, const float* g, float beta, float scale, float lr, const float* m,
                                 float* m_out, const float* h, float* h_out, const float* hbar, float* hbar_out,
                                 float inv_dynK, const float* c, float* c_out, const float* ck, float* ck_out,
                                 const float* coef, float inv_scK, float* tb, int64_t slot, float* g_out,
                                 float* avg_out, int* bad, cudaStream_t stream) {
  if (P == 0) return 0;
  const int threads = 256;
  const unsigned blocks = (unsigned)((P + threads - 1) / threads);
  FEDFAST_DISPATCH_DTYPE(x_dtype, XT, {
    aggregate_kernel<XT><<<blocks, threads, 0, stream>>>(static_cast<const XT*>(X), rows, n, P, w, g, beta, scale, lr,
                                                         m, m_out, h, h_out, hbar, hbar_out, inv_dynK, c, c_out, ck,
                                                         ck_out, coef, inv_scK, tb, slot, g_out, avg_out, bad);
  });
  return (int)cudaGetLastError();
}
