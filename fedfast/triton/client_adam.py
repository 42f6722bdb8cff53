"""Triton kernel: fused all-client Adam / AdamW step, in place (formulas: fedfast/ops/client_adam_reference.py).

Grid (n rows x column blocks). The per-row scalars (lr / (1 - b1^t_k), sqrt(1 - b2^t_k), 1 - lr_k wd_k) are
[n] tensors the op computes on the device before the launch (no host sync); clipping reuses the SGD step's partial-norm
kernel. Bytes: 28*n*P (theta r/w, grad r, m r/w, v r/w) + 4*n*P with loss rows; + 4*n*P read with clipping.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .client_step import _delta_part, _row_block, clip_factors, delta_finish, delta_parts


@triton.jit
def _adam_kernel(th_ptr, g_ptr, a_ptr, lrows_ptr, clip_ptr, ss_ptr, bc2_ptr, wd_ptr, decay_ptr, m_ptr, v_ptr, act_ptr,
                 df_ptr, dp_ptr, P, mu, b2, w1, w2, eps, WD_ROW: tl.constexpr, HAS_PROX: tl.constexpr,
                 HAS_LROWS: tl.constexpr, CLIP: tl.constexpr, DECOUPLED: tl.constexpr, LERP_LOW: tl.constexpr,
                 ACT: tl.constexpr, DELTA: tl.constexpr, BLOCK: tl.constexpr):
    k, cols, m, offs, g, t = _row_block(th_ptr, g_ptr, a_ptr, lrows_ptr, clip_ptr, act_ptr, P, mu, HAS_PROX, HAS_LROWS,
                                        CLIP, ACT, BLOCK)
    if DECOUPLED:
        t = t * tl.load(decay_ptr + k)
    else:
        wd = tl.load(wd_ptr + k) if WD_ROW else tl.load(wd_ptr)
        g += wd * t
    mo = tl.load(m_ptr + offs, mask=m, other=0.0)
    if LERP_LOW:  # torch.lerp(m, g, w1): m + w1 (g - m) for w1 < 0.5, else g - (g - m)(1 - w1)
        mo = mo + w1 * (g - mo)
    else:
        mo = g - (g - mo) * (1.0 - w1)
    v = tl.load(v_ptr + offs, mask=m, other=0.0) * b2 + w2 * g * g
    tl.store(m_ptr + offs, mo, mask=m)
    tl.store(v_ptr + offs, v, mask=m)
    t = t - tl.load(ss_ptr + k) * (mo / (tl.sqrt(v) / tl.load(bc2_ptr + k) + eps))
    tl.store(th_ptr + offs, t, mask=m)
    if DELTA:
        _delta_part(t, df_ptr, dp_ptr, k, cols, m)


def client_adam_triton(theta, grad, exp_avg, exp_avg_sq, step_size, bc2_sqrt, wd, decay, beta1, beta2, eps, prox_mu,
                       anchor, loss_rows, max_norm, active, delta_from=None, delta_norm=None):
    """``step_size``, ``bc2_sqrt``: [n] fp32 (``fedfast.ops.client_adam._row_scalars``); ``decay``: [n] for AdamW,
    else None (``wd`` [n] or [1], Adam's L2). ``delta_norm`` with ``delta_from``: as the SGD step's."""
    n, P = theta.shape
    BLOCK = 1024
    NB = triton.cdiv(P, BLOCK)
    f32 = lambda t: t.float().contiguous() if t is not None else theta  # noqa: E731
    grad = grad.contiguous()
    clip = clip_factors(theta, grad, f32(anchor), f32(loss_rows), prox_mu, max_norm, BLOCK)
    w1, w2 = 1.0 - float(beta1), 1.0 - float(beta2)
    dfrom, part = delta_parts(theta, delta_from, NB)
    _adam_kernel[(n, NB)](theta, grad, f32(anchor), f32(loss_rows), clip, step_size, bc2_sqrt, wd.float().contiguous(),
                          f32(decay), exp_avg, exp_avg_sq,
                          active.to(torch.int8).contiguous() if active is not None else theta, dfrom, part,
                          P, float(prox_mu), float(beta2), w1, w2, float(eps),
                          WD_ROW=wd.numel() == n and n > 1, HAS_PROX=bool(prox_mu), HAS_LROWS=loss_rows is not None,
                          CLIP=max_norm > 0, DECOUPLED=decay is not None, LERP_LOW=w1 < 0.5,
                          ACT=active is not None, DELTA=delta_from is not None, BLOCK=BLOCK, num_warps=4)
    if delta_from is not None:
        delta_finish(part, delta_norm, active)
