// The losses' row bookkeeping in one launch (reference: fedfast/ops/distill.py row_scale_torch and the deferred
// checks of fedfast/ops/_validate.py; Triton twin: fedfast/triton/row_scale.py; C++: csrc/row_scale_cpu.cpp).
// One block walks the R rows: zero the per-client counts, count the valid rows (target in [0, C), not
// ignore_index) with atomics, write each row's reduction weight 1/n (n: valid rows, or valid rows of the row's
// client), and OR the deferred-validation flags (status[0]: a target neither a class nor ignore_index; status[1]: a
// client id outside [0, limit) or smaller than the one before). One block is enough: the rows of a federated step
// (R <= 65536) are a few microseconds of work, and the kernel exists to replace 9-33 small launches on the host.
#include "common.cuh"
#include "fedfast_kernels.h"

using fedfast_cuda::load_index;

namespace {

__global__ void row_scale_kernel(const void* __restrict__ y, int y_i64, const void* __restrict__ seg, int seg_i64,
                                 int* __restrict__ cnt, float* __restrict__ rs, int* __restrict__ status, int64_t R,
                                 int64_t C, int64_t ignore_index, int64_t limit, int mode) {
  __shared__ int s_bad_t, s_bad_s;
  __shared__ unsigned long long s_n;
  if (threadIdx.x == 0) {
    s_bad_t = 0;
    s_bad_s = 0;
    s_n = 0;
  }
  if (mode == 2)
    for (int64_t i = threadIdx.x; i < R; i += blockDim.x) cnt[i] = 0;
  __syncthreads();
  int bad_t = 0, bad_s = 0;
  unsigned long long n = 0;
  for (int64_t i = threadIdx.x; i < R; i += blockDim.x) {
    const int64_t t = load_index(y, y_i64, i);
    const bool ok = t != ignore_index && t >= 0 && t < C;
    bad_t |= (!ok && t != ignore_index);
    if (seg != nullptr) {
      const int64_t s = load_index(seg, seg_i64, i);
      bad_s |= (s < 0 || s >= limit || (i > 0 && s < load_index(seg, seg_i64, i - 1)));
      if (mode == 2 && ok) atomicAdd(&cnt[s < 0 ? 0 : (s >= R ? R - 1 : s)], 1);
    }
    n += ok;
  }
  if (bad_t) atomicOr(&s_bad_t, 1);
  if (bad_s) atomicOr(&s_bad_s, 1);
  if (mode == 1) atomicAdd(&s_n, n);
  __syncthreads();  // the counts (global, at L2) and the block's totals are complete
  if (mode == 1) {
    const float inv = 1.0f / static_cast<float>(s_n > 0 ? s_n : 1);
    for (int64_t i = threadIdx.x; i < R; i += blockDim.x) rs[i] = inv;
  } else if (mode == 2) {
    for (int64_t i = threadIdx.x; i < R; i += blockDim.x) {
      const int64_t s = load_index(seg, seg_i64, i);
      const int c = __ldcg(&cnt[s < 0 ? 0 : (s >= R ? R - 1 : s)]);  // L2, where the atomics landed
      rs[i] = 1.0f / static_cast<float>(c > 0 ? c : 1);
    }
  }
  if (status != nullptr && threadIdx.x == 0) {
    if (s_bad_t) atomicOr(&status[0], 1);
    if (s_bad_s) atomicOr(&status[1], 1);
  }
}

}  // namespace

extern "C" int fedfast_row_scale(const void* target, int target_i64, const void* segments, int seg_i64, int* counts,
                                 float* row_scale, int* status, int64_t R, int64_t C, int64_t ignore_index,
                                 int64_t limit, int mode, cudaStream_t stream) {
  if (R == 0) return 0;
  row_scale_kernel<<<1, 1024, 0, stream>>>(target, target_i64, segments, seg_i64, counts, row_scale, status, R, C,
                                           ignore_index, limit, mode);
  return (int)cudaGetLastError();
}
