"""Triton kernel: fused all-client Adam / AdamW step, in place (formulas: fedfast/ops/client_adam_reference.py).

Grid (n rows x column blocks). The per-row scalars (lr / (1 - b1^t_k), sqrt(1 - b2^t_k), 1 - lr_k wd_k) are
[n] tensors computed on the device from the step counts before the launch (:func:`adam_row_scalars`, no host sync);
clipping reuses the SGD step's partial-norm kernel. Bytes: 28*n*P (theta r/w, grad r, m r/w, v r/w) + 4*n*P with
loss rows; + 4*n*P read with clipping.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .client_step import _delta_part, _row_block, clip_factors, delta_finish, delta_parts


@triton.jit
def _adam_kernel(
    th_ptr,
    g_ptr,
    a_ptr,
    lrows_ptr,
    clip_ptr,
    ss_ptr,
    bc2_ptr,
    wd_ptr,
    decay_ptr,
    m_ptr,
    v_ptr,
    act_ptr,
    df_ptr,
    dp_ptr,
    P,
    mu,
    b2,
    w1,
    w2,
    eps,
    WD_ROW: tl.constexpr,
    HAS_PROX: tl.constexpr,
    HAS_LROWS: tl.constexpr,
    CLIP: tl.constexpr,
    DECOUPLED: tl.constexpr,
    LERP_LOW: tl.constexpr,
    ACT: tl.constexpr,
    DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    k, cols, m, offs, g, t = _row_block(
        th_ptr, g_ptr, a_ptr, lrows_ptr, clip_ptr, act_ptr, P, mu, HAS_PROX, HAS_LROWS, CLIP, ACT, BLOCK
    )
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


def adam_row_scalars(step, lr, wd, beta1: float, beta2: float, n: int, decoupled: bool):
    """The kernel's per-client scalars [n] fp32, computed on the device in float64 (torch.optim.Adam's Python
    floats): ``lr_k / (1 - b1^t_k)``, ``sqrt(1 - b2^t_k)`` and (AdamW, else None) ``1 - lr_k wd_k``."""
    t64, lr64 = step.double().reshape(n), lr.double().reshape(-1).expand(n)
    step_size = (lr64 / (1.0 - beta1**t64)).float().contiguous()
    bc2_sqrt = torch.sqrt(1.0 - beta2**t64).float().contiguous()
    decay = (1.0 - lr64 * wd.double().reshape(-1).expand(n)).float().contiguous() if decoupled else None
    return step_size, bc2_sqrt, decay


def client_adam_triton(
    theta,
    grad,
    exp_avg,
    exp_avg_sq,
    step,
    lr,
    beta1,
    beta2,
    eps,
    wd,
    decoupled,
    prox_mu,
    anchor,
    loss_rows,
    max_norm,
    active,
    delta_from=None,
    delta_norm=None,
):
    """The compiled backends' argument order (``FEDFAST_CLIENT_ADAM``, fedfast.ops.client_adam). ``grad``: one
    [n, P] tensor or the per-parameter pieces [n, *shape] in column order (put side by side here); ``step`` [n]:
    each client's step count; ``lr``, ``wd``: [1] or [n]. ``delta_norm`` with ``delta_from``: as the SGD step's."""
    n, P = theta.shape
    BLOCK = 1024
    NB = triton.cdiv(P, BLOCK)
    f32 = lambda t: t.float().contiguous() if t is not None else theta  # noqa: E731
    if isinstance(grad, (list, tuple)):
        grad = grad[0] if len(grad) == 1 else torch.cat([g.reshape(n, -1) for g in grad], 1)
    grad = grad.float().reshape(n, P).contiguous()
    step_size, bc2_sqrt, decay = adam_row_scalars(step, lr, wd, float(beta1), float(beta2), n, bool(decoupled))
    clip = clip_factors(theta, grad, f32(anchor), f32(loss_rows), prox_mu, max_norm, BLOCK)
    w1, w2 = 1.0 - float(beta1), 1.0 - float(beta2)
    dfrom, part = delta_parts(theta, delta_from, NB)
    _adam_kernel[(n, NB)](
        theta,
        grad,
        f32(anchor),
        f32(loss_rows),
        clip,
        step_size,
        bc2_sqrt,
        wd.float().contiguous(),
        f32(decay),
        exp_avg,
        exp_avg_sq,
        active.to(torch.int8).contiguous() if active is not None else theta,
        dfrom,
        part,
        P,
        float(prox_mu),
        float(beta2),
        w1,
        w2,
        float(eps),
        WD_ROW=wd.numel() == n and n > 1,
        HAS_PROX=bool(prox_mu),
        HAS_LROWS=loss_rows is not None,
        CLIP=max_norm > 0,
        DECOUPLED=decay is not None,
        LERP_LOW=w1 < 0.5,
        ACT=active is not None,
        DELTA=delta_from is not None,
        BLOCK=BLOCK,
        num_warps=4,
    )
    if delta_from is not None:
        delta_finish(part, delta_norm, active)
