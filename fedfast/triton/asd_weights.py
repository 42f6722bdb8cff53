"""Triton kernel: ASD un-normalised weights (Yashwanth et al., Eq. 10-11), see fedfast/ops/asd_weights.py.

``alphahat_i = exp(-H(softmax(t_i/entropy_tau))) / prior[s_i, y_i]``; the entropy is computed online in
one pass: with running max m, ``s = sum e^{x-m}``, ``u = sum e^{x-m} (x-m)``, ``H = log s - u/s``.
Bytes: R*C*t + 12R (+ gathers of prior).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .distill import _nonfinite, _row_targets, launch_config


@triton.jit
def _asd_kernel(
    t_ptr,
    y_ptr,
    prior_ptr,
    seg_ptr,
    out_ptr,
    R,
    C,
    S,
    inv_tau,
    ignore_index,
    HAS_SEG: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    y, valid, seg = _row_targets(y_ptr, seg_ptr, rows, rmask, C, S, ignore_index, HAS_SEG)
    m = tl.zeros([BLOCK_R], dtype=tl.float32) + float("-inf")
    s = tl.zeros([BLOCK_R], dtype=tl.float32)
    u = tl.zeros([BLOCK_R], dtype=tl.float32)
    nb = tl.zeros([BLOCK_R], dtype=tl.float32)  # NaN / +inf logits in the row: H (and the weight) NaN
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        m2 = rmask[:, None] & (cols < C)[None, :]
        x = (
            tl.load(t_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], mask=m2, other=float("-inf")).to(tl.float32)
            * inv_tau
        )
        nb += _nonfinite(x)
        m_new = tl.maximum(m, tl.max(x, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        ms_old = tl.where(m == float("-inf"), m_safe, m)
        scale = tl.exp(m - m_safe)
        u = scale * (u + s * (ms_old - m_safe))
        s = s * scale
        e = tl.exp(x - m_safe[:, None])
        s += tl.sum(e, axis=1)
        u += tl.sum(tl.where(e > 0, e * (x - m_safe[:, None]), 0.0), axis=1)
        m = m_new
    H = tl.log(tl.where(s > 0, s, 1.0)) - tl.where(s > 0, u / s, 0.0)
    H = tl.where(nb > 0, float("nan"), tl.maximum(H, 0.0))
    py = tl.load(prior_ptr + seg * C + y, mask=valid, other=1.0)
    tl.store(out_ptr + rows, tl.where(valid, tl.exp(-H) / py, 0.0), mask=rmask)


def asd_weights_triton(teacher, target, class_prior, segments, entropy_tau, ignore_index):
    R, C = teacher.shape
    if teacher.dtype == torch.float64:
        raise TypeError("teacher: the triton backend computes in fp32; use backend='reference' or 'cpu' for fp64")
    out = torch.empty(R, dtype=torch.float32, device=teacher.device)
    S = class_prior.shape[0]
    if R:
        BR, BC, _, nw = launch_config(C)
        _asd_kernel[(triton.cdiv(R, BR),)](
            teacher.contiguous(),
            target.contiguous(),
            class_prior.float().contiguous(),
            segments if segments is not None else target,
            out,
            R,
            C,
            S,
            1.0 / entropy_tau,
            ignore_index,
            HAS_SEG=(segments is not None and S > 1),
            BLOCK_R=BR,
            BLOCK_C=BC,
            num_warps=nw,
        )
    return out
