// fedfast CUDA kernels: torch-free extern "C" launchers (raw pointers + cudaStream_t), so each .cu
// compiles with plain `nvcc -c`. The torch-side wrappers live in csrc/bindings_cuda.cpp.
// Dtype codes: 0 = fp32, 1 = bf16, 2 = fp16. Index tensors: int64 if *_i64 else int32.
// Every launcher returns a cudaError_t (cudaSuccess = 0) from the launch.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { FEDFAST_F32 = 0, FEDFAST_BF16 = 1, FEDFAST_F16 = 2 };

// Fused CE + distillation rows (see fedfast/ops/distill_reference.py):
// loss[i] = a_i CE_i + b_i D_i and grad[i, :] = dL_i/dz_i, one warp per row.
// teacher: [R, C] logits, or (negent != NULL) a [R, C] fp32 target distribution. row_scale (nullable):
// per-row reduction weight multiplying both the loss row and its gradient.
int fedfast_distill_rows(const void* student, int s_dtype, const void* teacher, int t_dtype, const void* target,
                         int target_i64, const float* negent, const float* class_alpha, const float* row_weight,
                         const float* row_scale, const float* rho, const float* l1p, const void* segments, int seg_i64, int64_t S,
                         float* loss, void* grad, int64_t R, int64_t C, float inv_tau, float ce_weight,
                         float kd_weight, int64_t ignore_index, int not_true, int soft_ce, cudaStream_t stream);

// out[i, j] = grad[i, j] * grad_loss[i] (fp32 math, stored in the grad dtype).
int fedfast_scale_rows(const void* grad, int g_dtype, const float* grad_loss, void* out, int64_t R, int64_t C,
                       cudaStream_t stream);

// The losses' row bookkeeping, one block: mode 1: row_scale[i] = 1/#valid rows; mode 2: 1/#valid rows of row i's
// segment (counts [R] int32 scratch, segments required); mode 0: checks only. status (NULL: no checks) [>= 2] int32:
// [0] |= 1 if a target is neither in [0, C) nor ignore_index, [1] |= 1 if a segment id is outside [0, limit) or
// decreases.
int fedfast_row_scale(const void* target, int target_i64, const void* segments, int seg_i64, int* counts,
                      float* row_scale, int* status, int64_t R, int64_t C, int64_t ignore_index, int64_t limit,
                      int mode, cudaStream_t stream);

// FedGKD-VOTE: P[i] = sum_m w_m softmax(t_m[i]/tau), negent[i] = sum_m w_m sum_c p log p.
int fedfast_teacher_mixture(const void* teachers, int t_dtype, const float* weights, int64_t M, const void* target,
                            int target_i64, float* P, float* negent, int64_t R, int64_t C, float inv_tau,
                            int64_t ignore_index, int not_true, cudaStream_t stream);

// ASD: out[i] = exp(-H(softmax(t[i]/entropy_tau))) / prior[s_i, y_i], 0 on ignored rows.
int fedfast_asd_weights(const void* teacher, int t_dtype, const void* target, int target_i64, const float* prior,
                        const void* segments, int seg_i64, int64_t S, float* out, int64_t R, int64_t C,
                        float inv_tau, int64_t ignore_index, cudaStream_t stream);

// Fused server update (fedfast/ops/aggregate_reference.py), one thread per column, rows streamed once:
// X [*, P] client rows (x_dtype), rows [n] int64 indices, w [n] normalised weights, g [P]. Optional (NULL):
// m/m_out (momentum); r/r_out [n, P] state rows with coef [n], shift [P] (NULL: 0) and change [P] (the column sum
// of R_k' - R_k); ring [M, P] (row `slot` overwritten in place). bad [n + 1] int32 flags (zeroed by the caller):
// row k holds NaN/inf. Writes g_out, avg_out [P].
int fedfast_aggregate(const void* X, int x_dtype, const int64_t* rows, int64_t n, int64_t P, const float* w,
                      const float* g, float beta, float scale, float lr, const float* m, float* m_out, const float* r,
                      float* r_out, const float* coef, const float* shift, float* change, float* ring, int64_t slot,
                      float* g_out, float* avg_out, int* bad, cudaStream_t stream);

// Fused all-client optimizer step, in place (fedfast/ops/client_step_reference.py). clip [n] per-row factors
// (NULL: none; computed by the caller from fedfast_client_grad_sqnorm). lr, wd: [n] if *_row else [1]. Generic
// terms, each NULL when absent: lrows [n, P] (loss gradient), cvec [P] with cscale [n] (NULL: 1) and crows [n, P]
// with rcoef (correction inside momentum), svec [P] with sscale [n] (NULL: 1; step offset outside momentum).
int fedfast_client_step(float* theta, const float* grad, int64_t n, int64_t P, const float* lr, int lr_row,
                        const float* wd, int wd_row, float prox_mu, const float* anchor, const float* lrows,
                        const float* clip, const float* cvec, const float* cscale, const float* crows, float rcoef,
                        float momentum, float* buf, const float* svec, const float* sscale, const int8_t* active,
                        cudaStream_t stream);

// Per-row squared norm of the loss gradient grad + mu (theta - anchor) + lrows, into sqnorm [n]
// (zeroed by the caller), for per-client clipping.
int fedfast_client_grad_sqnorm(const float* theta, const float* grad, int64_t n, int64_t P, float prox_mu,
                               const float* anchor, const float* lrows, float* sqnorm, cudaStream_t stream);

// Adam / AdamW over all clients, in place (fedfast/ops/client_adam_reference.py). step_size = lr_k / (1 - b1^t_k),
// bc2_sqrt = sqrt(1 - b2^t_k): [n]. decay: [n] 1 - lr_k wd_k for AdamW (NULL: Adam, wd as L2; wd [n] if wd_row
// else [1]). w1 = 1 - b1, w2 = 1 - b2. anchor (with prox_mu), lrows, clip [n], active [n]: NULL when absent.
int fedfast_client_adam(float* theta, const float* grad, int64_t n, int64_t P, float* m, float* v,
                        const float* step_size, const float* bc2_sqrt, const float* wd, int wd_row, const float* decay,
                        float b2, float w1, float w2, float eps, float prox_mu, const float* anchor, const float* lrows,
                        const float* clip, const int8_t* active, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
