"""Triton kernel: FedGKD-VOTE teacher mixture (Yao et al., Eq. 5), see fedfast/ops/teacher_mixture.py.

``P_i = sum_m w_m softmax(t_mi/tau)`` (not-true: over c != y_i), ``negent_i = sum_m w_m sum_c p log p``.
One program per BLOCK_R rows; for each teacher an online (max, sum-exp) pass, then an accumulate pass
into P (fp32). Bytes: 2*M*R*C*t (two reads per teacher) + (2M-1)*4*R*C (P read-modify-write) + 4R.
Run once per round per cached teacher table, so simplicity beats the last byte here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .distill import _nonfinite, _row_targets, launch_config


@triton.jit
def _mixture_kernel(
    t_ptr,
    w_ptr,
    y_ptr,
    P_ptr,
    neg_ptr,
    M,
    R,
    C,
    inv_tau,
    ignore_index,
    NOT_TRUE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    y, valid, _ = _row_targets(y_ptr, y_ptr, rows, rmask, C, 1, ignore_index, False)
    y = tl.where(valid, y, -1)  # ignored rows mask no column
    cols0 = tl.arange(0, BLOCK_C)
    negent = tl.zeros([BLOCK_R], dtype=tl.float32)
    nb = tl.zeros([BLOCK_R], dtype=tl.float32)  # NaN / +inf logits read in the row, over all teachers
    base = t_ptr
    for mi in range(0, M):
        w = tl.load(w_ptr + mi).to(tl.float32)
        m = tl.zeros([BLOCK_R], dtype=tl.float32) + float("-inf")
        s = tl.zeros([BLOCK_R], dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            cols = c0 + cols0
            m2 = rmask[:, None] & (cols < C)[None, :]
            x = (
                tl.load(base + rows[:, None].to(tl.int64) * C + cols[None, :], mask=m2, other=float("-inf")).to(
                    tl.float32
                )
                * inv_tau
            )
            if NOT_TRUE:
                x = tl.where(cols[None, :] == y[:, None], float("-inf"), x)
            nb += _nonfinite(x)
            m_new = tl.maximum(m, tl.max(x, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe[:, None]), axis=1)
            m = m_new
        ms = tl.where(m == float("-inf"), 0.0, m)
        ls = tl.log(tl.where(s > 0, s, 1.0))  # log p = (x - m) - log s (no m + log s cancellation)
        inv_s = tl.where(s > 0, 1.0 / s, 0.0)
        for c0 in range(0, C, BLOCK_C):
            cols = c0 + cols0
            m2 = rmask[:, None] & (cols < C)[None, :]
            offs = rows[:, None].to(tl.int64) * C + cols[None, :]
            x = tl.load(base + offs, mask=m2, other=float("-inf")).to(tl.float32) * inv_tau
            if NOT_TRUE:
                x = tl.where(cols[None, :] == y[:, None], float("-inf"), x)
            p = tl.exp(x - ms[:, None]) * inv_s[:, None]
            lp = (x - ms[:, None]) - ls[:, None]
            negent += w * tl.sum(tl.where(p > 0, p * tl.where(p > 0, lp, 0.0), 0.0), axis=1)
            acc = tl.load(P_ptr + offs, mask=m2, other=0.0)
            tl.store(P_ptr + offs, acc + w * p, mask=m2)
        base += R * C  # next teacher (pointer increments: no 32-bit overflow of M*R*C)
    # a row with a NaN or +inf logit: P and negent NaN, as IEEE arithmetic gives the formula (whatever the GPU's max
    # does with NaN); stores only on such rows
    bad = nb > 0
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + cols0
        m2 = (rmask & bad)[:, None] & (cols < C)[None, :]
        tl.store(P_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], float("nan"), mask=m2)
    tl.store(neg_ptr + rows, tl.where(bad, float("nan"), negent), mask=rmask)


def teacher_mixture_triton(teachers, weights, target, tau, not_true, ignore_index):
    M, R, C = teachers.shape
    if teachers.dtype == torch.float64:
        raise TypeError("teachers: the triton backend computes in fp32; use backend='reference' or 'cpu' for fp64")
    P = torch.zeros(R, C, dtype=torch.float32, device=teachers.device)
    neg = torch.empty(R, dtype=torch.float32, device=teachers.device)
    if R:
        BR, BC, _, nw = launch_config(C)
        _mixture_kernel[(triton.cdiv(R, BR),)](
            teachers.contiguous(),
            weights.float().contiguous(),
            target.contiguous(),
            P,
            neg,
            M,
            R,
            C,
            1.0 / tau,
            ignore_index,
            NOT_TRUE=not_true,
            BLOCK_R=BR,
            BLOCK_C=BC,
            num_warps=nw,
        )
    return P, neg
